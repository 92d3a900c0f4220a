"""The mesh operators' mechanics: what verify.selftest.operators plants in a trainer on a dp × pp × tp mesh,
through what the harness itself may touch (the four methods, the Spec and its mesh, torch.distributed).

    pipeline_micro_batch_dropped  micro-batch 1 fed in place of micro-batch 0 (N micro-steps kept)
    dp_reduction_skipped          torch.distributed's python reductions on the dp group do nothing
    reduced_over_wrong_group      the same interposition reduces over the tp group (without tp: the world)

The interposition replaces REDUCTIONS on torch.distributed for each call into the trainer; a reduction made
in C++ or through a name bound before the call is out of its reach (the operator survives, the table says so).
Design: docs/design/self-test.md.
"""
from __future__ import annotations

import contextlib
import inspect

import torch

__all__ = ["REDUCTIONS", "interposed", "feed_micro_1_for_0"]

# torch.distributed's reductions, the dp gradient sync of a python trainer (not all_gather: that moves shards)
REDUCTIONS = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
              "reduce_scatter_single", "_reduce_scatter_base")


def feed_micro_1_for_0(w, x, y, m):
    """pipeline_micro_batch_dropped: micro-step 0 is held back; micro-batch 1 runs as micro-steps 0 and 1."""
    if m == 0:
        return
    if m == 1:
        w.inner.micro_step(x.clone(), y.clone(), 0)
    w.inner.micro_step(x, y, m)


class _Done:
    """The Work of a skipped asynchronous reduction: already complete."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        f = torch.futures.Future()
        f.set_result(None)
        return f


def _groups(w):
    """(the dp group, its stand-in for reduced_over_wrong_group: the tp group, else the whole world)."""
    if getattr(w, "_groups", None) is None:
        import torch.distributed as dist

        from verify._internal.ranks.mesh import device_mesh

        dm, m = device_mesh(w.spec), w.spec.mesh
        w._groups = (dm["dp"].get_group(), dm["tp"].get_group() if m.tp > 1 else dist.group.WORLD)
    return w._groups


def _local(name, bound) -> None:
    """A skipped reduction leaves each rank its own value: a reduce-scatter's output gets the rank's own chunk."""
    import torch.distributed as dist

    a = bound.arguments
    if name == "reduce_scatter":
        a["output"].copy_(a["input_list"][dist.get_rank(a.get("group"))])
    elif name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
        out, inp = a["output"], a["input"]  # input: the group's chunks, stacked along dim 0
        r, n = dist.get_rank(a.get("group")), dist.get_world_size(a.get("group"))
        out.copy_(inp.reshape(n, -1)[r].view_as(out))


@contextlib.contextmanager
def interposed(w, swap: bool):
    """While the trainer runs: torch.distributed's reductions on the dp group skipped (swap=False) or run on the
    other group (swap=True). Nothing on a mesh without dp replicas (the references: Mesh(), one process)."""
    m = getattr(w.spec, "mesh", None)
    if m is None or m.dp < 2:
        yield
        return
    import torch.distributed as dist

    dp, other = _groups(w)
    saved = {n: getattr(dist, n) for n in REDUCTIONS if hasattr(dist, n)}

    def wrap(name, orig):
        sig = inspect.signature(orig)

        def reduction(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            g = bound.arguments.get("group")
            if (g if g is not None else dist.group.WORLD) != dp:
                return orig(*args, **kwargs)
            if swap:
                bound.arguments["group"] = other
                return orig(*bound.args, **bound.kwargs)
            _local(name, bound)
            return _Done() if bound.arguments.get("async_op") else None
        return reduction

    try:
        for n, f in saved.items():
            setattr(dist, n, wrap(n, f))
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
