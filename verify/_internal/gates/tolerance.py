"""The one tolerance policy. Every gate, single-process or distributed, judges numbers here.

* fp32, step 0: err(accumulation) ≤ C · max(err(big), err(big, all parameters)) + F · max(1, κ)
  + F_p · max(0, κ/√n − 1), C = 8, F = 8·eps32, F_p = 8·eps_p (bf16 / fp16 only); every step's loss
  within LOSS_MAX_REL of the fp32 big batch.
* float64, all K steps: `bound64(twin_floor(measured), κ)`, floor = min(max(eps32, twin), 8·eps32): gates/floor64.py.
* bit-exact: torch.equal. A NaN loss (a window without a valid token) agrees only with another NaN.
* one parameter's gradient: relative to its own norm, or the whole gradient's where its own is zero (param_scale).
Why these bounds (κ, the all-parameter floor, zero gradients, the twin, every margin): docs/design/tolerance.md.
"""
from __future__ import annotations

import math

import torch

from verify._internal.gates.clipped import step0_read, unstepped
from verify._internal.gates.floor64 import (C, EPS32, FLOOR, Float64Checks, _max_abs, bound64, measured_floor,
                                            overall_error, rel_err, twin_diff, twin_floor, whole_norm)
from verify._internal.verdict import Gate, GateFailure

__all__ = ["GateFailure", "C", "FLOOR", "EPS32", "EPS", "LOSS", "LOSS_MAX_REL", "KAPPA_EXACT_ABOVE", "rel_err", "condition",
           "conditions", "whole_norm", "resolved", "param_scale", "scale_note", "param_err",
           "bound", "needs_kappa", "overall_error", "step0_checks", "twin_diff", "twin_floor", "measured_floor",
           "bound64", "Judge", "STEP0_TEXT", "FLOAT64_TEXT", "NATIVE_TEXT"]

# each precision's own epsilon: the rounding of one accumulated term under that autocast (bound's F_p)
EPS = {"fp32": EPS32, "bf16": torch.finfo(torch.bfloat16).eps, "fp16": torch.finfo(torch.float16).eps}
LOSS = "(loss)"  # the loss's key in a κ dict (conditions), beside the parameters' names
LOSS_MAX_REL = 1e-3  # fp32 losses after AdamW steps: measured ≤ 2.4e-7 on correct trainers
# κ (one float64 run per micro-block) is computed only for a check whose error reaches this share of its κ = 1
# bound: below it κ ≥ 1 could only lower the reported error / bound, never change a verdict. The partial-sum
# gate measures its twin floor on the same terms (reported ratios stay < this share, or are exact).
KAPPA_EXACT_ABOVE = 0.5

# The bounds in words, built from the constants above (the report prints them; the docs quote them and a test
# checks the quote): what `bound` and `bound64` compute, κ and the all-parameter term included.
_F = f"{FLOOR / EPS32:g}·eps32"
STEP0_TEXT = (f"err(acc) ≤ {C:g}·max(err(big), err(big, all parameters)) + {_F}·max(1, κ) "
              f"+ {C:g}·eps_p·max(0, κ/√n − 1)")
FLOAT64_TEXT = f"{C:g}·min(max(eps32, twin), {_F})·max(1, κ)"
# a native reference's (gates/native.py: Numerics(native=...), no float64 run)
NATIVE_TEXT = (f"no float64 run: step 0 vs Σ w_m·(the trainer at N=1 on micro-batch m), ≤ {C:g}·max(noise, 2γ_(N−1)) "
               f"+ {_F}·max(1, κ); every loss and the step-0 gradient vs the big batch, ≤ {C:g}·max(noise, "
               f"eps_native·max(1, κ/√N)) + the same floor, a loss ≥ {LOSS_MAX_REL:g}; noise: the trainer's own twins "
               f"in its precision")


def _norm(ref) -> float:
    return ref.detach().double().norm().item() if isinstance(ref, torch.Tensor) else abs(float(ref))


def resolved(ref, whole: float, floor: float = EPS32, resolution: float | None = None) -> bool:
    """Whether a parameter's gradient `ref` (a tensor or its norm) is above the whole gradient's resolution:
    bound64(floor) × `whole`, the most the whole gradient's own float64 comparison may differ by (`resolution`: that
    multiple given, for a comparison that is not float64's: gates/native.py)."""
    return _norm(ref) > (bound64(floor) if resolution is None else resolution) * whole


