"""The single-process gates. Each raises GateFailure naming what differs, the parameter and the error.

Tolerance policy (docs/design.md, "Tolerances"): fp32 results are judged against a float64 run of the
harness's own plain big-batch step (the ground truth), and the accumulation run must be no less
accurate than the fp32 big batch itself:

    err(accum32) ≤ C · err(big32) + F          C = 8, F = 8·eps32 (relative)

so the bound scales with whatever rounding the model and shapes produce, instead of a guessed atol.
That policy is applied to the first step's loss and gradients. After an AdamW step fp32 rounding is
amplified up to 1/eps in elements whose gradient is ≲ eps (the update is ≈ lr·g/(|g|+eps)), at
different elements in each run, so multi-step losses and params are checked in float64, where rounding
is ~1e-16 and stays ≤ 1e-12 after that amplification, while every bug we plant is ≥ 1e-5.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .interface import Case, Trace, TrainerFactory, run
from .reference import PlainTrainer

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
C = 8.0
FLOOR = 8 * EPS32
# float64 K-step params: worst measured accum64-vs-plain64 max|Δp| was 2.2e-12 over 60 drawn cases
# (lr up to 1e-2, K=3). 1e-9 leaves >400x headroom and is still 1e5x below one mis-scheduled LR step.
ATOL64_PARAMS = 1e-9
RTOL64_LOSS = 1e-9


class GateFailure(AssertionError):
    """A trainer failed a gate; the message names the gate, the case and what differed."""


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (absolute when ref is all zero, e.g. unused position rows)."""
    x, ref = x.detach().double(), ref.detach().double()
    d, n = (x - ref).norm().item(), ref.norm().item()
    return d / n if n > 0 else d


@dataclass
class Comparison:
    worst: str
    worst_ratio: float


def _within(name: str, what: str, acc: float, big: float, case: Case, gate: str) -> float:
    bound = C * big + FLOOR
    if not acc <= bound:  # also catches NaN
        raise GateFailure(
            f"[{gate}] {what} of {name!r}: accumulation error {acc:.3e} > {C:g}·{big:.3e} (fp32 big-batch "
            f"error) + {FLOOR:.1e}; case {case}")
    return acc / bound


def _check_grads_keys(got: dict, ref: dict, who: str, case: Case, gate: str) -> None:
    missing = sorted(set(ref) - set(got))
    if missing:
        raise GateFailure(f"[{gate}] {who} has no boundary gradient for {missing[:3]}; case {case}")


def check_equivalence(factory: TrainerFactory, case: Case, *, reference=PlainTrainer) -> Comparison:
    """Big-batch equivalence: accumulation (N, B) vs one step on the N·B batch, same init and data.

    fp32, first step (before any optimizer step can amplify rounding): the loss and every parameter's
    boundary gradient, by the ratio policy against the float64 plain big batch.
    float64, all K steps: every step's loss and every parameter after every step, absolute bound.
    """
    gate = "equivalence"
    batches = case.batches()
    acc = run(factory(case.spec()), batches[:1], case.accum_steps)
    big = run(reference(case.spec(accum_steps=1)), batches[:1], 1)
    ref = run(reference(case.spec(accum_steps=1, dtype=torch.float64)), batches, 1)
    acc64 = run(factory(case.spec(dtype=torch.float64)), batches, case.accum_steps)

    worst, worst_ratio = "loss", _within("step 0", "loss", abs(acc.losses[0] - ref.losses[0]) / abs(ref.losses[0]),
                                         abs(big.losses[0] - ref.losses[0]) / abs(ref.losses[0]), case, gate)
    _check_grads_keys(acc.grads0, ref.grads0, "the accumulation run", case, gate)
    for name, g in ref.grads0.items():
        r = _within(name, "gradient (step 0)", rel_err(acc.grads0[name], g), rel_err(big.grads0[name], g), case, gate)
        if r > worst_ratio:
            worst, worst_ratio = f"grad {name}", r
    _check_float64_trajectory(acc64, ref, case)
    return Comparison(worst, worst_ratio)


def _check_float64_trajectory(acc64: Trace, ref: Trace, case: Case) -> None:
    for k, (la, lr) in enumerate(zip(acc64.losses, ref.losses)):
        if not abs(la - lr) <= RTOL64_LOSS * abs(lr):
            raise GateFailure(f"[equivalence/float64] loss at step {k}: {la!r} vs big batch {lr!r} "
                              f"(rel {abs(la - lr) / abs(lr):.3e} > {RTOL64_LOSS:.0e}); case {case}")
    for k, (pa, pr) in enumerate(zip(acc64.params, ref.params)):
        for name, p in pr.items():
            d = (pa[name] - p).abs().max().item()
            if not d <= ATOL64_PARAMS:
                raise GateFailure(
                    f"[equivalence/float64] parameter {name!r} after step {k}: max|Δ| = {d:.3e} > "
                    f"{ATOL64_PARAMS:.0e} vs the float64 big batch; case {case}")


def check_bit_exact(factory: TrainerFactory, case: Case, *, reference=PlainTrainer) -> None:
    """accum_steps=1 vs the plain step: every grad, every loss, every param after K steps torch.equal."""
    gate = "bit-exact accum=1"
    batches = case.batches()
    got = run(factory(case.spec(accum_steps=1)), batches, 1)
    want = run(reference(case.spec(accum_steps=1)), batches, 1)
    _check_grads_keys(got.grads0, want.grads0, "accum_steps=1", case, gate)
    for name, g in want.grads0.items():
        _equal(got.grads0[name], g, f"gradient of {name!r} (step 0)", case, gate)
    for k, (a, b) in enumerate(zip(got.losses, want.losses)):
        if a != b:
            raise GateFailure(f"[{gate}] loss at step {k}: {a!r} != {b!r} (Δ {a - b:.3e}); case {case}")
    for k, (pa, pb) in enumerate(zip(got.params, want.params)):
        for name, p in pb.items():
            _equal(pa[name], p, f"parameter {name!r} after step {k}", case, gate)


def _equal(a: torch.Tensor, b: torch.Tensor, what: str, case: Case, gate: str) -> None:
    if not torch.equal(a, b):
        d = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
        raise GateFailure(f"[{gate}] {what}: not bit-identical, max|Δ| = {d:.3e}; case {case}")
