"""The harness's own reference: the textbook no-accumulation step, written independently of any
trainer under test. It is the 'plain path' of the bit-exact gate and, in float64, the ground truth
of the equivalence gate.
"""
from __future__ import annotations

import torch

from .interface import Spec


class PlainTrainer:
    """accum_steps must be 1: one micro-step IS the whole batch. loss.backward(); clip; AdamW; zero."""

    def __init__(self, spec: Spec):
        self.model = spec.build_model()
        o = spec.optim
        self.cfg = o
        fused = o.fused if o.fused is not None else spec.device.startswith("cuda")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                     weight_decay=o.weight_decay, fused=fused or None)
        w = o.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / w) if w else 1.0)
        self._loss = None

    def micro_step(self, idx, targets, micro):
        assert micro == 0, "PlainTrainer runs one micro-step per optimizer step"  # harness bug, not user input
        loss = self.model.loss_batched(idx, targets)
        loss.backward()
        self._loss = loss.detach()

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return self._loss

    def params(self):
        return {k: p.detach() for k, p in self.model.named_parameters()}
