"""Expected collective counts by type: one declarative row per sync mode, checked per micro-step and per step.

A row says, for one optimizer step of a trainer in one sync mode, how many collectives of each family it
issues on each micro-step before the boundary and at the boundary (micro-step N-1 + optimizer_step()),
and how many floating-point elements its boundary reductions carry (the bytes per step). Anything the row
does not name must not happen. Examples (U = FSDP units, the root included):

    DDP, no_sync()                          before: —                   boundary: all_reduce ≥ 1 (buckets)
    FSDP2, reshard after forward            before: all_gather × 2U     boundary: all_gather × 2U, reduce_scatter × U
    FSDP2, no reshard after forward         before: all_gather × U      boundary: all_gather × U, reduce_scatter × U

Families merge the names c10d gives one operation on different paths and backends (all_gather,
_allgather_base, allgather_into_tensor_coalesced, ... are "all_gather"). Where a backend implements an
operation with another collective (gloo has no reduce-scatter: FSDP2 all-reduces there), the adapter's
row names what that backend does. A deviation fails with the row and the collectives observed.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["CountRow", "family", "families", "check_row"]


def family(op: str) -> str:
    o = op.lower().replace("_", "")
    for name in ("reducescatter", "allgather", "allreduce", "broadcast", "barrier", "alltoall", "send", "recv"):
        if name in o:
            return {"reducescatter": "reduce_scatter", "allgather": "all_gather", "allreduce": "all_reduce",
                    "alltoall": "all_to_all"}.get(name, name)
    return op


def families(cs) -> Counter:
    return Counter(family(c.op) for c in cs)


@dataclass(frozen=True)
class CountRow:
    """Expected collectives of one optimizer step in one sync mode (see the module docstring). Counts are
    exact ints, or (lo, hi) with hi None for "at least lo"."""

    mode: str
    before: dict = field(default_factory=dict)  # family -> count on EACH micro-step 0..N-2
    boundary: dict = field(default_factory=dict)  # family -> count at the boundary
    elements: tuple | None = None  # (lo, hi) floating elements reduced at the boundary; None: the default rule
    first_micro: dict = field(default_factory=dict)  # extra on micro-step 0 of step 0 (e.g. a graph-recording pass)
    skipped: dict = field(default_factory=dict)  # family -> count the boundary leaves out on a step the trainer
    # skips whole (a window without a valid token: no clip, no update), e.g. clipping's norm all-reduce

    def describe(self) -> str:
        f = lambda d: ", ".join(f"{k}×{_fmt(v)}" for k, v in sorted(d.items())) or "none"  # noqa: E731
        return f"'{self.mode}': before the boundary {f(self.before)}; at the boundary {f(self.boundary)}"


def _fmt(v) -> str:
    if isinstance(v, tuple):
        lo, hi = v
        return f"≥{lo}" if hi is None else f"{lo}..{hi}"
    return str(v)


def _ok(v, n: int) -> bool:
    if isinstance(v, tuple):
        lo, hi = v
        return n >= lo and (hi is None or n <= hi)
    return n == v


def check_row(row: CountRow, observed: list, want: dict, where: str, describe, extra: dict | None = None,
              less: dict | None = None) -> str | None:
    """None if `observed` (collectives of one window) has exactly the families of `want` (plus `extra`, minus
    `less`), else the failure text naming the row and every collective seen."""
    seen = families(observed)
    need = dict(want)
    for k, v in (extra or {}).items():
        need[k] = need.get(k, 0) + v if isinstance(need.get(k, 0), int) and isinstance(v, int) else v
    for k, v in (less or {}).items():
        need[k] = need.get(k, 0) - v if isinstance(need.get(k, 0), int) else need.get(k, 0)
    bad = [k for k in set(seen) | set(need) if not _ok(need.get(k, 0), seen.get(k, 0))]
    if not bad:
        return None
    got = ", ".join(f"{k}×{n}" for k, n in sorted(seen.items())) or "none"
    exp = ", ".join(f"{k}×{_fmt(v)}" for k, v in sorted(need.items())) or "none"
    off = [c for c in observed if family(c.op) in bad] + [c for c in observed if family(c.op) not in bad]
    listed = "; ".join(describe(c) for c in off[:4]) + (f" (+{len(off) - 4} more)" if len(off) > 4 else "")
    return (f"{where}: count table row {row.mode!r} expects {exp}, observed {got}" + (f": {listed}" if listed else ""))
