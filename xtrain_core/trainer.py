"""The accumulation step.

One optimizer step = N micro-steps + one boundary:

    for micro in 0..N-1:                       # each micro-batch is (B, S)
        loss = model.loss_batched(x, y)        # CE mean over B·S rows
        (loss if N == 1 else loss * (1/N)).backward()   # .grad SUMS across micro-steps
    clip_grad_norm_(params, max_norm)          # on the mean gradient of the N·B batch
    opt.step(); sched.step(); opt.zero_grad()  # once per optimizer step, never per micro-step

The 1/N rides through autograd, so clip and AdamW see exactly the big-batch mean gradient.
With N == 1 the scale is skipped entirely (not even `* 1.0`), so accum_steps=1 runs the same
kernels as `plain_step` and is bit-identical to it.

`AccumTrainer` is the trainer-under-test interface the verify/ harness drives:
    micro_step(idx, targets, micro)  -- forward + scaled backward of micro-step `micro` of N
    grads()                          -- the boundary gradient: after accumulation, before clip/step
    optimizer_step() -> loss         -- clip, AdamW, LR schedule, zero_grad; returns the step loss
    params()                         -- name -> tensor
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .config import OptimConfig


def make_optimizer(model: nn.Module, cfg: OptimConfig):
    """torch's AdamW and a linear warm-up LambdaLR; the scheduler counts optimizer steps only."""
    fused = cfg.fused if cfg.fused is not None else next(model.parameters()).is_cuda
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, fused=fused or None)
    w = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / w) if w else 1.0)
    return opt, sched


def clip(model: nn.Module, cfg: OptimConfig) -> None:
    if cfg.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)


def plain_step(model, opt, sched, cfg: OptimConfig, idx, targets) -> torch.Tensor:
    """The no-accumulation step, kept verbatim as the regression reference for accum_steps=1."""
    loss = model.loss_batched(idx, targets)
    loss.backward()
    clip(model, cfg)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def check_accum_steps(accum_steps) -> None:
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an integer ≥ 1, got {accum_steps!r}")


class MicroSchedule:
    """What every trainer here shares: micro-step order checks, params(), train_step()."""

    accum_steps: int
    _next_micro: int

    def _enter(self, micro: int) -> None:
        if micro != self._next_micro:
            raise RuntimeError(f"micro_step called with micro={micro}, expected {self._next_micro} of {self.accum_steps}")

    def _require_boundary(self, what: str) -> None:
        if self._next_micro != self.accum_steps:
            raise RuntimeError(f"{what}() before the boundary: ran {self._next_micro} of {self.accum_steps} micro-steps")

    def params(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.model.named_parameters()}

    def grads(self) -> dict[str, torch.Tensor]:
        self._require_boundary("grads")
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def _update(self) -> None:
        """The boundary's one update: clip the mean gradient, AdamW, LR schedule (never per micro-step)."""
        self._require_boundary("optimizer_step")
        clip(self.model, self.cfg)
        self.opt.step()
        self.sched.step()

    def train_step(self, micro_batches) -> torch.Tensor:
        """micro_batches: N pairs (idx, targets), each (B, S) (this rank's shards under data parallel)."""
        if len(micro_batches) != self.accum_steps:
            raise ValueError(f"expected {self.accum_steps} micro-batches, got {len(micro_batches)}")
        for i, (x, y) in enumerate(micro_batches):
            self.micro_step(x, y, i)
        return self.optimizer_step()


class AccumTrainer(MicroSchedule):
    """Single-process gradient accumulation over `accum_steps` micro-steps."""

    def __init__(self, model: nn.Module, optim: OptimConfig, accum_steps: int):
        check_accum_steps(accum_steps)
        self.model, self.cfg, self.accum_steps = model, optim, accum_steps
        self.opt, self.sched = make_optimizer(model, optim)
        self._loss_sum: torch.Tensor | None = None  # Σ raw micro losses, on device (no host sync)
        self._next_micro = 0

    # -- micro-steps --------------------------------------------------------------------------
    def micro_step(self, idx: torch.Tensor, targets: torch.Tensor, micro: int) -> None:
        n = self.accum_steps
        self._enter(micro)
        loss = self.model.loss_batched(idx, targets)
        raw = loss.detach()
        self._loss_sum = raw if micro == 0 else self._loss_sum + raw
        # N == 1: no scale at all, so the graph is exactly plain_step's.
        (loss if n == 1 else loss * (1.0 / n)).backward()
        self._next_micro = micro + 1

    # -- the boundary -------------------------------------------------------------------------
    def optimizer_step(self) -> torch.Tensor:
        """Clip, step, schedule, zero. Returns the step loss: mean of the N raw micro losses."""
        self._update()
        self.opt.zero_grad(set_to_none=True)
        n, s = self.accum_steps, self._loss_sum
        self._loss_sum, self._next_micro = None, 0
        return s if n == 1 else s / n
