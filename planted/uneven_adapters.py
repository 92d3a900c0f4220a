"""Trainers on uneven windows (Case.rank_rows: ranks hold different rows and micro-steps per window, as
token-budget batching gives them), declared `uneven=True`, and the two bugs of such windows.

    global_count        correct: Σ loss over the rank's targets; at its own last micro-step the rank all-reduces
                        the gradient sum with its count riding along, and divides by the GLOBAL count
    equal_rank_weights  each rank divides by its OWN count, then the ranks are averaged (÷ W, as DDP does): right
                        only when every rank holds the same rows (trl PR #6713)
    lighter_rank_skips  the boundary reduction runs only on the last of SEVERAL micro-steps: a rank holding one
                        micro-step never reduces, and the other ranks wait in theirs (EasyR1 PR #11012)

A tiny token model (embedding → linear head, AdamW); every target is valid, so the loss is a row mean (each
row holds SEQ targets): the count is rows × SEQ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from planted.template import ModelState

VOCAB, SEQ, D = 12, 4, 8


class GlobalCount(ModelState):
    """Σ cross-entropy in every micro-step; the boundary (this rank's micro-step N_r - 1) all-reduces [Σ grads,
    Σ loss, count] once and divides by the global count: the mean over every rank's targets."""

    def __init__(self, spec: verify.Spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, D), torch.nn.Tanh(), torch.nn.Linear(D, VOCAB))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.n, self.count, self.num = spec.accum_steps, 0, 0.0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def micro_step(self, x, y, micro):
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), reduction="sum")
        loss.backward()
        self.num = self.num + float(loss.detach())
        self.count += y.numel()
        if self.syncs(micro):
            self.reduce()

    def syncs(self, micro) -> bool:
        return micro == self.n - 1

    def reduce(self):
        ps = list(self.model.parameters())
        flat = torch.cat([p.grad.flatten() for p in ps] + [ps[0].grad.new_tensor([self.num, self.count])])
        self.local(flat)
        if self.world > 1:
            dist.all_reduce(flat)
        self.divide(flat)
        torch.nn.utils.vector_to_parameters(flat[:-2], [p.grad for p in ps])
        self.num = float(flat[-2])

    def local(self, flat):
        pass  # nothing before the reduction: sums travel, the count with them

    def divide(self, flat):
        flat[:-1] /= flat[-1]  # the global count: every rank's targets

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.count, self.num = self.num, 0, 0.0
        return loss


class EqualRankWeights(GlobalCount):
    """Planted (trl PR #6713): each rank's mean over its own targets, then the ranks averaged equally."""

    def local(self, flat):
        flat[:-2] /= self.count  # its own mean (its own count) ...

    def divide(self, flat):
        flat[:-2] /= self.world  # ... then ÷ W: DDP's average of the per-rank means
        flat[-2] /= flat[-1]


class LighterRankSkips(GlobalCount):
    """Planted (EasyR1 PR #11012): syncs on the last of several micro-steps only; one micro-step is never synced."""

    def syncs(self, micro) -> bool:
        return 0 < micro == self.n - 1


def _adapter(cls):
    return verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ), data_parallel=True, uneven=True)(cls)


global_count = _adapter(GlobalCount)
equal_rank_weights = _adapter(EqualRankWeights)
lighter_rank_skips = _adapter(LighterRankSkips)
