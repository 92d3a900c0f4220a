"""verify.study: the harness's own parts, public for studies and benchmarks of a trainer or of the harness itself
(benchmarks/bench_dist.py, fsdp2_reduce_dtype.py, float64_margins.py). Proving a trainer needs none of it (that is
the plugin and verify.check); what is here keeps its name across releases, the objects behind it may grow fields.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from verify._internal.cases.corners import mesh_padding
from verify._internal.gates.distributed import F32, _split, check_distributed, run_distributed
from verify._internal.gates.floor64 import same_start, start_print
from verify._internal.gates.mesh_counts import axis_of
from verify._internal.gates.table import TABLE
from verify._internal.gates.tolerance import C, EPS32, Judge
from verify._internal.precision import AUTOCAST
from verify._internal.ranks.comm import _TORCH_NAME, Recorder, enable as count_collectives, family
from verify._internal.ranks.pool import RankPool, close_all as close_pools, get_pool as pool
from verify._internal.settings import current as current_settings, install, using
from verify._internal.verdict import Gate

__all__ = ["RankPool", "pool", "close_pools", "install", "using", "current_settings", "strategy", "mesh_padding", "check_distributed", "count_collectives",
           "Recorder", "rank_runs", "Boundary", "boundary", "FLOAT64_BOUND", "float64_deviations",
           "start_print", "same_start", "AUTOCAST",  # the equivalence gate's start check (benchmarks/start_zoo.py)
           "reference_gap", "C"]  # and what its reference must compute (benchmarks/reference_zoo.py)

FLOAT64_BOUND = C * EPS32  # what the float64 checks judge at: what an fp32 run resolves (docs/design/tolerances.md)


def strategy(gate: Gate, adapter, lo: int = 1, hi: int | None = None):
    """The hypothesis strategy a gate's test draws its cases from, for worlds lo..hi (hi: lo)."""
    return TABLE[Gate(gate)].draw.strategy(adapter, lo, lo if hi is None else hi)


def rank_runs(adapter, case, *, gate: Gate = Gate.DP_EQUIVALENCE, pool=None, ref_pool=None) -> list:
    """Each rank's runs of `case` (a data-parallel world or a mesh) and its one-rank references, as the gate judges
    them; read them through `boundary` (the collectives) or their `.runs` / `.refs` traces."""
    return run_distributed(adapter, case, gate=gate, pool=pool, ref_pool=ref_pool)


@dataclass(frozen=True)
class Boundary:
    """One collective at an optimizer step's boundary, as the counter saw it."""
    family: str  # all_reduce, all_gather, reduce_scatter, ... (c10d's names of one op merged)
    axis: str | None  # the mesh axis of its group; None: the default group
    dtypes: tuple[str, ...]  # torch's names: float32, bfloat16, ...
    sizes: tuple


def boundary(outcome, case, step: int = 0) -> list[Boundary]:
    """The collectives of a rank's float32 candidate run at step `step`'s boundary (micro-step N-1 and the step)."""
    steps, _, _ = _split(outcome.runs[F32], case)
    return [Boundary(family(c.op), axis_of(c, case.mesh) if case.mesh is not None else None,
                     tuple(_TORCH_NAME.get(d, d) for d in c.dtypes), c.sizes) for c in steps[step].boundary]


def _deviation(acc64, ref64) -> float:
    """The largest relative deviation a float64 check sees (losses, then every parameter after every step)."""
    out = 0.0
    for la, lr in zip(acc64.losses, ref64.losses):
        if not (math.isnan(la) or math.isnan(lr)):
            out = max(out, abs(la - lr) / (abs(lr) or 1.0))
    for pa, pr in zip(acc64.params, ref64.params):
        for name, p in pr.items():
            if name in pa and p.numel() and pa[name].shape == p.shape:
                out = max(out, (pa[name].double() - p.double()).abs().max().item() / max(1.0, p.abs().max().item()))
    return out


@contextlib.contextmanager
def float64_deviations():
    """Within the block, every float64 check the gates make appends its largest deviation to the yielded list,
    to be read against FLOAT64_BOUND (how far a bug's float64 error sits from the bound)."""
    seen: list[float] = []
    original = Judge._float64

    def record(self, acc64, ref64, *args, **kwargs):
        seen.append(_deviation(acc64, ref64))
        return original(self, acc64, ref64, *args, **kwargs)

    Judge._float64 = record
    try:
        yield seen
    finally:
        Judge._float64 = original


def reference_gap(adapter, case) -> float:
    """err(big) over all parameters at step 0: the big batch of `case` (its precision) against its float64 run, as
    the equivalence gate measures it. Judge.sees refuses a case where C × this reaches 1 (rounding's κ aside)."""
    import torch

    from verify._internal.cases.case import drive
    from verify._internal.gates.floor64 import overall_error

    batches = case.batches(adapter)
    big, ref = (drive(adapter(case.spec(accum_steps=1, dtype=dtype, adapter=adapter)), batches, 1, dtype=dtype,
                      keep_params=False) for dtype in (torch.float32, torch.float64))
    return overall_error(big.grads0, ref.grads0)
