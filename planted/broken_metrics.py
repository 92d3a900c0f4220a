"""Planted bugs in what a trainer reports (metrics()): its updates are right, its logged numbers are not.

Each subclasses xtrain's AccumTrainer, which logs loss, the pre-clip grad_norm, clip_coef, the applied lr and
the window's rows or valid tokens (xtrain_core/trainer.py), and changes one thing about what it logs, except
`partial_norm_clip`, whose clipping itself uses a partial norm. The metrics gate must reject each, naming
the metric and the step (planted/registry.py).
"""
from __future__ import annotations

import dataclasses

import torch

from xtrain_core.model import IGNORE
from xtrain_core.trainer import AccumTrainer

from verify import Metrics
from xtrain_proof import adapters as xtrain
from planted.template import Planted


def _norm(grads) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([g for g in grads if g is not None])


class NormOfLastMicro(Planted, AccumTrainer):
    """Logs the norm of the last micro-step's own gradient (surogate PR #75: a norm from one micro-step)."""

    def before(self, idx, targets, micro):
        if micro == self.accum_steps - 1:
            self._before_last = [None if p.grad is None else p.grad.clone() for p in self.model.parameters()]

    def after(self, micro):
        if micro == self.accum_steps - 1:  # micro-step N-1 added g_last / N (loss_norm="mean")
            now = [p.grad for p in self.model.parameters()]
            last = [(g if b is None else g - b) * self.accum_steps for g, b in zip(now, self._before_last) if g is not None]
            self._last_norm = _norm(last)

    def _log_step(self, norm):
        super()._log_step(self._last_norm if self.accum_steps > 1 else norm)


class NormAfterClip(AccumTrainer):
    """Logs the norm of the clipped gradient while it declares the norm before clipping (radixark/miles #2132)."""

    def _log_step(self, norm):
        super()._log_step(_norm([p.grad for p in self.model.parameters()]))  # clip() has already scaled .grad


class NormAfterZeroGrad(AccumTrainer):
    """Reads the norm when metrics() is asked, after zero_grad freed the gradients: 0 (flame #20 and torchtitan
    #990, where FSDP2 with accumulation logged grad_norm = 0)."""

    def metrics(self):
        out = super().metrics()
        grads = [torch.zeros(()) if p.grad is None else p.grad for p in self.model.parameters()]
        out["grad_norm"] = float(_norm(grads))
        return out


class LrBeforeSchedulerStep(AccumTrainer):
    """Declares the LR after the scheduler's step (as HF's Trainer logs it), reads it before that step."""


class TokensOfOneMicro(Planted, AccumTrainer):
    """Logs the last micro-step's valid-target count as the window's (a count from one micro-step)."""

    def before(self, idx, targets, micro):
        self._micro_tokens = int((targets != IGNORE).sum())

    def metrics(self):
        out = super().metrics()
        out["tokens"] = float(self._micro_tokens)
        return out


class LossOfLastMicro(Planted, AccumTrainer):
    """Logs the last micro-batch's loss as the window's (nanochat, prime-rl: a deliberate convention there,
    one that must then be declared: Metrics(loss="last_micro"))."""

    def before(self, idx, targets, micro):
        self._raw_before = None if micro == 0 else self._raw_sum.clone()

    def metrics(self):
        out = super().metrics()
        out["loss"] = float(self._last_raw)
        return out

    def after(self, micro):
        if micro == self.accum_steps - 1:
            self._last_raw = self._raw_sum - (self._raw_before if self._raw_before is not None else 0.0)


class PartialNormClip(Planted, AccumTrainer):
    """Clips with a coefficient from the gradient BEFORE the last micro-step (a partial norm), logs the right
    norm: the update is wrong, the coefficient applied tells by how much."""

    def before(self, idx, targets, micro):
        if micro == self.accum_steps - 1 and micro > 0:
            done = self.accum_steps / micro  # Σ_{m<N-1} g_m / N -> their mean
            self._partial = float(_norm([p.grad for p in self.model.parameters()])) * done

    def _update(self):
        cap, partial = self.cfg.max_grad_norm, getattr(self, "_partial", None)
        if cap is None or partial is None:
            return super()._update()
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(min(1.0, cap / (partial + 1e-6)))
        cfg, self.cfg = self.cfg, dataclasses.replace(self.cfg, max_grad_norm=None)  # clipped already, by that norm
        try:
            super()._update()
        finally:
            self.cfg = cfg


def _variant(cls, *, metrics=None, tokens=False):
    base = xtrain.single.replace(precisions=("fp32",), **({"metrics": metrics} if metrics is not None else {}))
    if tokens:
        base = base.replace(ignore_index=IGNORE, metrics=xtrain.TOKEN_METRICS)
    return xtrain.variant(cls, base)


norm_of_last_micro = _variant(NormOfLastMicro)
norm_after_clip = _variant(NormAfterClip)
norm_after_zero_grad = _variant(NormAfterZeroGrad)
lr_before_scheduler_step = _variant(LrBeforeSchedulerStep, metrics=Metrics(
    names=xtrain.METRICS.names, max_norm=xtrain.max_norm, lr="next"))
tokens_of_one_micro = _variant(TokensOfOneMicro, tokens=True)
loss_of_last_micro = _variant(LossOfLastMicro)
partial_norm_clip = _variant(PartialNormClip)
