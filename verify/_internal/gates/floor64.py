"""The float64 half of the tolerance policy: its bound and floor, the twins that measure the reference's own
rounding, and the Judge's float64 checks (every step's loss, every parameter after every step).

* bound64(floor, κ) = C · min(max(eps32, twin), FLOOR) · max(1, κ); FLOOR = 8·eps32 caps the floor.
* a loss is a sum whose blocks may cancel: judged with its κ at that step where it fails at κ = 1 (gates/kappa.py).
* a parameter's elements whose step-0 gradient is zero at the run's resolution and differs between the runs are
  moved by the optimizer's response to noise: the parameter check judges the others (`judged`).
Re-exported by tolerance.py; derivations: docs/design/tolerance.md ("The float64 floor", "Later losses", "Noise").
"""
from __future__ import annotations

import math

import torch

from verify._internal.cases.case import TWIN_COPIES
from verify._internal.verdict import GateFailure

__all__ = ["EPS32", "C", "FLOOR", "rel_err", "whole_norm", "overall_error", "twin_diff", "twin_floor", "measured_floor",
           "bound64", "judged", "Float64Checks", "TwinMeter", "summation_floor", "start_print", "same_start"]

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
C = 8.0
FLOOR = 8 * EPS32
# FLOOR caps the float64 floor: C·FLOOR = 64·eps32 ≈ 7.6e-6 < 1e-5, so a real accumulation error of 1e-5
# relative fails however noisy the reference is (the one place a correct float32 part can still fail: tolerance.md).


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (absolute when ref is all zero, e.g. unused embedding rows)."""
    x, ref = x.detach().double(), ref.detach().double()
    if x.shape != ref.shape:
        return float("inf")
    d, n = (x - ref).norm().item(), ref.norm().item()
    return d / n if n > 0 else d


def whole_norm(grads: dict) -> float:
    """‖g‖ over every parameter at once (float64): the scale of the whole gradient."""
    return math.sqrt(sum(g.detach().double().pow(2).sum().item() for g in grads.values()))


def overall_error(got: dict, ref: dict) -> float:
    """Relative error over every parameter at once (the names both have): rel_err of the two flattened, summed a
    parameter at a time (no flat float64 copy: three of them would be 24 bytes per parameter at the peak)."""
    names = [k for k in ref if k in got]
    if not names:
        return 0.0
    if any(got[k].shape != ref[k].shape for k in names):
        return float("inf")
    d = n = 0.0
    for k in names:
        r = ref[k].detach().double()
        d += (got[k].detach().double() - r).pow(2).sum().item()
        n += r.pow(2).sum().item()
    return math.sqrt(d) / math.sqrt(n) if n > 0 else math.sqrt(d)


def start_print(params: dict) -> dict:
    """name -> (Σp, Σ|p|, the first HEAD elements, dtype) of a trainer's parameters before its first step, in
    float64, summed where they live (no host copy of a billion weights): what same_start compares."""
    out = {}
    with torch.no_grad():
        for k, p in params.items():
            p = p.full_tensor() if callable(getattr(p, "full_tensor", None)) else p
            if isinstance(p, torch.Tensor) and p.is_floating_point():
                out[k] = (float(p.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(p, 1, dtype=torch.float64)),
                          p.detach().reshape(-1)[:HEAD].to("cpu", torch.float64, copy=True), p.dtype)
    return out


HEAD = 64  # elements compared one by one: a redraw moves each by ~σ, where a coarse run's sums would admit it


def same_start(low: dict, ref: dict, what: str, autocast=None) -> str | None:
    """Why the float64 run `ref` does not start from the weights of the lower-precision run `low` (start_print of
    each), or None. Rounding a float64 weight to the low run's resolution (its parameter's dtype, or `autocast`'s
    where a framework casts the model: DeepSpeed's bf16 engine keeps fp32 masters of bf16-rounded weights) moves it
    by at most eps/2 of itself: each of the first HEAD elements agrees within eps·|p|, and both sums within
    eps·Σ|p| (the sums' own float64 rounding is far below). A redraw moves each element by ~σ: caught."""
    for k, (s, a, head, dtype) in low.items():
        if k not in ref:
            continue
        s64, a64, head64, _ = ref[k]
        eps = max(torch.finfo(dtype).eps, torch.finfo(autocast).eps if autocast is not None else 0.0)
        d, bound = max(abs(s64 - s), abs(a64 - a)), eps * a64
        alike = head.shape == head64.shape
        far = (head64 - head).abs() > eps * head64.abs() if alike else None
        if not d <= bound or not alike or bool(far.any()):  # NaN included
            i = int(far.nonzero()[0]) if alike and bool(far.any()) else None
            where = (f"element {i} is {float(head64[i]):.10g} there and {float(head[i]):.10g} here" if i is not None
                     else f"it sums to {s64:.10g} (Σ|p| {a64:.10g}) there and {s:.10g} (Σ|p| {a:.10g}) here, {d:.3g} "
                          f"apart where rounding moves it by at most {bound:.3g}")
            return (f"the float64 run ({what}) does not start from the {str(dtype).removeprefix('torch.')} run's "
                    f"weights: {k!r}: {where}, so every bound measured against it is another model's. Draw the "
                    f"weights in float32 (or load them) and cast to Spec.dtype: a module built with dtype=float64 "
                    f"draws other numbers from the same seed")
    return None


def twin_floor(measured: float = 0.0) -> float:
    """The floor the float64 checks use: what an fp32 run of the case can resolve (eps32), or the reference's
    own rounding `measured` on a twin (twin_diff) where that is larger, capped at FLOOR (module docstring)."""
    return min(max(measured, EPS32), FLOOR)


def summation_floor(n: int) -> float:
    """2·γ_{n−1} (u = eps32 / 2, γ_k = k·u / (1 − k·u)): the most two fp32 recursive sums of the same n terms, in
    two orders, can differ by relative to Σ|terms| (Higham, Accuracy and Stability, §4.2), so relative to the sum
    where its terms do not cancel."""
    k, u = n - 1, EPS32 / 2
    return 2 * k * u / (1 - k * u)


def bound64(floor: float = EPS32, kappa: float = 1.0) -> float:
    """The float64 relative bound: C × the run's floor (twin_floor: eps32 up to FLOOR), × κ for a tensor that
    is a sum whose terms cancel (as at step 0: rounding of each term is relative to the term, not to the
    sum)."""
    return C * twin_floor(floor) * max(1.0, kappa)


def judged(acc: dict, ref: dict, floor: float = EPS32) -> dict:
    """name -> mask of the elements a float64 parameter check judges, for each parameter where that is not all of
    them: all but those whose step-0 gradient in `ref` is zero at the run's resolution (|g| ≤ bound64(floor)·‖g‖,
    the whole gradient's norm: the line tolerance.param_scale draws for a parameter, drawn for one element), in a
    parameter where such an element is noise (nonzero in either run). Noise moves by the optimizer's response to
    it (Adafactor's first step is sign descent: ±lr·RMS(p) whatever the noise's size), at this step or a later
    one (an exact 0 among noise at step 0 is noise at step 1); its gradient was judged at step 0, against the
    whole. A parameter whose unresolved elements are all exactly 0 in both runs (unused embedding rows, a
    zero-initialised branch) computes zeros, not noise: judged. A parameter not float64 (a model not built in
    Spec.dtype: no float64 reference; gates/evidence.py names it): judged whole."""
    lim, out = bound64(floor) * whole_norm(ref), {}
    for name, g in ref.items():
        a = acc.get(name)
        if a is not None and a.shape == g.shape and g.dtype == torch.float64:
            g, a = g.detach().double(), a.detach().double()
            unresolved = g.abs() <= lim
            if bool((unresolved & ((g != 0) | (a != 0))).any()):
                out[name] = ~unresolved
    return out


class TwinMeter:
    """twin_diff streamed: drive(keep_params=TwinMeter(ref)) hands it the twin's parameters after each step and keeps
    none (a billion float64 parameters are 8 GiB a step), then `diff(twin)` is twin_diff(ref, twin). A parameter's
    mask (judged) needs the twin's resolving gradient, known for sure only once the run ends (an empty first window
    sets it later): each step keeps max|Δ| over every element and over the elements ref alone resolves, and `diff`
    picks per parameter what judged() would have masked."""

    def __init__(self, ref):
        self.ref, self.lim = ref, bound64(EPS32) * whole_norm(ref.resolving)
        self.steps: list[dict] = []

    def __call__(self, k: int, params: dict) -> None:
        out = {}
        for name, p in self.ref.params[k].items() if k < len(self.ref.params) else ():
            if name in params and p.numel():
                g = self.ref.resolving.get(name)
                keep = ~(g.detach().double().abs() <= self.lim) if g is not None and g.shape == p.shape else None
                scale = max(1.0, p.abs().max().item())
                out[name] = (_max_abs(params[name], p) / scale, _max_abs(params[name], p, keep) / scale)
        self.steps.append(out)

    def diff(self, twin) -> float:
        out = _scalar_diff(self.ref, twin)
        masks = judged(twin.resolving, self.ref.resolving)
        for step in self.steps:
            for name, (whole, masked) in step.items():
                out = max(out, masked if name in masks else whole)
        return out if math.isfinite(out) else FLOOR


def _scalar_diff(ref, twin) -> float:
    """twin_diff's losses and step-0 gradient (the part that needs no parameters)."""
    out = 0.0
    for a, b in zip(twin.losses, ref.losses):
        if not (math.isnan(a) or math.isnan(b)):
            out = max(out, abs(a - b) / (abs(b) or 1.0))
    if ref.grads0:
        out = max(out, overall_error(twin.grads0, ref.grads0))
    return out


def twin_diff(ref, twin) -> float:
    """The float64 reference's own rounding, from two mathematically equal runs of it (Traces; `twin` saw the
    same rows in another order): the largest relative difference over the losses of every step, the step-0
    gradient over all parameters at once and every parameter after every step (max|Δ| / max(1, max|p|), as
    the parameter check scales, over the elements it judges at eps32). Not finite: FLOOR (the cap)."""
    out = _scalar_diff(ref, twin)
    masks = judged(twin.resolving, ref.resolving)
    for pa, pb in zip(twin.params, ref.params):
        for name, p in pb.items():
            if name in pa and p.numel():
                out = max(out, _max_abs(pa[name], p, masks.get(name)) / max(1.0, p.abs().max().item()))
    return out if math.isfinite(out) else FLOOR


def measured_floor(ref, twin) -> float:
    """twin_floor of a float64 reference Trace and its twin's (the same rows, case.twin)."""
    return twin_floor(twin_diff(ref, twin))


def _twins_text(i: int) -> str:
    return "the reference's own rounding, on its twin" if i == 0 else f"the reference's own rounding, the most of {i + 1} twins"


def _flat(grads: dict, names: list) -> torch.Tensor:
    return torch.cat([grads[k].detach().double().reshape(-1) for k in names])


def _max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """max|a − b| (NaN on a shape mismatch or no element), over `mask`'s elements where given (0 where it has none)."""
    if a.shape != b.shape or not a.numel():
        return float("nan")
    d = (a.double() - b.double()).abs()
    if mask is not None and mask.shape == d.shape:
        d = d[mask]
        return d.max().item() if d.numel() else 0.0
    return d.max().item()


class Float64Checks:
    """The Judge's float64 checks (tolerance.Judge inherits them; it supplies fail and _undefined)."""

    def float64(self, acc64, ref64, measure=None, loss_kappa=None) -> float:
        """Every step's loss and parameters of the float64 accumulation run vs the float64 big batch, within
        bound64(floor). The floor is eps32 (what an fp32 run resolves) unless the reference's twins say it
        rounds more: `measure(i)` is measured_floor on twin i (case.twin, TWIN_COPIES[i]), called only where a
        check fails at eps32 but not at FLOOR, the largest floor (a correct run, and a real bug, need no twin),
        and twin i + 1 only where the check still fails at the largest floor twins 0..i measured (one twin is
        one draw of the reference's rounding: docs/design/tolerance.md). `loss_kappa(k)`: step k's loss's κ
        (gates/kappa.py, cached where it is made), measured only for a loss that fails at κ = 1 while every
        parameter passes. Returns the floor judged with."""
        floor = twin_floor()
        try:
            self._float64(acc64, ref64, floor, kappa=loss_kappa)
            return floor
        except GateFailure:
            if measure is None:
                raise
            # beyond what any floor allows (a real bug): certain without a twin
            self._float64(acc64, ref64, FLOOR, "the largest floor any reference gets", loss_kappa)
        for i in range(len(TWIN_COPIES)):
            floor = max(floor, measure(i))
            try:
                self._float64(acc64, ref64, floor, _twins_text(i), loss_kappa)
                return floor
            except GateFailure as e:
                failure = e
        raise failure

    def _float64(self, acc64, ref64, floor: float, what: str = "", kappa=None) -> None:
        rel = bound64(floor)
        masks = judged(acc64.resolving, ref64.resolving, floor)
        floor = twin_floor(floor)
        what = what or "what an fp32 run resolves"  # the first judgement, at eps32
        why = f" = {C:g}·{floor:.2e} ({what})"
        for k, (la, lr) in enumerate(zip(acc64.losses, ref64.losses)):
            if self._undefined(la, lr, f"float64 loss at step {k}", k) or abs(la - lr) <= rel * abs(lr):
                continue
            # a loss whose blocks cancel (a policy gradient's advantages of both signs) is resolved no better than
            # its largest block: its κ, measured only where it can change the verdict (the parameters pass)
            K = kappa(k) if kappa is not None and self._passes(acc64, ref64, rel, why, masks) else 1.0
            if not abs(la - lr) <= rel * max(1.0, K) * abs(lr):
                e, b = abs(la - lr) / (abs(lr) or 1.0), rel * max(1.0, K)
                self.fail(f"float64 loss at step {k}: {la!r} vs the big batch's {lr!r} (rel {e:.3e} > {b:.2e}{why}"
                          f"{f' × κ {K:.3g}' if K > 1.0 else ''})", k, error=e, bound=b)
        self._params64(acc64, ref64, rel, why, masks)

    def _passes(self, acc64, ref64, rel, why, masks) -> bool:
        try:
            self._params64(acc64, ref64, rel, why, masks)
            return True
        except GateFailure:
            return False

    def _params64(self, acc64, ref64, rel: float, why: str, masks: dict) -> None:
        for k, (pa, pr) in enumerate(zip(acc64.params, ref64.params)):
            for name, p in pr.items():
                if name not in pa:
                    self.fail(f"float64 run has no parameter {name!r} after step {k}", k)
                scale = max(1.0, p.abs().max().item() if p.numel() else 0.0)
                tol, mask = rel * scale, masks.get(name)
                d = _max_abs(pa[name], p, mask)
                if not d <= tol:
                    left = f" ({int((~mask).sum())} of its elements, zero at the run's resolution, not judged)" if (
                        mask is not None) else ""
                    self.fail(f"float64 parameter {name!r} after step {k}: max|Δ| = {d:.3e} > {tol:.2e}{why} vs the "
                              f"float64 big batch{left}", k, error=d / scale, bound=tol / scale)
