"""Trainers for the re-run diagnosis (verify/_internal/gates/rerun.py) and the grads_from="optimizer" mode.

    accelerate_undeclared    examples/accelerate_accumulate.py's correct trainer WITHOUT scheduler_per_rank:
                             its prepared scheduler steps once per rank, so it fails at W=2 from step 1
    normalise_in_step        a token-weighted DP LM: backwards Σ loss, the boundary all-reduces and ÷ W (as DDP
                             does), and optimizer_step() × W / the window's token count just before opt.step():
                             its updates are the big batch's, its grads() is read before that division
    normalise_in_step_declared  the same, declared grads_from="optimizer": the harness reads what AdamW steps with
    normalise_in_step_reporting the declared one with metrics() (the window's loss and tokens); and its twin
                             reporting the last micro-step's tokens (the metrics gate must still see and judge both)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from planted import calib_adapters as calib

IGNORE, VOCAB = -100, 11


def __getattr__(name):  # accelerate_undeclared imports Accelerate (seconds): built when first asked for
    if name != "accelerate_undeclared":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from examples.accelerate_accumulate import Trainer

    adapter = verify.adapter(data=verify.data.regression(features=8), data_parallel=True,
                             expected=verify.DDP_EXPECTED + verify.DDP_WORLD1_EXPECTED)(Trainer)
    globals()[name] = adapter
    return adapter


class NormaliseInStep:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.0)
        self.n, self.count, self.num = spec.accum_steps, 0, 0.0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def micro_step(self, x, y, micro):
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        loss.backward()
        self.num, self.count = self.num + loss.detach(), self.count + int((y != IGNORE).sum())
        if micro == self.n - 1 and self.world > 1:  # the boundary: one all-reduce, averaged over ranks as DDP does
            ps = list(self.model.parameters())
            flat = torch.cat([p.grad.flatten() for p in ps] + [self.num.reshape(1)])
            dist.all_reduce(flat)
            flat /= self.world
            torch.nn.utils.vector_to_parameters(flat[:-1], [p.grad for p in ps])
            self.num = flat[-1] * self.world

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        count = torch.tensor([self.count])
        if self.world > 1:
            dist.all_reduce(count)  # integer: the window's valid-target count over every rank
        n = int(count)
        for p in self.model.parameters():  # the token mean, where many loops take it: just before the step
            p.grad.mul_(self.world / n)
        self.opt.step()
        self.opt.zero_grad()
        loss, self.count, self.num = self.num / n, 0, 0.0
        return loss

    def params(self):
        return dict(self.model.named_parameters())


_common = dict(data=verify.data.tokens(vocab=VOCAB, seq_len=5), data_parallel=True, ignore_index=IGNORE,
               empty_windows=False)
normalise_in_step = verify.adapter(**_common)(NormaliseInStep)
normalise_in_step_declared = verify.adapter(**_common, grads_from="optimizer")(NormaliseInStep)


class NormaliseInStepReporting(NormaliseInStep):
    """Logs the step's loss and the window's valid targets (metrics()): behind grads_from="optimizer" too."""

    last_only = False

    def micro_step(self, x, y, micro):
        self.last = int((y != IGNORE).sum())
        super().micro_step(x, y, micro)

    def optimizer_step(self):
        count = self.last if self.last_only else self.count * self.world
        loss = super().optimizer_step()
        self.logged = {"loss": float(loss), "tokens": count}
        return loss

    def metrics(self):
        return self.logged


class ReportsLastMicroTokens(NormaliseInStepReporting):
    last_only = True


_reporting = dict(_common, grads_from="optimizer", metrics=verify.Metrics(names=("loss", "tokens")))
normalise_in_step_reporting = verify.adapter(**_reporting)(NormaliseInStepReporting)
reports_last_micro_tokens = verify.adapter(**_reporting)(ReportsLastMicroTokens)


# -- one bug class each, on calib_adapters' textbook MLP (the diagnosis of each class is tested) -------------
class OverNTwice(calib.Trainer):
    def scale(self, loss):
        return loss / self.n / self.n


class NoOverW(calib.Trainer):
    def micro_step(self, x, y, micro):
        self.world, w = 1, self.world  # the boundary's reduction without its ÷ W: a sum over ranks
        try:
            super().micro_step(x, y, micro)
        finally:
            self.world = w
        if micro == self.n - 1 and w > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad)


class ClipPerMicro(calib.Trainer):
    """Clips every micro-step's gradient (spec.options: the max norm; None: no clipping)."""

    def micro_step(self, x, y, micro):
        super().micro_step(x, y, micro)
        if self.spec.options:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.options)


def no_clipping(options):
    return None


_reg = verify.data.regression(features=calib.FEATURES)
over_n_twice = verify.adapter(data=_reg)(OverNTwice)
no_over_w = verify.adapter(data=_reg, data_parallel=True)(NoOverW)
clip_per_micro = verify.adapter(data=_reg, unclipped=no_clipping)(ClipPerMicro)
