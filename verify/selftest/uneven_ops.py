"""The uneven-window operator's edit (verify/selftest/operators.py): equal_rank_weights makes any trainer average
the ranks equally, as DDP's ÷ W of per-rank means does (trl PR #6713), through torch.distributed alone.

While the trainer runs, each floating all_reduce on the default group first scales this rank's tensor by
C / (W·c_r) (c_r its window's count, valid targets else rows; C every rank's, one int64 all_reduce per window):
summed, then divided by the trainer's global count, each rank's own mean gets weight 1/W — and a count riding
in the tensor still sums to C. A reduction made in C++ (DDP's reducer) is out of its reach. Design:
docs/design/self-test.md.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["equal_rank_weights", "uneven_counts"]


def _count(w) -> float:
    return w.counts[0] if w.ignore is not None else w.counts[2]


def _factor(w, orig) -> float:
    """C / (W·c_r) for this window, computed at its first floating reduction (every rank's is at its boundary)."""
    import torch.distributed as dist

    if getattr(w, "_equal_for", None) is not w.counts:
        dev = next(iter(w.inner.params().values())).device
        mine = int(_count(w))
        total = torch.tensor([mine], dtype=torch.int64, device=dev)  # int64: metadata to the counter, not gradient
        orig(total)
        W = dist.get_world_size()
        w._equal_for, w._equal = w.counts, (float(total) / (W * mine) if mine else 0.0)
    return w._equal


@contextlib.contextmanager
def equal_rank_weights(w):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        yield
        return
    orig = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.is_floating_point() and group in (None, dist.group.WORLD) and op == dist.ReduceOp.SUM:
            tensor.mul_(_factor(w, orig))
        return orig(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = orig


def uneven_counts(c) -> bool:
    """An uneven case where some step's ranks hold different counts (valid targets where padded, else rows)."""
    if not c.uneven:
        return False
    if c.lengths is None:
        return len({sum(r) for r in c.rank_rows}) > 1
    E, out = c.effective_batch, []
    for k in range(c.steps):
        pos, per = k * E, [0] * c.world
        for m, r, rows in c.layout():
            per[r] += sum(c.lengths[pos:pos + rows])
            pos += rows
        out.append(len(set(per)) > 1 and sum(per) > 0)
    return any(out)
