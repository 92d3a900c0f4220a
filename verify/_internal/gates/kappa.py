"""κ, measured where a check needs it: of every step-0 sum (tolerance.conditions, from one float64 run per block)
and of the loss at any step k, from the float64 big batch's parameters at that step. Each in this process or, as a
job, on the one-rank pool where the reference ran. Design: docs/design/tolerance.md ("κ", "Later losses").
"""
from __future__ import annotations

import functools
import math

import torch

from verify._internal.cases.case import Case, Trace, drive, shard
from verify._internal.gates.tolerance import conditions
from verify._internal.verdict import Gate

__all__ = ["fed", "kappa_job", "loss_blocks", "loss_condition", "loss_kappa", "loss_kappa_job"]

F64 = torch.float64


def fed(adapter, targets) -> bool:
    """Whether a block of rows may be run alone as a window: not one without a valid target where the adapter
    declares empty_windows=False (its loss is 0/0 there, and such a trainer may stop on it: torchtitan's guard)."""
    return adapter.ignore_index is None or adapter.empty_windows or bool((targets != adapter.ignore_index).any())


def kappa_job(ctx, adapter, case: Case, ref) -> dict:
    """On a one-rank pool, when a check needs it (lazy κ): κ per parameter and of the loss, of the sums over every
    rank's micro-blocks (tolerance.conditions) against the float64 reference Trace `ref`."""
    return conditions(block_runs(adapter, case, ctx.device, Gate.DP_EQUIVALENCE), ref)


def block_runs(adapter, case: Case, device, gate: Gate | None = None) -> list:
    """float64 step-0 Trace of every block of rows one micro-step of one rank sums (the adapter at
    accum_steps=1 on that block alone): the terms of the sums accumulation computes, its loss's and its
    gradient's. `gate`: whose runs these are (drive). κ reads only each block gradient's norm, so grads0 holds the
    norms (0-d float64 tensors) and no parameters are kept: a block costs host memory of scalars, not of a model.
    A block the adapter is never fed (fed()) adds no term to the sums: its Trace holds no gradient and a NaN loss."""
    inputs, targets = case.batches(adapter)[0]
    out = []
    for r in range(case.world):
        for x, y in shard(inputs, targets, case.window_of(0), r, case.world, case.rank_rows):
            if not fed(adapter, y):  # kept in its place: windows.py reads the blocks of micro-steps 0..m by index
                out.append(Trace(losses=[math.nan], grads0={}, params=[]))
                continue
            t = adapter(case.spec(accum_steps=1, dtype=F64, device=str(device), adapter=adapter))
            run = drive(t, [(x, y)], 1, dtype=F64, device=device, gate=gate, keep_params=False)
            run.grads0 = {k: None if v is None else v.double().norm() for k, v in run.grads0.items()}
            out.append(run)
    return out


def loss_blocks(adapter, case: Case, device, k: int, gate: Gate | None = None, rows: bool = False) -> list[float]:
    """The float64 loss of every block of rows one micro-step of one rank sums in window k (with `rows`, and of
    each row of a block of several), at the parameters the float64 big batch holds there: the adapter at
    accum_steps=1 steps through windows 0..k−1 as the big batch does (the same rows, so the same parameters,
    bit for bit), then sees the block (the row) alone as window k. A loss's κ takes rows: one whose rows cancel
    inside a block (a policy gradient's advantages, the other micro-batches empty) is resolved no better than
    its largest row (docs/design/tolerance.md, "Later losses"). A block or row the adapter is never fed (fed()):
    NaN, undefined, as its 0/0 would be (loss_condition leaves it out)."""
    batches = case.batches(adapter)
    x, y = batches[k]

    def loss(bx, by) -> float:
        if not fed(adapter, by):
            return math.nan
        t = adapter(case.spec(accum_steps=1, dtype=F64, device=str(device), adapter=adapter))
        return drive(t, batches[:k] + [(bx, by)], 1, dtype=F64, device=device, gate=gate, keep_params=False).losses[k]

    blocks = [b for r in range(case.world) for b in shard(x, y, case.window_of(k), r, case.world, case.rank_rows)]
    rows_of = [(bx[j:j + 1], by[j:j + 1]) for bx, by in blocks if len(bx) > 1 for j in range(len(bx))] if rows else []
    return [loss(bx, by) for bx, by in blocks + rows_of]


def loss_condition(blocks: list, whole: float) -> float:
    """κ of a loss: max over its blocks and their rows of |L_block| / |L| (≥ 1 for a mean over rows or valid tokens,
    a convex combination of its blocks; 1 where the loss or every block is undefined, or the loss is exactly 0)."""
    top = max((abs(v) for v in blocks if v is not None and math.isfinite(v)), default=0.0)
    return max(1.0, top / abs(whole)) if math.isfinite(whole) and whole != 0 else 1.0


def loss_kappa(adapter, case: Case, device, ref, gate: Gate | None = None):
    """k -> κ of window k's loss against the float64 big batch Trace `ref` (Judge.float64's loss_kappa), in this
    process, each k measured once; None where a window is one block (N·W = 1: nothing is summed)."""
    if case.accum_steps * case.world == 1 and case.rank_rows is None:
        return None
    return functools.cache(lambda k: loss_condition(loss_blocks(adapter, case, device, k, gate, rows=True), ref.losses[k]))


def loss_kappa_job(ctx, adapter, case: Case, k: int, whole: float) -> float:
    """On a one-rank pool: κ of window k's loss, `whole` the float64 big batch's loss of that window."""
    return loss_condition(loss_blocks(adapter, case, ctx.device, k, Gate.DP_EQUIVALENCE, rows=True), whole)
