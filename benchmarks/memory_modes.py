"""python -m benchmarks.memory_modes --effective-batch E --world W [--device cpu|cuda] [--modes M,M,...]
                              [--model NAME] [--seq-len S] [--steps K] [--warmup K] [--threads T]
                              [--out DIR] [--name STEM] [--timeout S] [--budget S]

Peak memory per data-parallel mode: runs `torch.distributed.run --standalone --nproc-per-node W -m
verify.memory --trainer MODE ...` once per mode (xtrain, torch_ddp, fsdp2, fsdp2_keep by default), each
with the same model, data, E and protocol, and writes one combined report, OUT/STEM.json/.md/.png
(default STEM memory-modes): every mode's invariants (is the peak flat in N at fixed B?), its measured
peaks per rank beside the memory model's prediction (xtrain_proof/memory.py) and their ratio, and each
mode's full verify.memory report inside the JSON.

Progress is one line per mode on stderr. Exit status: 0 every mode PASS, 1 a mode fails (an invariant,
an absurd prediction ratio, or the run itself: one line naming the mode and why), 3 INCONCLUSIVE (no
mode fails, one cannot be decided at this size), 2 bad input (verify.memory's codes).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verify.memory.cli import Parser, UsageError, fail, positive_int, writable_dir
from xtrain_core.config import PRESETS

from xtrain_proof.memory_preset import MODE_TRAINERS
from verify.memory.plan import GiB, MiB

MODES = tuple(MODE_TRAINERS)


def parse_args(argv=None):
    p = Parser(prog="benchmarks.memory_modes", description=__doc__.split("\n\n")[1],
               epilog="Exit status: 0 every mode passes, 1 one fails, 2 bad input.")
    p.add_argument("--effective-batch", type=positive_int, default=8, metavar="E", help="over all ranks (default 8)")
    p.add_argument("--world", type=positive_int, default=2, metavar="W", help="ranks (default 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)} (default: all)")
    p.add_argument("--model", choices=sorted(PRESETS), default=None, help="default: verify.memory's (cpu small, cuda gpt2-ish)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="default: the model's limit")
    p.add_argument("--steps", type=positive_int, default=None, help="measured optimizer steps (verify.memory's default)")
    p.add_argument("--warmup", type=positive_int, default=None, help="warm-up steps (verify.memory's default: 2 under torchrun)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads per rank (default 1 on cpu)")
    p.add_argument("--out", default="reports", help="directory for STEM.json/.md/.png (default reports/)")
    p.add_argument("--name", default="memory-modes", metavar="STEM", help="file stem (default memory-modes)")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds per mode (default 600)")
    p.add_argument("--budget", type=positive_int, default=None, metavar="S",
                   help="seconds for all modes: each gets at most what is left (a mode not started is an error)")
    return p.parse_args(argv)


def check(args) -> list[str]:
    """The modes, or UsageError (one line) for input that cannot run here."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UsageError(f"--modes {args.modes}: unknown mode {', '.join(bad) or '(none given)'}; use {', '.join(MODES)}")
    if args.effective_batch % args.world:
        raise UsageError(f"--effective-batch {args.effective_batch} is not divisible by --world {args.world}")
    if args.device == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if args.world > cores:
            raise UsageError(f"--world {args.world} exceeds the {cores} CPU cores here: each rank measures on a core "
                             f"of its own; pass --world ≤ {cores}")
    else:
        import torch

        if torch.cuda.device_count() < args.world:
            raise UsageError(f"--world {args.world} needs {args.world} CUDA GPUs, {torch.cuda.device_count()} visible")
    model = args.model or ("gpt2-ish" if args.device == "cuda" else "small")
    if args.seq_len is not None and args.seq_len > PRESETS[model].seq_len:
        raise UsageError(f"--seq-len {args.seq_len} exceeds --model {model}'s limit of {PRESETS[model].seq_len}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        raise UsageError(f"--name {args.name}: letters, digits, '.', '_' and '-' only")
    writable_dir("--out", args.out)
    return modes


def _argv(args, mode: str, out: Path) -> list[str]:
    a = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}",
         "-m", "verify.memory", "--effective-batch", str(args.effective_batch), "--device", args.device,
         "--trainer", mode, "--out", str(out)]
    for flag, v in (("--model", args.model), ("--seq-len", args.seq_len), ("--steps", args.steps),
                    ("--warmup", args.warmup), ("--threads", args.threads or (1 if args.device == "cpu" else None))):
        if v is not None:
            a += [flag, str(v)]
    return a


