"""The native reference (Numerics(native=...)): equivalence for a trainer with no float64 path (FP8, fused kernels),
judged against its own runs in its own precision; no float64 run is made.

split  step 0 vs Σ_m w_m·(the trainer at N = 1 on micro-batch m alone), w_m its share of the rows or valid tokens:
       each part quantizes as micro-step m does, so ≤ C·max(noise, 2γ_{N−1}·max(1, κ)) + FLOOR·max(1, κ);
big    every loss and the step-0 gradient vs the big batch in its precision: ≤ C·max(noise, eps_native·max(1, κ/√N))
       + FLOOR·max(1, κ), a loss at least LOSS_MAX_REL. noise: the split's twin (rows reversed ×3), ≤ 8·eps_native.
Parameters are not judged. Derivation, what it sees and does not: docs/design/tolerance.md, "The native reference".
"""
from __future__ import annotations

import math

import torch

from verify._internal.cases.case import Case, drive, shard, twin
from verify._internal.gates.clipped import UNJUDGED, unclipped_options
from verify._internal.gates.floor64 import summation_floor
from verify._internal.gates.tolerance import (C, EPS32, FLOOR, LOSS_MAX_REL, NATIVE_TEXT, Judge, overall_error,
                                              param_err, param_scale, scale_note, whole_norm)
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped

__all__ = ["NATIVE_EPS", "NATIVE_TEXT", "native_equivalence"]

# The epsilon of a native precision: the relative rounding of one value in its coarsest kernels (FP8: e4m3, the
# format activations and weights are cast to; e5m2 gradients are coarser still, and the split never sees either).
NATIVE_EPS = {"fp8": torch.finfo(torch.float8_e4m3fn).eps, "bf16": torch.finfo(torch.bfloat16).eps,
              "fp16": torch.finfo(torch.float16).eps, "fp32": EPS32}


def _count(adapter, y: torch.Tensor) -> int:
    """A micro-batch's weight in its window: its rows, or its valid tokens where the adapter pads."""
    return int((y != adapter.ignore_index).sum()) if adapter.ignore_index is not None else int(y.shape[0])


def _weighted(parts: list, weights: list) -> tuple[dict, float]:
    """Σ_m w_m·g_m (float64) over every part's step-0 gradient, and Σ_m w_m·L_m over their step-0 losses."""
    grads = {}
    for t, w in zip(parts, weights):
        for name, g in t.grads0.items():
            grads[name] = grads.get(name, 0) + w * g.detach().double()
    return grads, math.fsum(w * t.losses[0] for t, w in zip(parts, weights))


class NativeJudge(Judge):
    def __init__(self, gate, case, native: str):
        super().__init__(gate, case, where=f"native {native}: ")
        # the coarser of the declared kernels' precision and the case's autocast (a bf16 case of an fp32-native trainer)
        self.native, self.eps = native, max(NATIVE_EPS[native], NATIVE_EPS[case.precision])

    def within(self, what: str, err: float, noise: float, kappa: float, grouped: bool, floor: float = 0.0) -> None:
        """err ≤ C·max(noise, floor[, eps_native·max(1, κ/√N)]) + FLOOR·max(1, κ) (module docstring)."""
        n = self.case.accum_steps
        low = self.eps * max(1.0, kappa / math.sqrt(n)) if grouped else 0.0
        # the twins' noise is capped at 8·eps_native, as the float64 floor at 8·eps32: a bug whose effect follows the
        # rows' count or grouping moves the twin too, and must not loosen its own bound past what the precision rounds
        noise = min(noise, 8 * self.eps)
        b = C * max(noise, floor * max(1.0, kappa), low) + FLOOR * max(1.0, kappa)
        if not err <= b:  # also catches NaN
            which = (f"the big batch in {self.native}, ≤ {C:g}·max(noise {noise:.1e}, eps_{self.native} {low:.1e}"
                     f"{f', {floor:.1e}' if floor else ''})"
                     if grouped else f"Σ w_m·(N=1 on micro-batch m), ≤ {C:g}·max(noise {noise:.1e}, 2γ {floor:.1e})")
            self.fail(f"{what}: error {err:.3e} vs {which} + {FLOOR:.1e}·max(1, κ {kappa:.3g}) = {b:.3e}",
                      error=err, bound=b)
        if err / b >= self.worst_ratio:
            self.worst, self.worst_ratio = what, err / b


class _Scale:
    """tolerance.param_err / param_scale / scale_note against `ref`'s whole gradient, the line between a parameter's
    own norm and the whole's drawn at `resolution` (this comparison's: the native precision's, not float64's)."""

    def __init__(self, ref: dict, resolution: float):
        self.whole, self.resolution = whole_norm(ref), resolution

    def __call__(self, g) -> float:
        return param_scale(g, self.whole, resolution=self.resolution) or 1.0

    def err(self, x, ref) -> float:
        return param_err(x, ref, self.whole, resolution=self.resolution)

    def note(self, g) -> str:
        return scale_note(g, self.whole, resolution=self.resolution)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / (abs(b) or 1.0)


