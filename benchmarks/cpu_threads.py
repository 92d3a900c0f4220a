"""How `python -m xtrain_core.train` holds up on a CPU that other processes keep busy (a benchmark, not a test).

    python -m benchmarks.cpu_threads [--out reports] [--steps 12] [--models tiny,small] [--busy 0,1,2]

For each model and each number of busy-looping neighbour processes, trains the same run under each
threading setting, side by side in one run (settings interleaved, best of --reps), and reports tokens/s:

  spinning      --threads <cores>, OMP_WAIT_POLICY=ACTIVE: idle OpenMP threads spin (GNU OpenMP's way when
                the wait policy is unset: it spins for a while before sleeping)
  passive       --threads <cores>, OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep
  one-thread    --threads 1
  xtrain-auto   what the CLI does by itself (--threads auto: one thread unless OMP_NUM_THREADS is set)

Writes OUT/cpu-threads.json (the common header) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from xtrain_core.cli import Parser, UsageError, fail, positive_int, writable_dir
from xtrain_core.config import PRESETS

CORES = os.cpu_count() or 1
# name -> (environment, --threads)
SETTINGS = {
    "spinning": ({"OMP_WAIT_POLICY": "ACTIVE"}, str(CORES)),  # torch's default threads, OpenMP threads spin
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, str(CORES)),
    "one-thread": ({}, "1"),
    "xtrain-auto": ({}, "auto"),  # what the CLI does by itself
}
CLEAN = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")


def run_once(model: str, steps: int, setting) -> float:
    env_extra, threads = setting
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "xtrain_core.train", "--model", model, "--steps", str(steps), "--accum-steps", "2",
           "--micro-batch", "4", "--seq-len", "64", "--threads", threads]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1])
    m = re.search(r"\(([\d,]+) tok/s\)", r.stdout.splitlines()[-1])
    return float(m.group(1).replace(",", ""))


def _models(text: str) -> list[str]:
    names = text.split(",")
    for n in names:
        if n not in PRESETS:
            raise argparse.ArgumentTypeError(f"unknown model {n!r}; choose from {', '.join(PRESETS)}")
    return names


def _busy(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not all(0 <= c <= 8 for c in counts):
        raise argparse.ArgumentTypeError(f"each must be 0..8 busy neighbours, got {text!r}")
    return counts


def main(argv=None) -> int:
    p = Parser(prog="benchmarks.cpu_threads", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--steps", type=positive_int, default=12)
    p.add_argument("--reps", type=positive_int, default=2)
    p.add_argument("--models", type=_models, default="tiny,small", help=f"comma-separated, of {', '.join(PRESETS)}")
    p.add_argument("--busy", type=_busy, default="0,1,2", help="comma-separated numbers of busy neighbours (0-8)")
    a = p.parse_args(argv)
    try:
        writable_dir("--out", a.out)
    except UsageError as e:
        fail(str(e))
    rows = []
    for model in a.models:
        for busy in a.busy:
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                time.sleep(0.5)
                best = {k: 0.0 for k in SETTINGS}
                for _ in range(a.reps):
                    for name, setting in SETTINGS.items():
                        best[name] = max(best[name], run_once(model, a.steps, setting))
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            rows.append(dict(model=model, busy=busy, tok_s=best))
            print(f"{model:6s} busy={busy}: " + "  ".join(f"{k} {v:9,.0f}" for k, v in best.items()), flush=True)
    from verify._meta import atomic_write, header

    doc = dict(header("cpu-threads"), settings={k: dict(env=e, threads=t) for k, (e, t) in SETTINGS.items()},
               steps=a.steps, reps=a.reps, rows=rows)
    path = os.path.join(a.out, "cpu-threads.json")
    atomic_write(path, json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
