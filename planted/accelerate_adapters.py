"""Accelerate trainers whose prepared LR scheduler steps once per RANK per optimizer step (Accelerate:
num_processes times per step() call, split_batches=False), for the per-rank scheduler's diagnosis (issue 42,
item 7). examples/accelerate_accumulate.py is the declared, correct recipe of the fixed-length loss.

    fixed_undeclared    the recipe without scheduler_per_rank: fails at W ≥ 2 from step 1
    micro_scheduler_undeclared  the same with the scheduler stepped in every micro-step, inside accumulate()
    tokens_declared     a token-weighted Accelerate LM, declared: passes every gate (the control)
    tokens_undeclared   the same without scheduler_per_rank: fails at W ≥ 2 from step 1

The token-weighted trainer sees one micro-batch per micro-step: it backwards each micro-batch's SUM of
cross-entropy (accelerator.backward divides it by N, DDP averages over the W ranks) and, at the boundary,
multiplies the synced gradient by N·W / the window's valid-target count, reduced once, at the boundary.
"""
import torch
import torch.nn.functional as F
from accelerate import Accelerator

import verify
from examples.accelerate_accumulate import METRICS, Trainer as Recipe, warmup

IGNORE, VOCAB = -100, 11


class FixedTrainer(Recipe):
    """examples/accelerate_accumulate.py's trainer, as is (defined here: the adapter below is its module's name)."""


class MicroScheduler(Recipe):
    """The recipe with the scheduler stepped inside accumulate() on every micro-step, as Accelerate's examples do:
    the prepared scheduler advances only where gradients sync (num_processes times), before the optimizer's step."""

    def micro_step(self, x, y, micro):
        if micro == 0:
            self.losses = []
        with self.acc.accumulate(self.model):
            loss = F.mse_loss(self.model(x), y)
            self.acc.backward(loss)
            for _ in range(self.scheduler_calls):
                self.sched.step()
        self.losses.append(loss.detach())

    def optimizer_step(self):
        calls, self.scheduler_calls = self.scheduler_calls, 0  # stepped in the micro-steps already
        try:
            return super().optimizer_step()
        finally:
            self.scheduler_calls = calls


class TokenTrainer:
    def __init__(self, spec):
        self.acc = Accelerator(gradient_accumulation_steps=spec.accum_steps, cpu=spec.device == "cpu")
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))
        opt = torch.optim.AdamW(net.to(spec.dtype).parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        self.model, self.opt, self.sched = self.acc.prepare(net, opt, sched)
        self.scheduler_calls, self.n = spec.scheduler_calls, spec.accum_steps
        self.count, self.num = 0, 0.0

    def micro_step(self, x, y, micro):
        with self.acc.accumulate(self.model):
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
            self.acc.backward(loss)  # ÷ N inside accelerate (N > 1); DDP's mean over ranks at the boundary
        self.num, self.count = self.num + loss.detach().double(), self.count + int((y != IGNORE).sum())
        if micro == self.n - 1:  # the boundary: the window's count and loss over every rank, one all-reduce
            total = self.acc.reduce(torch.stack([torch.tensor(float(self.count), dtype=torch.float64), self.num]),
                                    "sum")
            self.count, self.num = int(total[0]), total[1]
            scale = self.n * self.acc.num_processes / max(self.count, 1)
            for p in self.model.parameters():
                p.grad.mul_(scale)

    def grads(self):
        return {name: p.grad for name, p in self.acc.unwrap_model(self.model).named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        for _ in range(self.scheduler_calls):  # each call: num_processes scheduler steps
            self.sched.step()
        self.opt.zero_grad()
        loss, self.count, self.num = self.num / self.count, 0, 0.0
        return loss

    def params(self):
        return dict(self.acc.unwrap_model(self.model).named_parameters())


_EXPECTED = verify.DDP_EXPECTED + verify.DDP_WORLD1_EXPECTED  # as the recipe: DDP under Accelerate
_tokens = dict(data=verify.data.tokens(vocab=VOCAB, seq_len=5), ignore_index=IGNORE, data_parallel=True,
               expected=_EXPECTED, empty_windows=False)  # AdamW would move on an empty window
fixed_undeclared = verify.adapter(data=verify.data.regression(features=8), data_parallel=True,
                                  expected=_EXPECTED, metrics=METRICS)(FixedTrainer)
micro_scheduler_undeclared = verify.adapter(data=verify.data.regression(features=8), data_parallel=True,
                                            expected=_EXPECTED)(MicroScheduler)
tokens_declared = verify.adapter(**_tokens, scheduler_per_rank=True)(TokenTrainer)
tokens_undeclared = verify.adapter(**_tokens)(TokenTrainer)