def _why(err: str, code: int) -> str:
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    own = [ln for ln in lines if re.match(r"verify\.memory(\.\w+)?: error:", ln)]
    return f"exit {code}: " + (own[-1] if own else next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output"))


def _tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc (torchrun starts its ranks in sessions of their own, so its
    process group does not hold them, nor the ranks' probe processes)."""
    kids: dict[int, list[int]] = {}
    for d in (d for d in (os.listdir("/proc") if os.path.isdir("/proc") else []) if d.isdigit()):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        out.append(q)
        todo += kids.get(q, [])
    return out


def _kill(p: subprocess.Popen) -> None:
    """SIGKILL the run this call started: torchrun, its ranks, their zygotes and probe processes, by pid."""
    for q in _tree(p.pid):
        try:
            os.kill(q, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    p.wait()


def run_mode(args, mode: str, work: Path, timeout: float | None = None) -> dict:
    """One mode's torchrun; its report (or the one-line reason there is none)."""
    from verify.memory.runners import package_root

    out = work / mode
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([package_root(), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = _argv(args, mode, out)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        p = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, start_new_session=True, text=True)
        timeout = timeout or args.timeout
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(p)
            code = None
        except KeyboardInterrupt:
            _kill(p)
            raise
        se.seek(0)
        err = se.read()
    wall = time.perf_counter() - t0
    path = out / f"memory-E{args.effective_batch}.json"
    rep = json.loads(path.read_text()) if code is not None and path.is_file() else None
    res = dict(mode=mode, command=" ".join(shlex.quote(c) for c in cmd[1:]), exit_code=code, wall_s=wall, report=rep,
               stderr_tail=err[-4000:])
    if code is None:
        res.update(verdict="ERROR", error=f"timed out after {timeout:.0f} s")
    elif rep is None:
        res.update(verdict="ERROR", error=_why(err, code))
    else:
        res.update(verdict=rep["verdict"], error=None)
    return res


def _summary(res: dict, unit) -> str:
    rep = res["report"]
    if rep is None:
        return res["error"]
    name, scale = unit
    flat = sorted((c for c in rep["configs"] if "B" in c["sweeps"] and c["peak_bytes"] is not None), key=lambda c: c["N"])
    peaks = ", ".join(f"{c['peak_bytes'] / scale:.1f}" for c in flat)
    ratios = [x["pred_ratio"] for c in rep["configs"] for x in c["ranks"] if x.get("pred_ratio") is not None]
    rr = f"; measured/predicted {min(ratios):.2f}–{max(ratios):.2f}" if ratios else ""
    failed = [f"({v['id']}) {v['status']}" for v in rep["invariants"] if v["status"] not in ("PASS", "N/A")]
    if (rep.get("prediction") or {}).get("verdict") == "FAIL":
        failed.append("(model) FAIL")
    return f"B=1 peaks by N {peaks} {name}{rr}" + (f"; {', '.join(failed)}" if failed else "")


def main(argv=None) -> int:
    from verify.memory import report as single_report  # the verdicts' exit codes and the INCONCLUSIVE hint

    from . import memory_modes_report as mr

    args = parse_args(argv)
    try:
        modes = check(args)
    except UsageError as e:
        fail(str(e))
    unit = ("GiB", GiB) if args.device == "cuda" else ("MiB", MiB)
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="verify-memory-modes-") as work:
        for i, mode in enumerate(modes, 1):
            left = None if args.budget is None else args.budget - (time.perf_counter() - t0)
            if left is not None and left < 5:
                res = dict(mode=mode, command=None, exit_code=None, wall_s=0.0, report=None, stderr_tail="",
                           verdict="ERROR", error=f"not run: --budget {args.budget} s spent")
            else:
                print(f"[{i}/{len(modes)}] {mode}: torchrun --nproc-per-node {args.world} -m verify.memory --trainer "
                      f"{mode} ...", file=sys.stderr, flush=True)
                res = run_mode(args, mode, Path(work), None if left is None else min(args.timeout, left))
            results.append(res)
            print(f"[{i}/{len(modes)}] {mode}: {res['verdict']} in {res['wall_s']:.1f} s — {_summary(res, unit)}",
                  file=sys.stderr, flush=True)
    report = mr.assemble(args, results, argv, time.perf_counter() - t0)
    paths = mr.write_all(report, Path(args.out), args.name)
    print(mr.text_table(report), flush=True)
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    if report["verdict"] == "INCONCLUSIVE":
        print(single_report.INCONCLUSIVE_HINT, flush=True)
    return single_report.EXIT_CODES[report["verdict"]]


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        fail("interrupted", code=130)
