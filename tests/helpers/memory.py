"""Shared by the memory tests (tests/test_memory_*.py): the CLI in a subprocess, its environment, synthetic
rows and a synthetic report (`from tests.helpers.memory import ...`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verify.memory.invariants import check_invariants
from verify.memory.plan import MiB, plan_configs

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(k, None)
HAS_CUDA = torch.cuda.is_available()


def memory_cli(*args, timeout=240, torchrun=None, env=None):
    pre = [sys.executable, "-m", "verify.memory"] if torchrun is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}", "-m", "verify.memory"]
    # own session, so a hang is killed with everything it started (ranks, probe processes), not orphaned
    p = subprocess.Popen([*pre, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV,
                         cwd=str(REPO), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"verify.memory {' '.join(args)} timed out after {timeout} s; stderr tail: {err[-2000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# Small CPU sweep: E=4 on the 'small' preset at S=256 gives 5 configurations whose activations are far above
# the 4 MiB noise floor (peak(1,4) ≈ 87 MiB, peak(4,1) ≈ 36 MiB, peak(1,1) ≈ 23 MiB), ~10 s.
SMALL = ["--effective-batch", "4", "--device", "cpu", "--model", "small", "--steps", "1", "--threads", "1"]


def report_of(out: Path, E=4) -> dict:
    return json.loads((out / f"memory-E{E}.json").read_text())


def rows(peaks: dict, grad=10 * MiB, rank=0) -> list[dict]:
    out = []
    for c in plan_configs(max(n * b for n, b in peaks)):
        out.append(dict(N=c.N, B=c.B, sweeps=list(c.sweeps), rank=rank, grad_bytes=grad, peak_bytes=int(peaks[(c.N, c.B)] * MiB)))
    return out


def fake_report() -> dict:
    rs = rows({(1, 4): 90, (2, 2): 60, (4, 1): 36, (1, 1): 23, (2, 1): 36})
    configs = [dict(N=r["N"], B=r["B"], eff=r["N"] * r["B"], sweeps=r["sweeps"], peak_bytes=r["peak_bytes"],
                    ranks=[dict(r, step_ms=1.0, tok_s=2.0, S=256)]) for r in rs]
    return dict(schema_version=1, kind="memory", utc="2026-01-01T00:00:00+00:00", git_commit=None, git=dict(dirty=None),
                verdict="PASS", machine_info=dict(python="3", torch="2", cuda=None, gpu=None, cpu_count=2, cpu_model="x"),
                settings=dict(effective_batch=4, world_size=1, device="cpu", model_name="small", seq_len=256,
                              measured_steps=1, trainer="xtrain", threads=1, n_params=1,
                              model=dict(n_layer=1, n_head=1, d_model=8, vocab_size=8)),
                probe=dict(primary="p", includes="i", isolation="fresh"),
                thresholds=dict(rel=0.02, abs_noise_bytes=4 * MiB, well_below="w", rise="r"),
                static=dict(param_bytes=MiB, grad_bytes=MiB, optim_state_bytes=2 * MiB, static_bytes=4 * MiB),
                configs=configs, invariants=check_invariants([rs], E_local=4, cuda=False), anchor=None)

