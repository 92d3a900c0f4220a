"""The padded corners of the mesh gates, for token-weighted trainers (an ignore_index): where a per-rank count shows.

A right-padded row's padding sits at its end, and cp rank c holds tokens [c·S/cp, (c+1)·S/cp) of it (cp_slice): the
LAST cp rank gets the padding, so its valid count differs from the others' on every padded row — the field's common
case. A trainer whose cp ranks each divide by their own count is exact on unpadded rows and wrong here; one whose dp
replicas each take their own mean, likewise wrong where one replica's micro-batch is empty.

Design: docs/design/distributed.md, "Padded meshes".
"""
from __future__ import annotations

__all__ = ["mesh_padding", "corner_axes"]


def corner_axes(adapter) -> list[str]:
    """The axes the mesh gate's corners put two ranks on: pp, tp, cp where declared; dp too for a token-weighted
    adapter (its padded corner empties one replica's micro-batch: a per-replica mean shows only there)."""
    padded = adapter.ignore_index is not None
    return [a for a in ("pp", "tp", "cp", "dp") if a in adapter.mesh_axes and (a != "dp" or padded)]


def mesh_padding(*, steps: int, accum_steps: int, micro_batch: int, dp: int, seq_len: int, cp: int) -> tuple:
    """Valid targets per row, in the harness's row order (step, micro-step, dp replica, row), right-padded:

        window 0, micro-batch 0   each replica's first row one token short (the last cp rank holds a padded part of
                                  it), its other rows within the first cp ranks' tokens (the last holds only padding)
        window 0, micro-batch 1   empty on the last dp replica (at dp = 1: an empty micro-batch); short elsewhere
        window 0, later ones      full rows
        window 1 and later        every row within the first cp ranks' tokens: the last cp rank holds only padding in
                                  the whole window (its own count is 0), no window without a valid target

    cp = 1 (a dp, pp or tp corner): the same shape with the rows' second half as the "last cp rank"."""
    cut = seq_len - seq_len // cp if cp > 1 else max(1, seq_len // 2)  # tokens before the last cp rank's share
    short = max(1, cut - 1)
    out = []
    for k in range(steps):
        for m in range(accum_steps):
            for r in range(dp):
                for b in range(micro_batch):
                    if k > 0:
                        out.append(cut if b % 2 == 0 else 1)
                    elif m == 0:
                        out.append(seq_len - 1 if b == 0 else short)
                    elif m == 1:
                        out.append(0 if r == dp - 1 else short)
                    else:
                        out.append(seq_len)
    return tuple(out)