def param_scale(ref, whole: float, floor: float = EPS32, resolution: float | None = None) -> float:
    """What one parameter's gradient error is relative to: its own norm where `resolved`, else the whole gradient's:
    a gradient zero in exact arithmetic (a key bias: softmax ignores a shift of all a query's scores) is rounding of
    terms no count of the harness gives, noise over noise relative to itself (docs/design/tolerance.md, "Zero
    gradients"). Every check that judges one parameter's gradient alone divides by it (param_err, condition)."""
    return _norm(ref) if resolved(ref, whole, floor, resolution) else whole


def scale_note(ref, whole: float, floor: float = EPS32, resolution: float | None = None) -> str:
    """What a message adds where param_scale judges a parameter against the whole gradient."""
    return "" if resolved(ref, whole, floor, resolution) else " (zero at the run's resolution: relative to the whole gradient)"


def param_err(x: torch.Tensor, ref: torch.Tensor, whole: float, floor: float = EPS32,
              resolution: float | None = None) -> float:
    """‖x − ref‖ / param_scale(ref, whole, floor), float64 (∞ on a shape mismatch; absolute where the scale is 0)."""
    x, ref = x.detach().double(), ref.detach().double()
    if x.shape != ref.shape:
        return float("inf")
    d, n = (x - ref).norm().item(), param_scale(ref, whole, floor, resolution)
    return d / n if n > 0 else d


def bound(big: float, kappa: float = 1.0, overall: float = 0.0, precision: str = "fp32", blocks: int = 1) -> float:
    """The step-0 bound on an accumulation run's relative error:
    C · max(big, overall) + F·max(1, κ) + F_p · max(0, κ/√blocks − 1), F_p = 8·eps of `precision` beyond fp32
    (module docstring; `blocks`: the N·W blocks of rows the window sums)."""
    low = C * EPS[precision] * max(0.0, kappa / math.sqrt(blocks) - 1.0) if precision != "fp32" else 0.0
    return C * max(big, overall) + FLOOR * max(1.0, kappa) + low


def needs_kappa(acc: float, big: float, overall: float = 0.0) -> bool:
    """Lazy κ: a step-0 check uses its κ only once its error reaches KAPPA_EXACT_ABOVE of its κ = 1 bound
    (below it, κ = 1: the gates' reported error / bound, an overstatement at most; κ = 1 is the same bound in
    every precision)."""
    return acc >= KAPPA_EXACT_ABOVE * bound(big, 1.0, overall)


def condition(blocks: list[dict], ref: dict, whole: float | None = None) -> dict:
    """κ per parameter: max over block gradients of ‖block‖ / param_scale (float64; 1 where that is 0). `whole`: the
    whole gradient's norm (default: over `ref`)."""
    out, whole = {}, whole_norm(ref) if whole is None else whole
    for name, g in ref.items():
        n = param_scale(g, whole)
        top = max((b[name].detach().double().norm().item() for b in blocks if name in b), default=0.0)
        out[name] = top / n if n > 0 else 1.0
    return out


def conditions(runs: list, ref) -> dict:
    """κ of every step-0 sum, from float64 block runs (Traces) against the float64 reference Trace: per parameter
    (condition), and the loss's under LOSS: max over blocks of |L_block| / |L| (a loss whose blocks cancel, as
    policy-gradient losses over advantages of both signs do, is resolved no better than its largest block)."""
    out = condition([t.grads0 for t in runs], ref.grads0)
    lr = ref.losses[0]
    top = max((abs(t.losses[0]) for t in runs if t.losses and math.isfinite(t.losses[0])), default=0.0)
    out[LOSS] = top / abs(lr) if math.isfinite(lr) and lr != 0 else 1.0
    return out


