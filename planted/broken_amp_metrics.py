"""Planted bugs in what a mixed-precision trainer reports: a norm, a clip coefficient read from the loss-scaled
gradient, before scaler.unscale_. Each update is right (or, with AdamW, nearly: a uniform factor on the gradient
cancels), so only the metrics gate's bf16 / fp16 run can see them (planted/registry.py).

`AmpTrainer` is the honest base, the PyTorch AMP recipe with accumulation: an MLP under autocast, a GradScaler
under fp16 (starting at 2^10), unscale_ before clip_grad_norm_, the norm it returns logged. Its grads() hands the
harness unscaled copies and leaves the loop as it is. `honest` is its adapter (a control: it must pass).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import verify

INIT_SCALE = 2.0**10  # the loss scale a bug's factor is: ×1024
MAX_NORM = 0.5  # below the drawn windows' norms (~1-3): clipping is active where a coefficient bug can show
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def warmup(step):
    return min(1.0, (step + 1) / 3)


class AmpTrainer:
    """N micro-steps of scaler.scale(loss / N).backward() under autocast, then unscale_, clip, scaler.step."""

    scaled_under = ("fp16",)  # the precisions whose GradScaler is enabled

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup)
        self.device = torch.device(spec.device).type
        self.amp = AMP.get(spec.precision)
        self.scaler = torch.amp.GradScaler(self.device, init_scale=INIT_SCALE,
                                           enabled=spec.precision in self.scaled_under)
        self.n, self.losses, self.rows, self.logged = spec.accum_steps, [], 0, {}

    def micro_step(self, x, y, micro):
        with torch.autocast(self.device, dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
            loss = F.mse_loss(self.model(x), y)
        self.scaler.scale(loss if self.n == 1 else loss / self.n).backward()
        self.losses.append(loss.detach())
        self.rows += len(y)

    def grads(self):  # the unscaled gradient, as copies: the loop below unscales in place itself
        inv = 1.0 / self.scaler.get_scale()
        return {k: p.grad * inv for k, p in self.model.named_parameters() if p.grad is not None}

    def clip(self) -> float:
        """The boundary's unscale_ and clip; returns the pre-clip norm it logs."""
        self.scaler.unscale_(self.opt)
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM))

    def optimizer_step(self):
        norm = self.clip()
        lr = self.opt.param_groups[0]["lr"]
        scale = self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        if self.scaler.get_scale() >= scale:  # a step the scaler skipped does not advance the schedule
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        loss = torch.stack(self.losses).mean()
        self.logged = {"loss": float(loss), "grad_norm": norm, "clip_coef": min(1.0, MAX_NORM / (norm + 1e-6)),
                       "lr": lr, "rows": self.rows}
        self.losses, self.rows = [], 0
        return loss

    def metrics(self):
        return self.logged

    def loss_scale(self):
        return self.scaler.get_scale()  # 1.0 where the scaler is disabled

    def params(self):
        return dict(self.model.named_parameters())


def _total_norm(model) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


class NormBeforeUnscale(AmpTrainer):
    """Logs the norm of the gradient as it stands at the boundary, still loss-scaled, then unscales and clips right."""

    def clip(self):
        logged = _total_norm(self.model)
        super().clip()
        return logged


class ClipBeforeUnscale(AmpTrainer):
    """clip_grad_norm_ before unscale_ (what the AMP recipe warns against): clips the scaled gradient with
    max_norm / (S·‖g‖), logs S·‖g‖. Under AdamW the update barely moves: a uniform factor cancels."""

    def clip(self):
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM))
        self.scaler.unscale_(self.opt)
        return norm


class ClipCoefFromScaledNorm(AmpTrainer):
    """Reads the norm before unscale_, divides the logged norm by the scale by hand, but logs the clip
    coefficient from the scaled one (clipping itself is right)."""

    def clip(self):
        self._scaled = _total_norm(self.model)
        return super().clip()

    def optimizer_step(self):
        loss = super().optimizer_step()
        self.logged["clip_coef"] = min(1.0, MAX_NORM / (self._scaled + 1e-6))
        return loss


class ScaledUnderBf16(NormBeforeUnscale):
    """A GradScaler kept on under bf16 too (`enabled=use_amp`: harmless to the update, the scale cancels), and
    the norm logged before unscale_: ×1024 in bf16 only, where this trainer is declared."""

    scaled_under = ("bf16", "fp16")


METRICS = verify.Metrics(names=("loss", "grad_norm", "clip_coef", "lr", "rows"), max_norm=MAX_NORM)
_DATA = verify.data.regression(features=8)


def _adapter(cls, precisions=("fp32", "bf16", "fp16"), name=None):
    return verify.adapter(data=_DATA, precisions=precisions, metrics=METRICS, overflow=None,
                          name=name or f"broken: {cls.__name__}")(cls)


honest = _adapter(AmpTrainer, name="AmpTrainer (the AMP recipe: unscale_, clip, log the returned norm)")
norm_before_unscale = _adapter(NormBeforeUnscale)
clip_before_unscale = _adapter(ClipBeforeUnscale)
clip_coef_from_scaled_norm = _adapter(ClipCoefFromScaledNorm)
scaled_under_bf16 = _adapter(ScaledUnderBf16, precisions=("fp32", "bf16"))
