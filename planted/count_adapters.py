"""Token-weighted trainers that reduce the window's valid-token count on EVERY micro-step, as real
frameworks do: torchtitan all-reduces the count, HF Transformers all_gathers `num_items_in_batch`. The
traffic is integer, tiny and correct; declared with `Expected(...)`, such a trainer must pass every gate
(boundary-only, data-parallel equivalence, bytes per step independent of N, split invariance).

    counted / gathered          declared: pass every gate at every world
    undeclared                  the same traffic, not declared: boundary-only rejects it
    declared_at_world_1_only    declared with Expected(world=1): it excuses nothing at W=2
    logs_each_micro_loss        N scalar all-reduces at the boundary: bytes per step grow with N
    logs_declared               the same, declared as its row's side traffic (sized): passes

Each micro-step backwards the SUM of cross-entropy over its valid targets; the boundary (the end of
micro-step N-1) all-reduces the summed gradients with the loss numerator riding along, then divides by
the global count reduced along the way: the window's token mean, over every micro-step and rank.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from planted.template import ModelState

IGNORE, VOCAB = -100, 11


class CountReducing(ModelState):
    gather = False  # HF style: all_gather the per-rank counts and sum them, instead of one all_reduce

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.n, self.count, self.num = spec.accum_steps, 0, 0.0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def _global_count(self, y) -> int:
        n = (y != IGNORE).sum().reshape(1)  # int64: "metadata" to the counter, never gradient bytes
        if not dist.is_initialized():
            return int(n)
        if self.gather:
            ns = [torch.zeros_like(n) for _ in range(self.world)]
            dist.all_gather(ns, n)
            return int(sum(ns))
        dist.all_reduce(n)
        return int(n)

    def micro_step(self, x, y, micro):
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        loss.backward()
        self.num = self.num + loss.detach()
        self.count += self._global_count(y)
        if micro == self.n - 1:  # the boundary: Σ gradients and Σ loss of every rank, once; then / count
            ps = list(self.model.parameters())
            flat = torch.cat([p.grad.flatten() for p in ps] + [self.num.reshape(1)])
            if self.world > 1:
                dist.all_reduce(flat)
            flat /= max(self.count, 1)
            torch.nn.utils.vector_to_parameters(flat[:-1], [p.grad for p in ps])
            self.num = flat[-1] if self.count else torch.full_like(flat[-1], float("nan"))

    def optimizer_step(self):
        if self.count:  # a window without a valid target leaves the parameters (and AdamW's state) alone
            self.opt.step()
        self.opt.zero_grad()
        loss, self.count, self.num = self.num, 0, 0.0
        return loss


class Gathering(CountReducing):
    gather = True


class LogsEachMicroLoss(CountReducing):
    """Planted: all-reduces each micro-step's loss for logging, one float at a time, at the boundary: N
    side-channel scalars pass boundary-only (≤ SCALARS), but the boundary's traffic grows with N."""

    def micro_step(self, x, y, micro):
        super().micro_step(x, y, micro)
        if micro == self.n - 1 and self.world > 1:
            for _ in range(self.n):
                dist.all_reduce(torch.zeros(1, dtype=self.num.dtype))


COUNT = "the window's valid-token count, reduced on every micro-step (torchtitan)"
GATHER = "the ranks' valid-token counts, gathered on every micro-step (HF num_items_in_batch)"
_common = dict(data=verify.data.tokens(vocab=VOCAB, seq_len=5), data_parallel=True, ignore_index=IGNORE)

counted = verify.adapter(**_common, expected=(verify.Expected("all_reduce", dtype="integer", why=COUNT),))(
    CountReducing)
gathered = verify.adapter(**_common, expected=(verify.Expected("all_gather", dtype="integer", why=GATHER),))(
    Gathering)
undeclared = verify.adapter(**_common)(CountReducing)
declared_at_world_1_only = verify.adapter(
    **_common, expected=(verify.Expected("all_reduce", dtype="integer", world=1, why=COUNT),))(CountReducing)
logs_each_micro_loss = verify.adapter(**_common, expected=counted.expected)(LogsEachMicroLoss)


def _logged_row(case):
    """The gradient and the loss numerator once, plus N one-float logging all-reduces declared as side traffic."""
    grads = VOCAB * 8 + 8 * VOCAB + VOCAB + 1
    logs = verify.Expected("all_reduce", count=case.accum_steps, dtype="floating", numel=1, why="each micro loss logged")
    return verify.CountRow("logs each micro loss", before={}, boundary=None, elements=(grads, grads), carriers=None,
                           side=(logs,))


logs_declared = verify.adapter(**_common, expected=counted.expected, counts=_logged_row)(LogsEachMicroLoss)
