"""What the gates can judge of a gradient read at the step (Adapter(grads_from="optimizer"), verify/_internal/atstep.py):
after clipping, and absent where a GradScaler skipped the step. Design: docs/design/protocol.md ("Where the gradient
is read").

    unclipped_options  the options a gate that needs the pre-clip gradient runs (the declared unclipped=)
    preclip            whether a run's gradient read at the step is provably the pre-clip one (the normaliser gate)
    unclipped_run      ... or shown to be by a larger run of the same options
    stepped_norm       the norm stepped, and the pre-clip norm where clipping provably did not act (the metrics gate)
    step0_read         Judge.step0's first look: a big batch without a step-0 gradient bounds nothing (unstepped)
"""
from __future__ import annotations

import math

import torch

from verify._internal.metrics import max_norm_of

__all__ = ["CLIP_EPS", "UNJUDGED", "unclipped_options", "clipping_off", "preclip", "unclipped_run", "stepped_norm",
           "unstepped", "step0_read"]

CLIP_EPS = 1e-6  # clip_grad_norm_'s: coefficient = max_norm / (norm + 1e-6) (Metrics.clip_eps where declared)

UNJUDGED = ("grads_from='optimizer' reads each gradient after clipping, and a clipped gradient does not add up over "
            "windows: the normaliser's {what} judged the loss only; declare unclipped= (options -> the options "
            "without clipping) so the gradients are judged too")


def unclipped_options(adapter, options):
    """The options a gate that needs the pre-clip gradient runs with: unclipped(options) where the adapter reads
    its gradient at the step (grads_from="optimizer") and declares unclipped=, else `options` as they are."""
    if getattr(adapter, "grads_from", "grads") == "optimizer" and getattr(adapter, "unclipped", None) is not None:
        return adapter.unclipped(options)
    return options


def clipping_off(metrics, options) -> bool:
    """Whether the declaration says these options clip nothing: Metrics(max_norm=options -> None). A max_norm left
    undeclared (None) says nothing: the trainer may clip."""
    return metrics is not None and callable(metrics.max_norm) and metrics.max_norm(options) is None


def preclip(adapter, options):
    """None where every gradient the harness reads of `adapter` under `options` is the pre-clip one: grads()
    (the protocol's), or at the step with clipping declared off (unclipped(options) is options, clipping_off).
    Otherwise a function trace -> bool: whether that run's step-0 gradient is provably unclipped, which needs the
    declared threshold M (Metrics.max_norm): clipping at M scales ‖g‖ to M·‖g‖ / (‖g‖ + clip_eps) > M − clip_eps,
    and leaves a gradient of norm ≤ M − clip_eps as it is. Without M nothing tells (False)."""
    if getattr(adapter, "grads_from", "grads") != "optimizer":
        return None
    off, m = getattr(adapter, "unclipped", None), getattr(adapter, "metrics", None)
    if off is not None and off(options) == options or clipping_off(m, options):
        return None
    cap = max_norm_of(m, options)
    if cap is None:
        return lambda trace: False
    return lambda trace: _norm(trace.grads0.values()) <= cap - m.clip_eps


def unclipped_run(norm: float, top: float, clip_eps: float, rel: float) -> bool:
    """Whether a run whose stepped gradient has norm `norm` was provably not clipped, given another run of the same
    options that stepped `top`: clipping at any M leaves every run's norm < M and a clipped one's > M − clip_eps
    (M·‖g‖ / (‖g‖ + clip_eps)), so a norm below top − clip_eps (less `rel` of top: the runs' float64 rounding and a
    norm taken in float32) was never clipped. Assumes norm clipping with an eps ≤ clip_eps, as torch, DeepSpeed and
    Megatron clip; the largest run itself is never proven so."""
    return norm <= top * (1.0 - rel) - clip_eps


def stepped_norm(step: dict, metrics, options, whole: bool) -> tuple[float | None, float | None]:
    """(the norm the optimizer stepped, the pre-clip norm or None) of one metrics step under grads_from="optimizer"
    (Observer: no grads() read, `applied` its Σ g² as stepped). `whole`: the stepped elements are the whole
    gradient (one process, or replicated data parallelism), else (None, None). The pre-clip norm is the stepped one
    where clipping provably did not act: declared off, or stepped ≤ max_norm − clip_eps (as `preclip` says)."""
    applied, cap = step.get("applied"), max_norm_of(metrics, options)
    if step.get("sumsq") is not None or applied is None or not whole:
        return None, None
    s = math.sqrt(applied[0])
    return s, (s if clipping_off(metrics, options) or cap is not None and s <= cap - metrics.clip_eps else None)


def unstepped(big, ref, precision: str) -> set:
    """The parameters whose big-batch step-0 gradient bounds nothing: not read (grads_from="optimizer" and no
    optimizer step began: an fp16 GradScaler that found inf/NaN skips it) or, under fp16, not finite (grads(): the
    same overflow). The step-0 check of such a parameter is not judged (tolerance.step0_checks)."""
    fp16 = precision == "fp16"
    return {k for k in ref.grads0 if k not in big.grads0 or fp16 and not bool(torch.isfinite(big.grads0[k]).all())}


def step0_read(judge, acc, big, ref) -> None:
    """Judge.step0's first look: the accumulation run has a step-0 gradient of every parameter the float64
    reference has (Judge.keys), except where the big batch has none to bound it by (unstepped), which
    `judge.unjudged` then says. An accumulation run with no step-0 gradient at all fails, named."""
    skip = unstepped(big, ref, judge.case.precision)
    if skip:
        judge.unjudged = (f"the big batch's step-0 gradient of {len(skip)} of {len(ref.grads0)} parameters is not "
                          f"finite or was never stepped (its GradScaler skipped the step): nothing bounds the "
                          f"accumulation run's error there, so those step-0 gradient checks were not judged")
    want = {k: g for k, g in ref.grads0.items() if k not in skip}
    if want and not acc.grads0:
        judge.fail("the accumulation run has no step-0 gradient at all, where the big batch has one: grads() "
                   "returned none, or (grads_from='optimizer') no optimizer's step() began inside optimizer_step() — "
                   "under fp16 its GradScaler found an inf/NaN gradient: a scale too high for one micro-batch, or "
                   "the scale applied wrong")
    judge.keys(acc.grads0, want, "the accumulation run")


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))
