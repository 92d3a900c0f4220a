"""Planted bugs of trainers without a float64 path, judged by the native reference (Numerics(native=...)), in the
style of two field bugs — and the honest trainers beside them that must pass:

    fp8_micro_token_mean       the torchao FP8 recipe, each micro-batch ÷ its own valid tokens, then ÷ N
    fp8_delayed_per_forward    FP8 with delayed scaling whose amax history advances every forward: micro-step m is
                               quantized with micro-batch m−1's scale, the big batch with the last step's
    fp8_delayed                honest: the same, the window's amaxes folded into the history at the boundary
    liger_first_token          examples/liger_flce.py with a fused linear cross-entropy whose reduction="none" backward
                               scales every token by the first one's upstream gradient (Liger < 0.8.2, PR #1298),
                               emulated in torch so it runs on a CPU
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from examples import fp8_torchao, liger_flce

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t cast to float8 e4m3 at `scale` (saturating) and back: what a float8 matmul multiplies."""
    return (t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(t.dtype) / scale


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, sx, sw):
        qx, qw = _quantize(x, sx), _quantize(w, sw)
        ctx.save_for_backward(qx, qw)
        return qx @ qw.t() + b

    @staticmethod
    def backward(ctx, go):
        qx, qw = ctx.saved_tensors
        return go @ qw, go.t() @ qx, go.sum(0), None, None


class DelayedLinear(torch.nn.Linear):
    """A float8 Linear with delayed scaling (TransformerEngine's recipe, history of one): each forward quantizes
    with 448 / the amax recorded before it. `per_forward`: every forward records its own amax (the bug under
    accumulation); else they are kept for the window and recorded at the boundary (`record`)."""

    per_forward = False

    def _start(self):
        self.register_buffer("amax", torch.ones(2, device=self.weight.device, dtype=self.weight.dtype))
        self.window = torch.zeros_like(self.amax)

    def forward(self, x):
        out = _Fp8Linear.apply(x, self.weight, self.bias, E4M3_MAX / self.amax[0], E4M3_MAX / self.amax[1])
        seen = torch.stack([x.detach().abs().max(), self.weight.detach().abs().max()])
        self.window = torch.maximum(self.window, seen)
        if self.per_forward:
            self.record()
        return out

    def record(self):
        self.amax, self.window = self.window.clamp_min(1e-12), torch.zeros_like(self.window)


class PerForwardLinear(DelayedLinear):
    per_forward = True


class DelayedTrainer(fp8_torchao.Trainer):
    linear = DelayedLinear

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = fp8_torchao.LM().to(spec.device, spec.dtype)
        for m in self.model.modules():
            if type(m) is torch.nn.Linear:  # the same parameters, now quantized as delayed scaling does
                m.__class__ = self.linear
                m._start()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.n, self.tokens, self.loss_sum = spec.accum_steps, 0, 0.0

    def optimizer_step(self):
        for m in self.model.modules():
            if isinstance(m, DelayedLinear) and not m.per_forward:
                m.record()  # the window's amaxes become the next window's scales: one history step per optimizer step
        return super().optimizer_step()


class PerForwardTrainer(DelayedTrainer):
    linear = PerForwardLinear


class MicroTokenMeanFp8(fp8_torchao.Trainer):
    def micro_step(self, x, y, micro):
        count = int((y != fp8_torchao.IGNORE).sum())
        if count:  # ÷ its own tokens and ÷ N: the mean of micro-batch means
            loss = F.cross_entropy(self.model(x), y.flatten(), ignore_index=fp8_torchao.IGNORE) / self.n
            loss.backward()
            self.loss_sum += loss.item() * self.n * count
        self.tokens += count

    def optimizer_step(self):
        loss = self.loss_sum / self.tokens if self.tokens else float("nan")
        if self.tokens:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=fp8_torchao.MAX_NORM)
            self.opt.step()
        self.opt.zero_grad()
        self.tokens, self.loss_sum = 0, 0.0
        return loss


class _FirstTokenCE(torch.autograd.Function):
    """Fused linear cross-entropy, reduction="none", as Liger < 0.8.2 computed it: the forward right, the backward's
    per-token upstream gradient read as one scalar, grad_output[0] (its element_mul_kernel's tl.load)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets):
        with torch.enable_grad():
            h, w, b = (t.detach().requires_grad_() for t in (hidden, weight, bias))
            losses = F.cross_entropy(h @ w.t() + b, targets, ignore_index=liger_flce.IGNORE, reduction="none")
            gh, gw, gb = torch.autograd.grad(losses.sum(), (h, w, b))
        ctx.save_for_backward(gh, gw, gb)
        return losses.detach()

    @staticmethod
    def backward(ctx, grad_output):
        gh, gw, gb = ctx.saved_tensors
        first = grad_output[0]
        return gh * first, gw * first, gb * first, None


def _first_token_losses(hidden, head, targets):
    return _FirstTokenCE.apply(hidden, head.weight, head.bias, targets)


class FirstTokenTrainer(liger_flce.Trainer):
    def micro_step(self, x, y, micro):
        real, liger_flce.token_losses = liger_flce.token_losses, _first_token_losses
        try:
            super().micro_step(x, y, micro)
        finally:
            liger_flce.token_losses = real


def _broken(adapter, cls, what):
    return dataclasses.replace(adapter, factory=cls, name=f"broken: {adapter.name}, {what}", ref=None)


fp8_micro_token_mean = _broken(fp8_torchao.factory, MicroTokenMeanFp8, "per-micro token mean")
fp8_delayed_per_forward = _broken(fp8_torchao.factory, PerForwardTrainer, "delayed scaling advanced every forward")
fp8_delayed = dataclasses.replace(fp8_torchao.factory, factory=DelayedTrainer, name="honest: FP8 delayed scaling, "
                                  "recorded at the boundary", ref=None)
liger_first_token = _broken(liger_flce.factory, FirstTokenTrainer, "each token's gradient × the first token's weight")
