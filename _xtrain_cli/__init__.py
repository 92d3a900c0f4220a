"""The command lines' plumbing, shared by xtrain's (xtrain_core/cli.py) and the harness's (verify/_internal/cli.py),
neither of which may import the other: bad input is one line on stderr and exit code 2, never a traceback.
Standard library only (resolve_device and available_memory import torch when called on a GPU)."""
from __future__ import annotations

import argparse
import sys
import time

__all__ = ["UsageError", "Parser", "PROG", "fail", "int_at_least", "positive_int", "nonneg_int", "Progress",
           "writable_dir", "available_memory", "check_fits", "resolve_device"]


class UsageError(Exception):
    """Bad user input. str(e) is the whole message: it names the flag and the fix."""


class Parser(argparse.ArgumentParser):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        PROG[0] = self.prog

    def error(self, message):  # argparse would print the usage block too: keep it to one line
        fail(f"{message} (see --help)")


PROG = ["xtrain"]  # set by each entry point, so errors read "xtrain_core.train: error: ..."


def fail(message: str, code: int = 2):
    print(f"{PROG[0]}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def int_at_least(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi], with an error that names the bound and the input. hi is a
    size a run can ever meet: past it the run could only exhaust memory or time, so it is refused up front."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer ≥ {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be ≥ {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be ≤ {hi}, got {v}")
        return v

    return parse


positive_int, nonneg_int = int_at_least(1), int_at_least(0)


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a TTY, a line every ~10% otherwise)."""

    def __init__(self, total: int, label: str = "", stream=None):
        self.total, self.label, self.stream = total, label, stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0, self._last = time.perf_counter(), -1

    def update(self, done: int, info: str = "") -> None:
        frac = done / self.total if self.total else 1.0
        bar = "#" * int(24 * frac)
        line = f"{self.label}[{bar:<24}] {done}/{self.total} {info}"
        if self.tty:
            self.stream.write("\r" + line + " " * 4)
            if done == self.total:
                self.stream.write("\n")
        else:
            decile = int(10 * frac)
            if decile != self._last or done == self.total:
                self.stream.write(line + "\n")
                self._last = decile
        self.stream.flush()


def writable_dir(flag: str, path) -> None:
    """Create `path` if needed; UsageError naming the flag unless a file can be written there (checked
    before any work, so a bad --out fails now, not after minutes of measuring)."""
    import os
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def available_memory(device) -> tuple[int, str]:
    """(bytes a new allocation can still get, where that number comes from) on `device`: a GPU's free memory
    (torch.cuda.mem_get_info), else the OS's MemAvailable (/proc/meminfo; elsewhere the free physical pages)."""
    import os

    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical memory"


def check_fits(need: int, device, what: str, fix: str, *, at_least: bool = False) -> None:
    """UsageError, one line, when `need` bytes (an estimate made before anything is allocated) exceed what
    `device` has available: the allocator's traceback or the OOM killer would otherwise say it, minutes later.
    at_least: `need` is a lower bound (the message says so)."""
    have, source = available_memory(device)
    if need > have:
        raise UsageError(f"{what}: needs {'at least' if at_least else 'about'} {need / 2**30:,.1f} GiB, the machine has {have / 2**30:,.1f} GiB "
                         f"({source}); {fix}")


def resolve_device(name: str):
    """'cpu' | 'cuda' | 'cuda:K' -> torch.device, or UsageError naming --device."""
    import torch

    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise UsageError(f"--device must be cpu, cuda or cuda:K, got {name!r}") from None
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA GPU is visible to torch; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise UsageError(f"--device {name}: only {n} GPU(s) visible (cuda:0..cuda:{n - 1}); pass one of those")
        return dev
    raise UsageError(f"--device must be cpu, cuda or cuda:K, got {name!r}")
