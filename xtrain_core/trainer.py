"""The accumulation step: `AccumTrainer`, the trainer-under-test interface the verify/ harness drives.

    micro_step(idx, targets, micro)  -- forward + (loss if N == 1 else loss * (1/N)).backward(): .grad SUMS
    grads()                          -- the boundary gradient: after accumulation, before clip/step
    optimizer_step() -> loss         -- clip, AdamW, LR schedule, zero_grad once per step; the step loss
    params()                         -- name -> tensor
    metrics()                        -- what the step logs: loss, grad_norm, clip_coef, lr, rows or tokens

loss_norm="tokens": Σ CE / (N·B·S), rescaled at the boundary by N·B·S / tokens (none valid: the window is skipped);
precision fp32 | bf16 | fp16 (one GradScaler, one unscale per window). Why: docs/design/protocol.md, numerics.md.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .config import LOSS_NORMS, PRECISIONS, OptimConfig
from .model import IGNORE

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(model: nn.Module, cfg: OptimConfig):
    """torch's AdamW and a linear warm-up LambdaLR; the scheduler counts optimizer steps only."""
    fused = cfg.fused if cfg.fused is not None else next(model.parameters()).is_cuda
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, fused=fused or None)
    w = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / w) if w else 1.0)
    return opt, sched


