"""Planted bugs of trainers that normalise and clip inside optimizer_step() (grads_from="optimizer", issue 42: the
zoo's classes G and H), on tests/helpers/clipped_step.py's honest token-weighted LM. What the harness reads there
is the post-clip gradient, so each bug is one that clipping hides from that view:

    norm_before_division  grad_norm logged from the window's Σ, before optimizer_step() divides it (× the count)
    norm_of_last_micro    grad_norm of the last micro-step's own gradient (÷ its own count), not the window's
    micro_count           the window's Σ divided by its last micro-batch's valid count (≈ ×N): clipped, its updates
                          are the honest ones; only the pre-clip gradient (unclipped=) shows it
    grad_all_positions    not clipped, nothing declared: .grad ÷ every target position (padding included), the loss
                          ÷ the valid ones; its big batch does the same, so only the normaliser's gradients see it
"""
import torch

import verify
from tests.helpers.clipped_step import COMMON, METRICS, AlwaysClipped, ClippedStep, Unclipped, no_clip
from hypothesis import strategies as st


class NormBeforeDivision(ClippedStep):
    def norm(self) -> float:
        before = float(torch.nn.utils.get_total_norm([p.grad * self.count for p in self.model.parameters()]))
        super().norm()
        return before


class NormOfLastMicro(AlwaysClipped):
    def micro_step(self, x, y, micro):
        before = [None if p.grad is None else p.grad.clone() for p in self.model.parameters()]
        n = self.count
        super().micro_step(x, y, micro)
        own = [p.grad - (0 if b is None else b) for p, b in zip(self.model.parameters(), before)]
        self.last_norm = float(torch.nn.utils.get_total_norm(own)) / max(self.count - n, 1)

    def norm(self) -> float:
        super().norm()
        return self.last_norm


class MicroCount(ClippedStep):
    def micro_step(self, x, y, micro):
        super().micro_step(x, y, micro)
        self.last_count = int((y != -100).sum())

    def optimizer_step(self):
        if self.count:
            for p in self.model.parameters():  # divided below by the window's count: × count / last_count
                p.grad.mul_(self.count / max(self.last_count, 1))
        return super().optimizer_step()


class GradAllPositions(Unclipped):
    def micro_step(self, x, y, micro):
        super().micro_step(x, y, micro)
        self.positions = getattr(self, "positions", 0) + y.numel()

    def optimizer_step(self):
        if self.count:
            for p in self.model.parameters():  # divided below by the valid count: × valid / positions
                p.grad.mul_(self.count / self.positions)
        self.positions = 0
        return super().optimizer_step()


def _declared(cls, what):
    return verify.adapter(**COMMON, options=st.sampled_from([None, 0.05]), defaults=0.05, unclipped=no_clip,
                          metrics=METRICS, name=f"broken step-normalised LM ({what})")(cls)


norm_before_division = _declared(NormBeforeDivision, "grad_norm before the division")
norm_of_last_micro = verify.adapter(**COMMON, metrics=verify.Metrics(names=("loss", "grad_norm", "tokens")),
                                    name="broken step-normalised LM (grad_norm of the last micro-step)")(NormOfLastMicro)
micro_count = _declared(MicroCount, "÷ the last micro-batch's count")
grad_all_positions = verify.adapter(**COMMON, name="broken step-normalised LM (.grad ÷ every position)")(GradAllPositions)
