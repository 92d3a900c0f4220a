"""Honest trainers that normalise AND clip inside optimizer_step() (grads_from="optimizer"): what the harness reads
as the optimizer's step begins is the post-clip gradient (verify/_internal/atstep.py; issue 42, the zoo's classes
C, G, H, I). A token-weighted LM backwards Σ CE per micro-step; optimizer_step() unscales (fp16), divides by the
window's valid count, clips at `spec.options` (the max norm; None: no clipping), steps and logs.

    declared        options drawn, unclipped= and Metrics(max_norm=) declared: every check can see the pre-clip gradient
    undeclared      always clips at CLIP, nothing about clipping declared (no options, no unclipped=, no metrics)
    reporting       undeclared, but logs grad_norm with Metrics() and no max_norm: the norm is judged at the step
    overflowing     not clipped, fp16: a per-target penalty softplus(s) taken in fp16, whose gradient Σ over the
                    targets of scale × sigmoid(s) = 4096 each fits one micro-batch of 12 (4.9e4) but not the big
                    batch of 36 (1.5e5 > 65504): the big batch's GradScaler skips its step 0, the micro-batches' not
"""
import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import verify

IGNORE, VOCAB, SEQ = -100, 11, 6
CLIP = 0.05  # below every drawn window's norm (≈ 0.3 at init): clipping acts wherever it is on


class ClippedStep:
    scale = 2.0 ** 13

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))
        net.register_parameter("s", torch.nn.Parameter(torch.zeros(())))  # a per-target penalty's offset
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.max_norm = self.clip_of(spec.options)
        self.device, self.fp16 = torch.device(spec.device).type, spec.precision == "fp16"
        self.scaler = torch.amp.GradScaler(self.device, init_scale=self.scale, enabled=self.fp16)
        self.count, self.num, self.logged = 0, 0.0, {}

    def clip_of(self, options):
        return options

    def micro_step(self, x, y, micro):
        with torch.autocast(self.device, dtype=torch.float16, enabled=self.fp16):
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        s = self.model.s.half() if self.fp16 else self.model.s  # its gradient summed over the targets in fp16
        loss = loss + (F.softplus(s.expand(y.shape)) * (y != IGNORE)).sum()
        self.scaler.scale(loss).backward()
        self.count, self.num = self.count + int((y != IGNORE).sum()), self.num + float(loss.detach().double())

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        n, self.logged = self.count, {}
        if n:
            self.scaler.unscale_(self.opt)
            for p in self.model.parameters():  # the token mean, where many loops take it: just before the step
                p.grad.div_(n)
            norm = self.norm()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.logged = self.log(norm, n)
        self.opt.zero_grad(set_to_none=True)
        loss, self.count, self.num = self.num / n if n else math.nan, 0, 0.0
        if n:
            self.logged["loss"] = loss
        return loss

    def norm(self) -> float:
        params = list(self.model.parameters())
        if self.max_norm is None:
            return float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        return float(torch.nn.utils.clip_grad_norm_(params, self.max_norm))  # the norm before clipping

    def log(self, norm: float, n: int) -> dict:
        coef = 1.0 if self.max_norm is None else min(1.0, self.max_norm / (norm + 1e-6))
        return {"grad_norm": norm, "clip_coef": coef, "tokens": n}

    def metrics(self):
        return dict(self.logged)

    def params(self):
        return dict(self.model.named_parameters())


class AlwaysClipped(ClippedStep):
    def clip_of(self, options):
        return CLIP


class Unclipped(ClippedStep):
    def clip_of(self, options):
        return None


def no_clip(options):
    return None


def max_norm(options):
    return options


DATA = verify.data.tokens(vocab=VOCAB, seq_len=SEQ)
COMMON = dict(data=DATA, ignore_index=IGNORE, grads_from="optimizer")
METRICS = verify.Metrics(names=("loss", "grad_norm", "clip_coef", "tokens"), max_norm=max_norm)
declared = verify.adapter(**COMMON, options=st.sampled_from([None, CLIP]), defaults=CLIP, unclipped=no_clip,
                          metrics=METRICS, name="clipped at the step, declared")(ClippedStep)
undeclared = verify.adapter(**COMMON, name="clipped at the step, undeclared")(AlwaysClipped)
reporting = verify.adapter(**COMMON, metrics=verify.Metrics(names=("loss", "grad_norm", "tokens")),
                           name="clipped at the step, reporting its norm")(AlwaysClipped)
unclipped_reporting = verify.adapter(**COMMON, metrics=verify.Metrics(names=("loss", "grad_norm", "tokens")),
                                     name="normalised at the step, not clipped, reporting its norm")(Unclipped)
overflowing = verify.adapter(**COMMON, precisions=("fp32", "fp16"), name="fp16 Σ at the step")(Unclipped)