def step0_checks(acc, big, ref, kappa: dict | None, precision: str, overall: float | None = None):
    """Every step-0 check of the policy: (what, parameter name or None for the loss, err(acc), err(big), κ,
    overall floor); bound(err(big), κ, overall) is its limit. acc and big ran in `precision`, ref in float64.
    `overall`: err(big) over all parameters where the caller has it (a pass over every parameter)."""
    lr = ref.losses[0]
    scale = abs(lr) or 1.0
    skip = unstepped(big, ref, precision)  # the big batch's overflowed step 0 (its GradScaler skipped it) bounds nothing
    if overall is None:
        overall = overall_error(big.grads0, ref.grads0) if not skip else math.inf
    whole = whole_norm(ref.grads0)
    # One scalar is the luckiest tensor of all: under autocast the big batch's loss can come out of a different
    # kernel path near-exact (seen: fp16 N=7, 1.9e-7 against 2.7e-6 typical), so its floor is the big batch's
    # error over all gradients, as for any one parameter. fp32 keeps FLOOR alone.
    yield ("loss of step 0", None, abs(acc.losses[0] - lr) / scale, abs(big.losses[0] - lr) / scale,
           (kappa or {}).get(LOSS, 1.0), overall if precision != "fp32" else 0.0)
    for name, g in ((k, g) for k, g in ref.grads0.items() if k not in skip):
        yield (f"gradient (step 0) of {name!r}{scale_note(g, whole)}", name, param_err(acc.grads0[name], g, whole),
               param_err(big.grads0[name], g, whole), (kappa or {}).get(name, 1.0), overall)


def _factors(case) -> list[tuple[str, float]]:
    """The counts of a case a wrong normaliser multiplies by, named as a failure says them."""
    N, W = case.accum_steps, case.world
    tp = getattr(case.mesh, "tp", 1) if case.mesh is not None else 1
    cp = getattr(case.mesh, "cp", 1) if case.mesh is not None else 1
    out = [("N (micro-steps)", N), ("W (ranks)", W), ("√W (a replicated norm counted per rank)", math.sqrt(W)),
           ("N·W", N * W if min(N, W) > 1 else 1), ("√N", math.sqrt(N)), ("tp", tp),  # N·W only where it is neither
           ("√tp (replicated tp parameters counted tp times)", math.sqrt(tp)), ("cp (context-parallel ranks)", cp)]
    inv = [(f"1/{name.split(' ')[0]}{name[len(name.split(' ')[0]):]}", 1.0 / f) for name, f in out]
    return [(n, f) for n, f in out + inv if f != 1.0]


def factor_text(got: float, want: float, case, extra=(), factors=(), within: float = 1e-6) -> str:
    """' (×2 = W (ranks))' where got / want is one of the case's counts (or of `factors`: (name, factor) the run
    knows, such as its loss scale; or of `extra`: (name, value) of another quantity `got` may be), else
    ' (×1.37)'. `within`: the relative rounding a match may differ by (a low-precision run's bound)."""
    if not (math.isfinite(got) and math.isfinite(want)) or want == 0:
        return ""
    for name, value in extra:
        if value is not None and math.isfinite(value) and abs(got - value) <= within * max(abs(value), 1e-30):
            return f" (= {name})"
    if got == 0:
        return " (zero)"
    r = got / want
    for name, f in factors:  # what the run knows (its loss scale) first
        if abs(r / f - 1.0) <= within:
            return f" (×{r:.4g} = {name})"
    names = [name for name, f in _factors(case) if abs(r / f - 1.0) <= within]
    names = [n for n in names if "√" not in n] or names  # every count it is (N = cp = 2: either), a root only alone
    return f" (×{r:.4g} = {' or '.join(names)})" if names else f" (×{r:.4g})"


def _named_factor(got: float, want: float, case) -> str:
    """' (×0.5 = 1/W (ranks))' where got / want is one of the case's counts, else ''."""
    text = factor_text(got, want, case)
    return text if " = " in text else ""