def clip(model: nn.Module, cfg: OptimConfig) -> torch.Tensor:
    """Clips to cfg.max_grad_norm when set; returns the pre-clip total norm either way (what the trainer logs).
    A tensor, read only when logged: under FSDP2 it is a DTensor whose value costs a collective."""
    if cfg.max_grad_norm is not None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])


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
    """What every trainer here shares: micro-step order checks, loss normalization and precision, the
    step loss's bookkeeping, the boundary's one update, params(), train_step()."""

    accum_steps: int
    _next_micro: int

    def _setup(self, model: nn.Module, optim: OptimConfig, accum_steps: int, loss_norm: str, precision: str,
               init_scale: float = 2.0**16) -> None:
        """What every trainer's __init__ starts with: the checked window size, the model and optimizer
        config, loss normalization and precision (the GradScaler for fp16), an empty window."""
        check_accum_steps(accum_steps)
        self.model, self.cfg, self.accum_steps = model, optim, accum_steps
        if loss_norm not in LOSS_NORMS:
            raise ValueError(f"loss_norm must be one of {LOSS_NORMS}, got {loss_norm!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        p = next(model.parameters())
        if precision != "fp32" and p.dtype != torch.float32:
            raise ValueError(f"precision {precision} keeps fp32 parameters (autocast), got {p.dtype} parameters")
        self.loss_norm, self.precision = loss_norm, precision
        self._device_type = p.device.type
        # fp16: torch's GradScaler, starting at init_scale (torch's default 2^16) and backing off on overflow
        self.scaler = torch.amp.GradScaler(p.device.type, init_scale=init_scale) if precision == "fp16" else None
        self.skipped_steps = 0
        self.last_skipped = False
        self._logged: dict = {}
        self._last_loss = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._raw_sum = None  # mean: Σ raw micro losses
        self._num = None  # Σ raw·B (mean) or Σ CE over valid tokens (tokens): this rank's step-loss numerator
        self._den = 0  # Σ B (mean) or Σ valid tokens (tokens): its denominator (a tensor for tokens)
        self._unscaled = self._finished = False
        self._next_micro = 0

    def _amp(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=AMP_DTYPES[self.precision])

    def _objective(self, forward_mean, forward_sum, idx, targets, micro: int, *, alone: bool) -> torch.Tensor | None:
        """The tensor this micro-step backwards (None: nothing to backward), with the step loss accounted.
        forward_mean / forward_sum: (idx, targets) -> CE mean / (Σ CE, valid count). `alone`: nobody else's
        micro-batches join this window (one rank), so N == 1 may take the plain path."""
        n = self.accum_steps
        with self._amp():
            if self.loss_norm == "mean":
                loss = forward_mean(idx, targets)  # (B, S) -> scalar mean
                raw = loss.detach()
                self._raw_sum = raw if micro == 0 else self._raw_sum + raw
                self._num = raw * idx.shape[0] if micro == 0 else self._num + raw * idx.shape[0]
                self._den += idx.shape[0]
                return loss if n == 1 else loss * (1.0 / n)  # N == 1: no scale at all (the plain graph)
            if n == 1 and alone:  # the plain token mean: exactly plain_step's graph
                loss = forward_mean(idx, targets)
                count = (targets != IGNORE).sum()
                self._num, self._den = loss.detach() * count, count
                self._raw_sum = loss.detach()
                return loss if int(count) > 0 else None  # 0 tokens: 0/0; the window is skipped
            total, count = forward_sum(idx, targets)
            self._num = total.detach() if micro == 0 else self._num + total.detach()
            self._den = count if micro == 0 else self._den + count
            self._positions = n * targets.numel()  # N·B·S: this rank's target positions in the window
            return total * (1.0 / self._positions)  # × N·B·S / tokens at the boundary

    def _backward(self, objective) -> None:
        if objective is None:
            return
        (self.scaler.scale(objective) if self.scaler is not None else objective).backward()

    def _enter(self, micro: int) -> None:
        if micro != self._next_micro:
            raise RuntimeError(f"micro_step called with micro={micro}, expected {self._next_micro} of {self.accum_steps}")

    def _require_boundary(self, what: str) -> None:
        if self._next_micro != self.accum_steps:
            raise RuntimeError(f"{what}() before the boundary: ran {self._next_micro} of {self.accum_steps} micro-steps")

    def _grads_list(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _normalize(self, tokens: int | None, ranks: int = 1) -> None:
        """tokens mode, N ≥ 2 or data parallel: the accumulated Σ/(N·B·S) (summed over `ranks`, or their
        mean: ranks=W) becomes Σ over valid tokens / their count."""
        if tokens:
            torch._foreach_mul_(self._grads_list(), ranks * self._positions / tokens)

    def _unscale(self) -> None:
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.opt)  # ONE unscale per window, before anything reads the gradient
            self._unscaled = True

    def params(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.model.named_parameters()}

    def loss_scale(self) -> float:
        """The fp16 GradScaler's scale now (1.0 without one): lets a harness see it change once per window."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def partial_grads(self) -> dict[str, torch.Tensor]:
        """Between micro-steps (boundary not reached): the gradient grads() would return if the window
        ended after the micro-steps run so far — this rank's, before any collective. New tensors; the
        trainer's state is untouched. Lets a harness check that each micro-step's contribution lands
        exactly once."""
        done = self._next_micro
        if not 0 < done < self.accum_steps:
            raise RuntimeError(f"partial_grads() between micro-steps only, ran {done} of {self.accum_steps}")
        if self.loss_norm == "mean":
            f = self.accum_steps / done  # Σ_{i<done} g_i/N -> their mean
        else:
            tokens = int(self._den)
            f = self._positions / tokens if tokens else 0.0
        if self.scaler is not None:
            f /= self.scaler.get_scale()
        return {k: p.grad.detach() * f for k, p in self.model.named_parameters() if p.grad is not None}

    def grads(self) -> dict[str, torch.Tensor]:
        self._require_boundary("grads")
        self._finish_window()
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def _finish_window(self) -> None:
        """Idempotent per window: the token division and the fp16 unscale, so grads() shows the gradient
        the optimizer will see."""
        if not self._finished:
            self._finish()
            if self._window_tokens() != 0:  # an empty window is skipped whole: the scaler never sees it
                self._unscale()
            self._finished = True

    def _finish(self) -> None:  # overridden by the data-parallel trainer (the boundary collective)
        if self.loss_norm == "tokens" and self.accum_steps != 1:
            self._normalize(int(self._den))

    def _window_tokens(self) -> int | None:
        return int(self._den) if self.loss_norm == "tokens" else None

    def _update(self) -> None:
        """The boundary's one update: clip the mean gradient, step, LR schedule (never per micro-step).
        Skipped whole (no step, no schedule) for a window without a valid token or, under fp16, with an
        inf/NaN anywhere in it."""
        self._require_boundary("optimizer_step")
        self._finish_window()
        tokens = self._window_tokens()
        self.last_skipped = tokens == 0
        self._logged = {"tokens" if self.loss_norm == "tokens" else "rows": self._window_count()}
        if self.last_skipped:
            pass  # no valid token in the window: no update, no schedule step, the scaler untouched
        elif self.scaler is not None:
            self._log_step(self._clip())
            scale = self.scaler.get_scale()
            self.scaler.step(self.opt)  # skips the step if unscale_ found an inf/NaN in ANY micro-step
            self.scaler.update()
            self.last_skipped = self.scaler.get_scale() < scale  # the scale backs off exactly on a skip
            if not self.last_skipped:
                self.sched.step()
        else:
            self._log_step(self._clip())
            self.opt.step()
            self.sched.step()
        self.skipped_steps += int(self.last_skipped)
        self._finished = False

    def _window_count(self):
        """The window's denominator over every rank: its rows (mean) or valid tokens (tokens); overridden by the
        data-parallel trainers, whose boundary reduced it."""
        return self._den

    def _clip(self) -> torch.Tensor:
        """The boundary's clip (module-level clip()): its pre-clip norm is what the step logs. A method, so a
        planted bug (planted/broken_mesh_metrics.py) can change where the norm comes from and nothing else."""
        return clip(self.model, self.cfg)

    def _log_step(self, norm: torch.Tensor) -> None:
        """Before the optimizer step: the pre-clip norm (a tensor, read when logged) and the LR it applies."""
        self._logged.update(grad_norm=norm, lr=self.sched.get_last_lr()[0])

    def metrics(self) -> dict[str, float]:
        """What the last optimizer step logs, over every rank: loss (the step loss), grad_norm (pre-clip),
        clip_coef (min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ scales), lr (the one applied), and the
        window's rows (mean) or valid tokens (tokens). A skipped window (no valid token) logs no norm or LR."""
        out = {k: float(v) for k, v in self._logged.items() if k != "grad_norm"}
        norm = self._logged.get("grad_norm")
        norm = norm() if callable(norm) else norm  # FSDP2 without clipping: reduced only when read (fsdp.py)
        if norm is not None:
            norm = float(norm.full_tensor() if callable(getattr(norm, "full_tensor", None)) else norm)
            cap = self.cfg.max_grad_norm
            out.update(grad_norm=norm, clip_coef=1.0 if cap is None else min(1.0, cap / (norm + 1e-6)))
        if self._last_loss is not None:
            out["loss"] = float(self._last_loss)
        return out

    def _step_loss(self) -> torch.Tensor:
        """This window's loss: mean of the raw micro losses (mean), Σ CE / tokens (tokens; NaN if none)."""
        n = self.accum_steps
        if self.loss_norm == "mean":
            return self._raw_sum if n == 1 else self._raw_sum / n
        if n == 1:
            return self._raw_sum if int(self._den) > 0 else torch.full_like(self._raw_sum, float("nan"))
        return self._num / self._den if int(self._den) > 0 else torch.full_like(self._num, float("nan"))

    def train_step(self, micro_batches) -> torch.Tensor:
        """micro_batches: N pairs (idx, targets), each (B, S) (this rank's shards under data parallel).
        A window is exactly N micro-batches: fewer is an error, never a silent 1/N over fewer."""
        if len(micro_batches) != self.accum_steps:
            raise ValueError(f"expected {self.accum_steps} micro-batches, got {len(micro_batches)}")
        for i, (x, y) in enumerate(micro_batches):
            self.micro_step(x, y, i)
        return self.optimizer_step()


class AccumTrainer(MicroSchedule):
    """Single-process gradient accumulation over `accum_steps` micro-steps."""

    def __init__(self, model: nn.Module, optim: OptimConfig, accum_steps: int, *, loss_norm: str = "mean",
                 precision: str = "fp32", init_scale: float = 2.0**16):
        self._setup(model, optim, accum_steps, loss_norm, precision, init_scale)
        self.opt, self.sched = make_optimizer(model, optim)

    # -- micro-steps --------------------------------------------------------------------------
    def micro_step(self, idx: torch.Tensor, targets: torch.Tensor, micro: int) -> None:
        self._enter(micro)
        m = self.model
        self._backward(self._objective(m.loss_batched, m.loss_sum, idx, targets, micro, alone=True))
        self._next_micro = micro + 1

    # -- the boundary -------------------------------------------------------------------------
    def optimizer_step(self) -> torch.Tensor:
        """Clip, step, schedule, zero. Returns the step loss (NaN for a window without a valid token)."""
        self._update()
        self.opt.zero_grad(set_to_none=True)
        loss = self._last_loss = self._step_loss()
        self._reset_window()
        return loss