def native_equivalence(adapter, case: Case, device: str) -> GateResult:
    gate, N, native = Gate.EQUIVALENCE, case.accum_steps, adapter.native
    if adapter.objective is not None:
        raise GateSkipped(f"{adapter.name} declares an objective (verify.Objective): the native reference weighs "
                          f"micro-batches by their rows or valid tokens only, and needs a float64 run for any other "
                          f"normaliser")
    if case.world != 1 or case.last_window is not None:
        raise GateSkipped("the native reference judges one process and full windows")
    batches = case.batches(adapter)

    def run(n, data, c=case):  # the trainer's own precision: fp32 parameters, its kernels, the case's autocast
        return drive(adapter(c.spec(accum_steps=n, dtype=torch.float32, device=device, adapter=adapter)), data, n,
                     device=device, gate=gate, keep_params=False)  # its parameters are not judged

    acc, big = run(N, batches), run(1, batches)
    # a gradient read at the step (grads_from="optimizer") is clipped, and clipped parts do not add up: the split runs
    # the declared unclipped options, else judges the loss alone
    opts = unclipped_options(adapter, case.options)
    sc = case if opts is case.options else case.replace(options=opts)
    clipped = adapter.grads_from == "optimizer" and sc is case
    acc_s = acc if sc is case else run(N, batches, sc)
    j = NativeJudge(gate, case, native)
    j.keys(acc.grads0, big.grads0, f"accum_steps={N}")
    j.accumulator(acc)  # a boundary gradient held in bf16 / fp16 under autocast: named from its dtype, as in float64
    micro = shard(*batches[0], N, 0, 1)
    counts = [_count(adapter, y) for _, y in micro]
    noise, kappa, loss_noise, loss_kappa, over, ref = {}, {}, 0.0, 1.0, 0.0, big.grads0
    if sum(counts):  # window 0 holds a valid target: the split (an empty micro-batch weighs 0 and is not run)
        w = [c / sum(counts) for c in counts]
        kept = [m for m in range(N) if counts[m]]
        parts = [run(1, [micro[m]], sc) for m in kept]
        ref, ref_loss = _weighted(parts, [w[m] for m in kept])
        ref3, ref3_loss = _weighted([run(1, twin([micro[m]]), sc) for m in kept], [w[m] for m in kept])
        over = overall_error(ref3, ref)
    # what each comparison resolves: the split shares every quantization with the accumulation (the case's autocast
    # rounding and the twin's measured noise apart), the big batch is rounded apart at the native precision
    measured = min(over, 8 * j.eps)
    scale = _Scale(ref, C * max(NATIVE_EPS[case.precision], measured))
    big_scale = _Scale(big.grads0, C * max(j.eps, measured))
    if sum(counts):
        for name, g in ref.items():
            noise[name] = max(over, scale.err(ref3[name], g))
            kappa[name] = max(w[m] * t.grads0[name].double().norm().item() for m, t in zip(kept, parts)) / scale(g)
        loss_noise = _rel(ref3_loss, ref_loss)
        loss_kappa = max(abs(w[m] * t.losses[0]) for m, t in zip(kept, parts)) / (abs(ref_loss) or 1.0)
        sf = summation_floor(N)
        if not j._undefined(acc_s.losses[0], ref_loss, "loss of step 0 vs the split"):
            j.within("loss of step 0 vs the split", _rel(acc_s.losses[0], ref_loss), loss_noise, loss_kappa, False, sf)
        for name, g in ({} if clipped else ref).items():
            j.within(f"gradient (step 0) of {name!r} vs the split{scale.note(g)}", scale.err(acc_s.grads0[name], g),
                     noise[name], kappa[name], False, sf)
    for name, g in big.grads0.items():  # the big batch: the same noise, and the native precision's grouping
        j.within(f"gradient (step 0) of {name!r} vs the big batch{big_scale.note(g)}", big_scale.err(acc.grads0[name], g),
                 noise.get(name, 0.0), kappa.get(name, 1.0), True)
    for k, (la, lb) in enumerate(zip(acc.losses, big.losses)):
        if not j._undefined(la, lb, f"step-{k} loss", k):
            # at least the float64 policy's fp32 trajectory bound, LOSS_MAX_REL: not a twin's noise, so never capped
            j.within(f"step-{k} loss vs the big batch", _rel(la, lb), loss_noise, loss_kappa if k == 0 else 1.0, True,
                     LOSS_MAX_REL / C)
    unjudged = UNJUDGED.format(what="split") if clipped and sum(counts) else None
    return GateResult(gate, case, j.worst, j.worst_ratio, native=f"native {native}", unjudged=unjudged)
