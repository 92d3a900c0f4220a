"""Whether a float64 run computes its update in bf16 or fp16: one float64 step of the failing case, watched by a
TorchFunctionMode, records the first operation of optimizer_step() that turns a float64 or float32 tensor into a
bf16 / fp16 one (torch.optim.Muon's Newton–Schulz: `grad.bfloat16()` whatever the parameters' dtype). Such an update
is out of reach of the float64 reference: a float32-level gradient difference becomes a bf16-level one in the
parameters. A lead of gates/rerun.py; design: docs/design/tolerance.md ("An update computed in bf16").
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from verify._internal.cases.case import Case, drive
from verify._internal.gates.evidence import _alone, _one

__all__ = ["low_precision_update", "update_casts_job"]

F64 = torch.float64
LOW = {torch.bfloat16: ("bfloat16", 8), torch.float16: ("float16", 11)}  # name, significant bits


class _Phase:
    """drive()'s windows: the label of the last mark ("boundary" while optimizer_step() runs)."""

    marks = ()
    now = None

    def mark(self, label) -> None:
        self.now = label[0]


class _Casts(TorchFunctionMode):
    def __init__(self, phase: _Phase):
        super().__init__()
        self.phase, self.seen = phase, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.seen is None and self.phase.now == "boundary" and isinstance(out, torch.Tensor) and out.dtype in LOW:
            src = next((a for a in args if isinstance(a, torch.Tensor) and a.dtype in (F64, torch.float32)), None)
            if src is not None:
                self.seen = (getattr(func, "__name__", str(func)), tuple(src.shape), str(src.dtype), str(out.dtype))
        return out


def update_casts_job(ctx, adapter, case: Case):
    """The float64 run of a one-process `case`: (operation, shape, from dtype, to dtype) of the first cast to
    bf16 / fp16 inside optimizer_step(), or None."""
    if getattr(ctx, "recorder", None) is not None:
        ctx.recorder.discard()  # a pool rank's collectives are not judged here
    phase = _Phase()
    trainer = adapter(case.spec(dtype=F64, device=str(ctx.device), adapter=adapter, group=ctx.group))
    with _Casts(phase) as casts:
        drive(trainer, case.batches(adapter), case.accum_steps, dtype=F64, device=ctx.device, windows=phase)
    return casts.seen


def low_precision_update(adapter, case: Case, pooled: bool) -> str | None:
    """The lead where the float64 run's optimizer_step() casts to bf16 / fp16, on the case's first window in one
    process (its rows, N micro-batches; on a one-rank pool where the gates' runs were pooled); None otherwise."""
    lengths = None if case.lengths is None else tuple(case.lengths[:case.effective_batch])
    seen = _one(adapter, _alone(case, 1, lengths), pooled, update_casts_job)
    if seen is None:
        return None
    op, shape, src, dst = seen
    name, bits = LOW[getattr(torch, dst.removeprefix("torch."))]
    return (f"the float64 run's optimizer_step() rounds a {src.removeprefix('torch.')} tensor of shape {list(shape)} "
            f"to {name} (its `{op}` call): it computes the update in {bits} significant bits, so a float32-level difference "
            f"between the accumulation run's gradient and the big batch's becomes a {name}-level one in the "
            f"parameters, which no float64 reference can judge (torch.optim.Muon runs Newton–Schulz in bfloat16 "
            f"whatever the parameters' dtype). Under the gates compute the update in the parameters' dtype "
            f"(the recipe: docs/design/tolerance.md, \"An update computed in bf16\")")
