"""What a verify.memory run measures: the configurations of both sweeps, the trainer (an Adapter) and its
options, the device, the world. The CLI (verify/memory/cli.py, `build_plan`) turns the flags into a
Plan; this module knows no trainer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB, GiB = 2**20, 2**30


def byte_unit(cuda: bool) -> tuple[str, int]:
    """The one rule of every table, plot and progress line: GiB on a GPU, MiB on the CPU."""
    return ("GiB", GiB) if cuda else ("MiB", MiB)


def report_unit(report: dict) -> tuple[str, int]:
    return byte_unit(report["settings"]["device"].startswith("cuda"))


def fmt_bytes(b, report: dict) -> str:
    """Bytes in the report's unit (3 decimals of a GiB, 1 of a MiB); — for None."""
    if b is None:
        return "—"
    unit, scale = report_unit(report)
    return f"{b / scale:.3f}" if unit == "GiB" else f"{b / scale:.1f}"


@dataclass
class Config:
    N: int
    B: int
    sweeps: tuple[str, ...]


@dataclass
class Plan:
    E: int
    world: int
    rank: int
    device: Any  # torch.device
    adapter: Any  # verify._internal.protocol.Adapter
    trainer: str
    """--trainer as given: a short name of the CLI, or MODULE:FACTORY."""
    options: Any
    """Spec.options of every configuration (the CLI's choice: the adapter's defaults, or built from flags)."""
    steps: int
    threads: int
    out: Path
    anchor: Any = None
    """Path or importlib.resources Traversable of an anchor JSON (verify/memory/anchor.py) that applies to
    this run, or None"""
    anchor_note: str = ""
    """What the anchor is, in words, for the report"""
    model_name: str | None = None
    """The model's name, a dict of its config, its sequence length and parameter count, where the CLI
    knows them (for the report; None: the model is the adapter's business)"""
    model: dict | None = None
    model_text: str | None = None
    seq_len: int | None = None
    n_params: int | None = None
    sources: tuple[str, ...] = ("verify",)
    """Packages whose source the report's sources_sha256 covers (with the adapter's own module)."""
    warmup: int = 1
    """Warm-up optimizer steps before the probe: 1 in one process (the anchor's protocol), 2 under torchrun
    (torch DDP rebuilds its gradient buckets in the forward of its second iteration)."""
    sweep: str = "full"
    """SWEEPS: which configurations plan_configs gives"""
    configs: list[Config] = field(default_factory=list)

    @property
    def E_local(self) -> int:
        return self.E // self.world

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


SWEEPS = ("full", "ends")
"""full: every N of both sweeps; ends: N = 1, 2 and E of each, the rows the four claims compare (a trainer of
production size costs a build and E micro-steps a row, so E large enough to show its activations stays affordable)."""


def plan_configs(e_local: int, sweep: str = "full") -> list[Config]:
    """Sweep A (N | E, B = E/N, ascending N), then sweep B (B = 1, N = 1, 2, 4, ... ≤ E); shared ones once."""
    a = [(n, e_local // n) for n in range(1, e_local + 1) if e_local % n == 0]
    b, n = [], 1
    while n <= e_local:
        b.append((n, 1))
        n *= 2
    if sweep == "ends":  # (b1) then compares N = 2 with N = E: flat across the whole range
        a = [(n, bb) for n, bb in a if n in (1, 2, e_local)]
        b = sorted({(n, 1) for n in (1, 2, e_local) if n <= e_local})
    out = [Config(n, bb, ("A", "B") if (n, bb) in b else ("A",)) for n, bb in a]
    out += [Config(n, bb, ("B",)) for n, bb in b if (n, bb) not in a]
    return out
