"""Deliberately broken trainers whose gradient ACCUMULATES in low precision across micro-steps. Each keeps
xtrain's trainer and its float64 run (the references and the float64 checks see a correct trainer); only in
its low precision does `.grad` hold a bf16 / fp16 running sum, whose rounding grows with N (each micro-step
adds a term rounded to 8 or 11 significant bits, relative to the running sum). The long-window gate, which
draws every declared precision (verify/test_gates.py), must reject each: the converted models by their
gradient's dtype, the fp32 buffers by their sum's dependence on the micro-batches' order (windows.check_order),
at every N ≥ 2; the error itself crosses the equivalence bound only from N ≈ 256 in bf16, 320–384 in fp16
(reports/cpu/lowprec-detection.md).

    half_model          fp16: the model converted with `.half()` (fp16 parameters, gradients, AdamW), a static
                        loss scale (torch's GradScaler refuses fp16 gradients), unscaled once at the boundary
    bf16_params         bf16: the model converted to bf16 (bf16 parameters, gradients, AdamW), no loss scale
    low_precision_grad  fp32 parameters and `.grad`, rounded to bf16 / fp16 after every micro-step
    fp16_grad_buffer    the same, declaring fp16 alone

(broken_numerics.bf16_accumulation_buffer keeps fp32 parameters and sums into a separate bf16 buffer.)
"""
from __future__ import annotations

import torch

from xtrain_core.trainer import AMP_DTYPES, AccumTrainer

from xtrain_proof import adapters as xtrain
from planted.template import Planted


class LowPrecisionParams(AccumTrainer):
    """In `acts_in`, the model's parameters (so their `.grad`, the accumulator) are converted to the
    precision's dtype after the optimizer is built; elsewhere (fp32, float64) xtrain's trainer unchanged."""

    acts_in: tuple[str, ...] = ()

    def __init__(self, model, optim, accum_steps, **numerics):
        super().__init__(model, optim, accum_steps, **numerics)
        self.static = 1.0
        if self.precision in self.acts_in and next(model.parameters()).dtype == torch.float32:
            model.to(AMP_DTYPES[self.precision])  # in place: the optimizer keeps the same Parameter objects
            if self.scaler is not None:  # GradScaler.unscale_ refuses fp16 gradients: a static scale
                self.static, self.scaler = float(numerics.get("init_scale", 2.0**16)), None

    def _backward(self, objective) -> None:
        super()._backward(None if objective is None else objective * self.static)

    def _unscale(self) -> None:
        if self.static == 1.0:  # outside acts_in: xtrain's own (its GradScaler's unscale_ under fp16)
            super()._unscale()
        elif not self._unscaled:
            torch._foreach_div_(self._grads_list(), self.static)
            self._unscaled = True

    def partial_grads(self):
        return {k: g / self.static for k, g in super().partial_grads().items()}


class LowPrecisionGrad(Planted, AccumTrainer):
    """fp32 parameters and autocast, as xtrain; but in bf16 / fp16 `.grad` is rounded to that dtype after
    every micro-step: the running sum lives in 8 / 11 significant bits (a bf16 / fp16 accumulation buffer)."""

    def after(self, micro):
        if self.precision in AMP_DTYPES:
            with torch.no_grad():
                for g in self._grads_list():
                    g.copy_(g.to(AMP_DTYPES[self.precision]))


class HalfModel(LowPrecisionParams):
    acts_in = ("fp16",)


class Bf16Params(LowPrecisionParams):
    acts_in = ("bf16",)


half_model = xtrain.variant(HalfModel, xtrain.single)
bf16_params = xtrain.variant(Bf16Params, xtrain.single)

low_precision_grad = xtrain.variant(LowPrecisionGrad, xtrain.single)
# The same buffer in fp16 alone: its 11 bits stay under the equivalence policy at N = 256 on xtrain's models
# (reports/cpu/lowprec-detection.md); the long window's order check rejects it at any N (windows.check_order).
fp16_grad_buffer = low_precision_grad.replace(precisions=("fp32", "fp16"), name="broken: LowPrecisionGrad, fp16")
