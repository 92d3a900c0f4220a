"""The metrics gate's bounds, per precision: Float64Bounds for its float64 runs (the float64 policy's bound,
counts exact); LowBounds for a bf16 / fp16 case's run in that precision (gates/metrics.py judge_precision), whose
reports are judged against that run's own values: a norm within exp((n + 8)·eps32) − 1 of ‖grads()‖ as a ratio
either way (norm_bound), the loss within C·eps_p·max(1, κ) of what optimizer_step() returned (κ: loss_kappa,
measured only where κ = 1 fails), the LR within the float64 bound, counts exact. A failure whose ratio is the
run's loss scale (loss_scale(), read as the step begins) names it. Derivations: docs/design/metrics.md.
"""
from __future__ import annotations

import functools
import math

import torch

from verify._internal.cases.case import drive, shard
from verify._internal.gates.kappa import fed
from verify._internal.gates.tolerance import C, EPS, EPS32, bound64
from verify._internal.metrics import norm_of
from verify._internal.verdict import Gate

__all__ = ["Float64Bounds", "FLOAT64", "LowBounds", "norm_bound", "loss_kappa"]

F64 = torch.float64
_UNSCALE = ("read from the loss-scaled gradient or loss: call scaler.unscale_(optimizer) before clip_grad_norm_ "
            "and before reading the norm, and log the loss before scaler.scale()")


class Float64Bounds:
    """The float64 runs' bounds and names: the float64 policy's bound (bound64) for every metric, counts exact.
    LowBounds (below) answers the same questions for a bf16 / fp16 run."""

    label = ""  # the tally's suffix: "grad_norm" here, "grad_norm@fp16" for a low-precision run
    own_loss = False  # loss='window' expected: the float64 big batch's (here) or the run's own returned loss
    loss_what = "the float64 big batch's step loss"

    def __init__(self, kappa=None):
        # kappa(k): κ of window k's loss at the float64 big batch's parameters there (gates/kappa.py), as Judge.float64
        # takes it: a loss whose blocks cancel is resolved no better than its largest block
        self._kappa = None if kappa is None else functools.cache(kappa)

    def tol(self, name: str, k: int, s: dict) -> float:
        return 0.0 if name in ("tokens", "rows") else bound64()

    def error(self, name: str):
        """How `name`'s error is measured: None, relative (|got − want| / |want|)."""
        return None

    def refine(self, name: str, k: int) -> float | None:
        """A bound with a measured κ, for a check that failed at κ = 1 (None: nothing to measure)."""
        if name != "loss" or self._kappa is None:
            return None
        kappa = self._kappa(k)
        return bound64(kappa=kappa) if kappa > 1.0 else None

    def factors(self, s: dict) -> tuple:
        """(name, factor) the run knows beyond the case's counts (a loss scale), for a failure to name."""
        return ()

    def extra(self, s: dict, name: str, cap: float | None, clip_eps: float) -> tuple:
        """(name, value) a wrong report of `name` may equal, beyond the harness's own."""
        return ()

    def hint(self, named: str) -> str | None:
        """The failure's hint, from what its factor text `named` (factor_text's) found the report to be."""
        return None


FLOAT64 = Float64Bounds()


def norm_bound(elements: int, roundings: int = 0) -> float:
    """The bound on max(T / H, H / T) − 1 between a norm T computed in fp32 from n fp32 elements, in any order,
    and the same norm H in float64 (+ `roundings` more of eps32: a coefficient's division, a clipped gradient's
    product). Every square and addition of a sum of n non-negative terms rounds once, each term taking at most
    m = n + 6 of them (n − 1 additions, its square, two levels of per-tensor norms squared again), so the sum
    lies within (1 ± u)^m of the exact one (u = eps32 / 2); the square root halves that and rounds once, and an
    unscale by a scale no power of two rounds 3 more times: |ln(T / H)| ≤ ((n + 14) / 2)·u / (1 − u). The bound
    exp((n + 8)·eps32) − 1 holds that with ≥ 2.4× to spare at every n."""
    return math.expm1((elements + 8 + roundings) * EPS32)


def _ratio(got: float, want: float) -> float:
    """max(got / want, want / got) − 1: a factor either way weighs the same (1/1024 as 1024)."""
    if want == 0:
        return abs(got)
    r = got / want
    return math.inf if r <= 0 else max(r, 1.0 / r) - 1.0


class LowBounds(Float64Bounds):
    """The bounds of a bf16 / fp16 run's reports (module docstring), and the loss scale a failure names."""

    own_loss = True
    loss_what = "this run's own step loss, as optimizer_step() returned it"

    def __init__(self, precision: str, metrics, kappa):
        super().__init__(kappa)  # kappa(k): the loss's κ of window k (float64 blocks)
        self.precision, self.metrics, self.label = precision, metrics, f"@{precision}"

    def tol(self, name: str, k: int, s: dict) -> float:
        if name in ("tokens", "rows"):
            return 0.0
        if name == "lr":
            return bound64()
        if name == "loss":
            return C * EPS[self.precision]
        if name == "clip_coef":
            return norm_bound(s["elements"], 1)
        if name == "clip (applied)" or self.metrics.grad_norm == "post_clip":  # ‖g‖ × the coefficient applied
            return norm_bound(s["elements"], 2)
        return norm_bound(s["elements"])

    def error(self, name: str):
        return _ratio if name in ("grad_norm", "clip_coef", "clip (applied)") else None

    def refine(self, name: str, k: int) -> float | None:
        if name != "loss":
            return None
        kappa = self._kappa(k)
        return C * EPS[self.precision] * kappa if kappa > 1.0 else None

    def factors(self, s: dict) -> tuple:
        scale = s.get("loss_scale")
        if scale is None or scale == 1.0 or not math.isfinite(scale) or scale <= 0:
            return ()
        return (("the loss scale", scale), ("1/the loss scale", 1.0 / scale))

    def extra(self, s: dict, name: str, cap: float | None, clip_eps: float) -> tuple:
        norm, scales = norm_of(s), self.factors(s)
        if name != "clip_coef" or cap is None or norm is None or not scales:
            return ()
        scaled = min(1.0, cap / (norm * scales[0][1] + clip_eps))
        return (("max_norm over the norm × the loss scale", scaled),)

    def hint(self, named: str) -> str | None:
        return f"the metric was {_UNSCALE}" if "the loss scale" in named else None


def loss_kappa(adapter, case, device, batches, k: int, big) -> float:
    """κ of window k's loss: Σ over its micro-batches of |float64 loss| / |the window's float64 loss|, both at the
    initial parameters (the protocol cannot set a trainer's; at k = 0 they are the step's own). The sum, not the
    policy's max: the window's loss weighs each micro-batch's by w ≤ 1 (1/N for a mean, its share of the count for
    a token mean, 1 for a sum), so Σ w·|loss| ≤ κ·|window loss| for each."""
    def loss(x, y) -> float:
        if not fed(adapter, y):  # never fed alone (empty_windows=False): undefined, left out of the sum
            return math.nan
        t = adapter(case.spec(accum_steps=1, dtype=F64, device=device, adapter=adapter))
        return drive(t, [(x, y)], 1, dtype=F64, device=device, gate=Gate.REPORTED_METRICS).losses[0]

    x, y = batches[k]
    whole = big.losses[0] if k == 0 else loss(x, y)
    total = sum(abs(v) for v in (loss(*b) for b in shard(x, y, case.accum_steps, 0, 1)) if math.isfinite(v))
    return total / abs(whole) if math.isfinite(whole) and whole != 0 else 1.0