class Judge(Float64Checks):
    """Applies the policy for one gate and one case; raises GateFailure('[gate] ...; case ...').
    `suffix(step)` may add context to a message (the distributed gate appends the boundary's collectives)."""

    def __init__(self, gate: Gate, case, where: str = "", suffix=None):
        self.gate, self.case, self.where = gate, case, where
        self.suffix = suffix or (lambda step: "")
        self.worst, self.worst_ratio, self.note = "", 0.0, ""

    def fail(self, msg: str, step: int = 0, *, error: float | None = None, bound: float | None = None,
             hint: str | None = None):
        """error / bound: a relative error and its limit (the hints read them: verify/_internal/hints.py)."""
        raise GateFailure(f"[{self.gate}] {self.where}{msg}{self.suffix(step)}; case {self.case}", gate=self.gate,
                          case=self.case, error=error, bound=bound, hint=hint)

    def _within(self, acc: float, big: float, what: str, kappa: float = 1.0, overall: float = 0.0) -> None:
        precision = getattr(self.case, "precision", "fp32")
        blocks = getattr(self.case, "micro_blocks", None) or self.case.accum_steps * self.case.world  # Σ_r N_r
        scale, b = max(big, overall), bound(big, kappa, overall, precision, blocks)
        floor = b - C * scale  # F·max(1, κ) + F_p·max(0, κ/√blocks − 1)
        if not acc <= b:  # also catches NaN
            k = f" (κ {kappa:.3g}, {precision})" if kappa > 1.0 else ""
            which = "big-batch error" if big >= overall else "big-batch error over all parameters"
            self.fail(f"{what}: accumulation error {acc:.3e} > {C:g}·{scale:.3e} ({which}) + {floor:.1e}{k}"
                      f"{self.note}", error=acc, bound=b)
        if acc / b >= self.worst_ratio:
            self.worst, self.worst_ratio = what, acc / b

    def keys(self, got: dict, want: dict, who: str) -> None:
        missing = sorted(set(want) - set(got))
        if missing:
            self.fail(f"{who} has no boundary gradient for {missing[:3]}{' …' if len(missing) > 3 else ''}")

    def _undefined(self, la: float, lr: float, what: str, step: int = 0) -> bool:
        """True when the reference loss is undefined (NaN: no valid token) and so is the candidate's."""
        if math.isnan(lr) or math.isnan(la):
            if not (math.isnan(lr) and math.isnan(la)):
                self.fail(f"{what}: {la!r} vs the big batch's {lr!r} (one of them undefined)", step)
            return True
        return False

    def step0(self, acc, big, ref, kappa=None, *, doomed: GateFailure | None = None) -> None:
        """Step-0 loss and boundary gradients of `acc` vs the float64 `ref`, bounded by `big`'s error
        (acc and big in the same precision: fp32, or bf16 / fp16 autocast). kappa: name -> κ, or a function
        returning that dict, called once and only when a gradient's error reaches KAPPA_EXACT_ABOVE of its
        κ = 1 bound (lazy κ: it costs one float64 run per micro-block). `doomed`: the float64 checks' own
        failure, seen first: the case fails whatever κ is, so κ is not computed (the failing path is what
        hypothesis shrinks) and a step-0 check that fails at κ = 1 is reported, saying so."""
        step0_read(self, acc, big, ref)  # grads_from="optimizer": a step 0 its GradScaler skipped has no gradient
        fp16 = self.case.precision == "fp16"
        lazy = kappa if callable(kappa) and doomed is None else None
        known = kappa if isinstance(kappa, dict) else None
        self.note = " (κ not computed: the float64 run fails too)" if doomed is not None and callable(kappa) else ""
        skip = unstepped(big, ref, self.case.precision)
        overall = math.inf if skip else overall_error(big.grads0, ref.grads0)
        if doomed is None and not skip:
            known = self.sees(overall, known, lazy)
        for what, name, a, b, k, o in step0_checks(acc, big, ref, known, self.case.precision, overall):
            if lazy is not None and needs_kappa(a, b, o):
                known = known if known is not None else lazy()
                k = known.get(LOSS if name is None else name, 1.0)
            if name is None:  # the loss, named with the count it is off by where it is one (×1/W = ranks)
                if not self._undefined(acc.losses[0], ref.losses[0], what):
                    self._within(a, b, what + _named_factor(acc.losses[0], ref.losses[0], self.case), k, o)
                continue
            if fp16 and not bool(torch.isfinite(acc.grads0[name]).all()) and bool(torch.isfinite(big.grads0[name]).all()):
                self.fail(f"gradient (step 0) of {name!r} is inf/NaN in fp16 where the big batch's is finite: the scaled "
                          f"gradient overflowed. A GradScaler starting at torch's 2^16 can overflow one micro-batch (a "
                          f"rank's gradient is W× a big-batch row's before /W) before it backs off; if that is all, give "
                          f"the adapter's scaler a lower init_scale under the gates — otherwise the scale is applied wrong")
            self._within(a, b, what, k, o)

    def sees(self, overall: float, known: dict | None, lazy) -> dict | None:
        """Every step-0 bound is C·err(big): where the big batch differs from its float64 reference by 1/C or more
        over all parameters, the bound admits any gradient, a zero one too. In fp32, rounding explains that only
        with cancellation (κ); otherwise the float64 runs do not compute what the fp32 runs do, and the case is
        refused. Under bf16 / fp16 autocast an honest big batch can come near (the zoo's largest: 0.052 in bf16):
        the step-0 check is then said to judge nothing, and the float64 checks judge alone. Returns κ where it
        computed it (docs/design/tolerance.md, "The reference computes what the runs compute"). `overall`: err(big)
        over all parameters, of a big batch that stepped."""
        if not C * overall >= 1.0:
            return known
        known = known if known is not None or lazy is None else lazy()
        kappa, precision = max((known or {}).values(), default=1.0), self.case.precision
        if overall <= C * EPS[precision] * max(1.0, kappa):
            return known
        gap = f"the big batch ({precision}) and its float64 reference differ by {overall:.3g} over all parameters' " \
              f"step-0 gradients (κ {kappa:.3g})"
        if precision != "fp32":
            self.unjudged = f"{gap}: the step-0 bound ({C:g} × that) admits any gradient; the float64 checks judged"
            return known
        self.fail(f"{gap}, more than {C:g}·eps32·κ = {C * EPS32 * max(1.0, kappa):.2g} of rounding explains: every "
                  f"bound here is {C:g} × that, so any gradient would pass, a zero one too. The float64 runs do not "
                  f"compute what the fp32 runs do — another engine mode or optimizer path where float64 is refused, "
                  f"another objective, or grads() read after the optimizer changed them", error=overall, bound=1.0 / C,
                  hint="build the float64 reference as the same computation: what your factory does for "
                       "Spec.dtype=float64 that it does not for float32 (verify.Distributed(counts64=...) declares "
                       "a float64 run in another engine mode; its gradient must still be the window's)")
        return known

    def accumulator(self, acc, dtype=torch.float32) -> None:
        """bf16 / fp16 autocast keeps parameters, so `.grad`, in `dtype` (the protocol's precisions): a boundary
        gradient held in the autocast dtype after N ≥ 2 micro-steps (a `.half()` model, bf16 parameters) was
        summed in 11 / 8 significant bits. Its own big batch reduces over rows in those bits too, so its error
        grows with N as fast and no C·err(big) bound separates them (reports/cpu/lowprec-detection.md): the dtype is the
        evidence, named here rather than waited for."""
        if self.case.accum_steps < 2 or self.case.precision == "fp32":
            return
        for name, g in acc.grads0.items():
            if g.is_floating_point() and g.dtype != dtype and g.dtype in (torch.bfloat16, torch.float16):
                bits = {torch.float16: 11, torch.bfloat16: 8}[g.dtype]
                self.fail(f"gradient (step 0) of {name!r} is {g.dtype} at the boundary of {self.case.accum_steps} "
                          f"micro-steps under {self.case.precision} autocast (parameters in {dtype}): the window's sum "
                          f"was accumulated in {bits} significant bits, whose rounding grows with N. Keep the "
                          f"parameters (and .grad) in {dtype} and autocast the forward, or accumulate into a {dtype} "
                          f"buffer")

    def loss_trajectory(self, acc, big) -> None:
        if getattr(self.case, "precision", "fp32") != "fp32":
            return  # autocast: step 0 by the policy; the float64 run carries the trajectory
        for k, (la, lb) in enumerate(zip(acc.losses, big.losses)):
            if self._undefined(la, lb, f"step-{k} loss", k):
                continue
            mr = abs(la - lb) / (abs(lb) or 1.0)
            if not mr < LOSS_MAX_REL:
                self.fail(f"step-{k} loss {la!r} vs the big batch's {lb!r}: rel {mr:.3e} ≥ {LOSS_MAX_REL:g}", k,
                          error=mr, bound=LOSS_MAX_REL)

    def equal(self, a: torch.Tensor, b: torch.Tensor, what: str, step: int = 0) -> None:
        if not (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)):
            self.fail(f"{what}: not bit-identical, max|Δ| = {_max_abs(a, b):.3e}", step)

    def bit_exact(self, got, want, who: str = "accum_steps=1") -> None:
        self.keys(got.grads0, want.grads0, who)
        for name, g in want.grads0.items():
            self.equal(got.grads0[name], g, f"gradient of {name!r} (step 0)")
        for k, (a, b) in enumerate(zip(got.losses, want.losses)):
            if a != b and not (math.isnan(a) and math.isnan(b)):
                self.fail(f"loss at step {k}: {a!r} != {b!r} (Δ {a - b:.3e})", k)
        for k, (pa, pb) in enumerate(zip(got.params, want.params)):
            for name, p in pb.items():
                if name not in pa:
                    self.fail(f"no parameter {name!r} after step {k}", k)
                self.equal(pa[name], p, f"parameter {name!r} after step {k}", k)
