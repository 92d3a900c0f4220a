"""Trainers on a short last window (Case.last_window: a run that ends with fewer than N micro-batches, an epoch N
does not divide), declared `short_last_window=True`: each is told its windows up front (Spec.windows), as HF's
Trainer computes the last window from its dataloader. Two honest ones and the two bugs of such windows.

    own_count           correct: each micro-batch's mean loss ÷ its window's own micro-batch count, Spec.window(k),
                        before backward
    window_tokens       correct, token-weighted: Σ cross-entropy over valid targets per micro-step; after the window,
                        the gradient ÷ the window's valid-target count (dividing after the window, it needs no length)
    nominal_n           planted: ÷ accum_steps in every window — the short window's gradient is n/N of its big batch's
    positions_disagree  planted, token-weighted: each micro-step × 1/(N·B·S), the nominal window's positions, and
                        after the window × the positions it saw / its valid targets: the normalisation window and the
                        accumulation window disagree by n/N on a short window (the class of OpenRLHF PR #1337)

Tiny models: an MLP regressor (row mean) and embedding → tanh → linear over tokens (right-padded by the harness).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import verify

FEATURES, VOCAB, SEQ, D, IGNORE = 4, 12, 4, 8, -100


class OwnCount:
    """MSE (a row mean per micro-batch) ÷ this window's micro-batches: the window's mean over its rows."""

    def __init__(self, spec: verify.Spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(FEATURES, D), torch.nn.Tanh(), torch.nn.Linear(D, 1))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.spec, self.step, self.losses = spec, 0, []

    def divisor(self) -> int:
        return self.spec.window(self.step)  # known before the window's first micro-step

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x), y)
        (loss / self.divisor()).backward()
        self.losses.append(loss.detach())

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.losses, self.step = torch.stack(self.losses).mean(), [], self.step + 1
        return loss

    def params(self):
        return dict(self.model.named_parameters())


class NominalN(OwnCount):
    """Planted: ÷ N whatever the window holds."""

    def divisor(self) -> int:
        return self.spec.accum_steps


class WindowTokens:
    """Σ CE over valid targets; the window's gradient ÷ its valid-target count once, after its last micro-step. A
    window without a valid target is skipped whole (no step; the step loss NaN)."""

    def __init__(self, spec: verify.Spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, D), torch.nn.Tanh(), torch.nn.Linear(D, VOCAB))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.spec, self.num, self.count, self.positions, self.done = spec, 0.0, 0, 0, False

    def scale(self, y) -> float:
        return 1.0  # the sum travels as it is: the window's count divides it once

    def micro_step(self, x, y, micro):
        total = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        (total * self.scale(y)).backward()
        self.num, self.count = self.num + float(total.detach()), self.count + int((y != IGNORE).sum())
        self.positions += y.numel()

    def factor(self) -> float:
        return 1.0 / self.count

    def grads(self):
        if not self.done and self.count:
            for p in self.model.parameters():
                p.grad.mul_(self.factor())
        self.done = True
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.grads()
        if self.count:
            self.opt.step()
        self.opt.zero_grad()
        loss = self.num / self.count if self.count else float("nan")
        self.num, self.count, self.positions, self.done = 0.0, 0, 0, False
        return torch.tensor(loss, dtype=torch.float64)

    def params(self):
        return dict(self.model.named_parameters())


class PositionsDisagree(WindowTokens):
    """Planted: each micro-step ÷ the NOMINAL window's positions (N·B·S), the boundary × the positions it saw ÷ the
    valid targets — equal on a full window, n/N of the token mean on a short one."""

    def scale(self, y) -> float:
        return 1.0 / (self.spec.accum_steps * y.numel())

    def factor(self) -> float:
        return self.positions / self.count


ROWS = dict(data=verify.data.regression(features=FEATURES), short_last_window=True)
TOKENS = dict(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ), ignore_index=IGNORE, short_last_window=True)

own_count = verify.adapter(**ROWS)(OwnCount)
nominal_n = verify.adapter(**ROWS, name="broken: NominalN")(NominalN)
window_tokens = verify.adapter(**TOKENS)(WindowTokens)
positions_disagree = verify.adapter(**TOKENS, name="broken: PositionsDisagree")(PositionsDisagree)
