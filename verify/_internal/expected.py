"""What a trainer may issue before the boundary: `Expected` declarations (Adapter.expected), and the ones
torch DDP needs. Re-exported by verify._internal.protocol and verify."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Expected:
    """Collectives a trainer is expected to issue BEFORE the boundary (micro-steps 0..N-2): at most
    `count` of op `op` carrying `dtype` data ('integer', 'floating' or 'any') in each matching window. `op`
    matches by family (verify._internal.ranks.comm.family: "all_reduce" matches allreduce_coalesced, _allreduce_base, ...).
    `step` / `micro` = None match every optimizer step / micro-step."""

    op: str
    count: int = 1
    dtype: str = "any"
    step: int | None = None
    micro: int | None = None
    why: str = ""
    world: int | None = None
    """Only in runs of this world size (None: every world), e.g. a one-rank group's own reductions."""
    numel: int | None = None
    """Only collectives of this many elements (None: any size); CountRow.side entries must give it."""

    def __post_init__(self):
        if self.dtype not in ("integer", "floating", "any"):
            raise ValueError(f"Expected.dtype must be 'integer', 'floating' or 'any', got {self.dtype!r}")
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"Expected.count must be an integer ≥ 1, got {self.count!r}")
        if self.numel is not None and (not isinstance(self.numel, int) or self.numel < 0):
            raise ValueError(f"Expected.numel must be an integer ≥ 0 or None, got {self.numel!r}")


# torch DDP rebuilds its buckets once, in the first forward after the first synchronised backward (micro-step
# 0 of step 1): rank 0 broadcasts the new bucket layout as integer tensors. Seen: 2 broadcasts, gloo and NCCL.
DDP_EXPECTED = (Expected("broadcast", count=2, dtype="integer", step=1, micro=0,
                         why="torch DDP's one-time bucket rebuild (bucket layout broadcast from rank 0)"),)

# Accelerate (and what is built on it: HF Trainer) wraps the model in DDP even in a ONE-rank group, but enters
# no_sync() only when num_processes > 1: alone, DDP all-reduces every micro-step (one per gradient bucket: the
# first ≤ 1 MiB, the rest ≤ 25 MiB), and its bucket rebuild follows micro-step 0's synchronised backward, at
# micro-step 1 of step 0. Real behaviour at world 1 only: these entries excuse nothing at world ≥ 2.
DDP_WORLD1_EXPECTED = (
    Expected("all_reduce", count=8, dtype="floating", world=1,
             why="DDP in a one-rank group without no_sync() (Accelerate at one process): all-reduce per bucket"),
    Expected("broadcast", count=2, dtype="integer", step=0, micro=1, world=1,
             why="torch DDP's bucket rebuild, after micro-step 0's synchronised backward (one-rank group)"),
)
