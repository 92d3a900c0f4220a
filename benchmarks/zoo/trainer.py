"""The zoo's trainer for one process, torch DDP (no_sync on micro-steps 0..N-2) and a hand-written boundary
all-reduce, even or uneven windows: the accumulation loop a user writes, with the choices of a Recipe.

Where the division happens (Recipe.divide):
    mean       each micro-step backwards its micro-batch's mean ÷ N (exact when every micro-batch holds the
               same units: rows); ranks average (DDP's ÷ W, or the all-reduce ÷ W)
    boundary   each micro-step backwards Σ; at micro-step N-1 the window's counts are all-reduced and the
               gradient divided once (DDP averaged it: × W / count). Several terms with different counts: each
               term's gradient in its own buffer, combined at the boundary, then one all-reduce
    optimizer  as boundary, but the division happens in optimizer_step() (grads_from="optimizer")
fp16 scales every backward with a GradScaler and unscales once per window; a window without a valid target is
no step at all (no optimizer, schedule or scaler update), its loss NaN.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.zoo import losses
from benchmarks.zoo.models import CLASSES, CNN, LM, MLP, OUTPUTS
from benchmarks.zoo.optim import optimizers, schedulers

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(r):
    if r.family in ("mlp", "cnn"):
        outputs = OUTPUTS if r.data == "regression" else CLASSES
        return MLP(outputs) if r.family == "mlp" else CNN(outputs)
    return LM(r.arch)


def compute_terms(r, model, x, y, terms):
    """{term: losses.Term} of one micro-batch, only the `terms` asked for."""
    if r.family in ("mlp", "cnn"):
        return losses.dense_terms(model, x, y, r.loss)
    if r.family == "lm":
        return losses.lm_terms(model, x, y, r.loss, causal=r.data == "causal_lm")
    if r.family == "moe":
        return losses.moe_terms(model, x, y, r.aux, terms)
    if r.family == "policy":
        return losses.policy_terms(model, x, y, r.loss, r.ids, terms)
    return losses.packed_terms(model, x, y, r.loss)


class Trainer:
    recipe = None  # set per zoo member (population.py)

    def __init__(self, spec):
        r = self.recipe
        torch.manual_seed(spec.seed)
        self.model = build_model(r).to(spec.device, spec.dtype)
        self.spec, self.k, self.group = spec, 0, spec.group
        self.n = spec.window(0)  # window k's micro-batches: accum_steps, fewer in a short last one (short_last_window)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(self.group) if self.distributed else 1
        self.ddp = DDP(self.model, process_group=self.group) if r.layout in ("ddp", "uneven_ddp") else None
        self.net = self.ddp or self.model
        self.terms = tuple(t for t in r.terms if spec.terms is None or t in spec.terms)
        self.window_terms = tuple(t for t in self.terms if t not in r.per_micro)
        self.device = torch.device(spec.device).type
        self.low = LOW.get(spec.precision)
        # fp16: a Σ backwarded before the division holds gradients up to ~10³ on the gates' largest batch (256
        # rows, measured over seeds 0-399), a mean under 1: start the scale where neither overflows fp16's 65504
        scale = 2.0**10 if r.divide == "mean" else 2.0**4
        self.scaler = torch.amp.GradScaler(self.device, init_scale=scale, enabled=spec.precision == "fp16")
        self.opts = optimizers(r.optimizer, self.model)
        self.scheds = schedulers(r.schedule, self.opts)
        self.max_norm = spec.options.clip if r.drawn_clip and spec.options is not None else r.clip
        self.params_list = list(self.model.parameters())
        self.logged = {}
        self.reset()

    def reset(self):
        self.sums = {t: 0.0 for t in self.terms}  # Σ numerators (detached), this rank's
        self.units = {t: 0.0 for t in self.terms}
        self.valid = self.rows = self.micro_done = 0
        self.buffers = None  # several terms: {term: [gradient per parameter]}
        self.unscaled = False
        self.stats = None  # the window's global sums after the boundary

    # -- the micro-step --------------------------------------------------------------------------------
    def micro_step(self, x, y, micro):
        last = micro == self.n - 1
        sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
        with sync:
            with torch.autocast(self.device, dtype=self.low or torch.bfloat16, enabled=self.low is not None):
                terms = compute_terms(self.recipe, self.net, x, y, self.terms)
            self.backward(terms)
        self.count(terms, y)
        self.micro_done += 1
        if last:
            self.boundary()

    def count(self, terms, y):
        for t, term in terms.items():
            self.sums[t] += float(term.num.detach())
            self.units[t] += term.units
        self.valid += int((y != losses.IGNORE).sum()) if self.recipe.token_weighted else y.numel()
        self.rows += y.shape[0]

    def backward(self, terms):
        r = self.recipe
        if r.divide == "mean":  # each micro-batch's mean, its share 1/N of the window's (N = 1: the plain step)
            loss = sum(term.num / term.units for term in terms.values())
            loss = loss / self.n if self.n > 1 else loss
            self.scaler.scale(loss).backward()
        elif len(terms) == 1 and not any(term.per_micro for term in terms.values()):
            self.scaler.scale(next(iter(terms.values())).num).backward()  # Σ: ÷ the window's count later
        else:  # several terms, each its own count: one gradient buffer per term, combined at the boundary
            self.buffers = self.buffers or {t: [None] * len(self.params_list) for t in self.terms}
            items = list(terms.items())
            for i, (t, term) in enumerate(items):
                num = term.num / (self.n * self.world) if term.per_micro else term.num
                grads = torch.autograd.grad(self.scaler.scale(num), self.params_list, allow_unused=True,
                                            retain_graph=i < len(items) - 1)
                self.buffers[t] = [b if g is None else g if b is None else b + g for b, g in zip(self.buffers[t], grads)]

    # -- the boundary: micro-step N-1 ------------------------------------------------------------------
    def all_reduce(self, t):
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def boundary(self):
        r = self.recipe
        stats = torch.tensor([*self.sums.values(), *self.units.values(), self.valid, self.rows], dtype=torch.float64,
                             device=self.params_list[0].device)
        self.stats = self.all_reduce(stats).tolist()  # the window's counts over every rank
        k = len(self.terms)
        self.global_sums = dict(zip(self.terms, self.stats[:k]))
        self.global_units = dict(zip(self.terms, self.stats[k:2 * k]))
        self.global_valid, self.global_rows = int(self.stats[-2]), int(self.stats[-1])
        if self.buffers is not None:
            self.combine()
        if self.ddp is None:
            self.reduce_grads(average=r.divide == "mean")
        if r.divide == "boundary" and self.buffers is None:
            self.divide()

    def combine(self):
        """.grad = Σ over terms of the term's gradient ÷ its window count (a per-micro term: as it is)."""
        for i, p in enumerate(self.params_list):
            total = None
            for t, bufs in self.buffers.items():
                g = bufs[i]
                if g is None:
                    continue
                if t not in self.recipe.per_micro:
                    g = g / max(self.global_units[t], 1.0)
                total = g if total is None else total + g
            p.grad = total if total is not None else torch.zeros_like(p)

    def reduce_grads(self, average: bool):
        """The hand-written boundary: one all-reduce of every gradient, flattened (÷ W for a mean of means)."""
        if self.world == 1:
            return
        for p in self.params_list:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.flatten() for p in self.params_list])
        dist.all_reduce(flat, group=self.group)
        if average:
            flat /= self.world
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in self.params_list])

    def divide(self):
        """Σ → the window's mean: ÷ its count (DDP already averaged over ranks: × W first)."""
        count = self.global_units[self.terms[0]]
        if not count:
            return
        for p in self.params_list:
            if p.grad is None:
                continue
            if self.ddp is not None:
                p.grad.mul_(self.world / count)
            else:
                p.grad.div_(count)

    @property
    def stepping(self) -> bool:
        """A window without a valid target is no step (its token mean has no value)."""
        token_terms = [t for t in self.window_terms if t != "aux"]
        return self.global_valid > 0 or not (self.recipe.token_weighted and token_terms)

    # -- the protocol's other methods ------------------------------------------------------------------
    def unscale(self):
        if self.scaler.is_enabled() and not self.unscaled and self.stepping:
            for opt in self.opts:
                self.scaler.unscale_(opt)
        self.unscaled = True

    def grads(self):
        self.unscale()
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        r = self.recipe
        self.logged = {}  # an empty window logs nothing: no step was taken
        self.unscale()
        if r.divide == "optimizer":  # the division this trainer makes here, just before stepping
            self.divide()
        loss = float("nan")
        if self.stepping:
            norm = self.clip_or_norm()
            lr = self.opts[0].param_groups[0]["lr"]  # the LR this step applies (before the schedule moves it)
            for opt in self.opts:
                self.scaler.step(opt)
            self.scaler.update()
            for s in self.scheds:
                s.step()
            loss = self.window_loss()
            self.log(loss, norm, lr)
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        self.reset()
        self.k += 1
        self.n = self.spec.window(self.k)
        return loss

    def clip_or_norm(self):
        params = [p for p in self.params_list if p.grad is not None]
        if self.max_norm is not None:
            return float(torch.nn.utils.clip_grad_norm_(params, self.max_norm))  # the norm before clipping
        return float(torch.nn.utils.get_total_norm([p.grad for p in params])) if self.recipe.metrics else 0.0

    def window_loss(self) -> float:
        """The window's loss: each window term's Σ over every rank ÷ its count, plus the per-micro terms' mean."""
        out = 0.0
        for t in self.terms:
            s = self.global_sums[t]
            out += s / (self.n * self.world) if t in self.recipe.per_micro else s / max(self.global_units[t], 1.0)
        return out

    def log(self, loss, norm, lr):
        self.logged = {"loss": loss, "grad_norm": norm, "lr": lr, "rows": self.global_rows,
                       "tokens": self.global_valid}
        if self.max_norm is not None:
            self.logged["clip_coef"] = min(1.0, self.max_norm / (norm + 1e-6))

    def metrics(self):
        return {k: v for k, v in self.logged.items() if k in self.recipe.metrics}

    def params(self):
        return dict(self.model.named_parameters())


class Plain(Trainer):
    """The loop without accumulation, as written before accumulation was added: one batch, its mean, backward,
    step. accum_steps = 1 of the trainer must be this, bit for bit (declared as plain=)."""

    def micro_step(self, x, y, micro):
        with torch.autocast(self.device, dtype=self.low or torch.bfloat16, enabled=self.low is not None):
            terms = compute_terms(self.recipe, self.net, x, y, self.terms)
        loss = sum(term.num / term.units for term in terms.values())
        self.scaler.scale(loss).backward()
        self.count(terms, y)
        self.boundary()


class PartialSums:
    """partial_grads(), offered by the trainers whose recipe says so (the partial-sum gate runs where it exists)."""

    def partial_grads(self):
        """What grads() would return if the window ended after the micro-steps so far (one process, one term):
        .grad × N / n for a mean per micro-step, Σ ÷ the count so far for a sum; ÷ the loss scale under fp16."""
        scale = self.scaler.get_scale() if self.scaler.is_enabled() and not self.unscaled else 1.0
        count = self.units[self.terms[0]]
        out = {}
        for k, p in self.model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if self.stats is None and self.recipe.divide == "mean":
                g = g * (self.n / self.micro_done)
            elif self.stats is None and count:
                g = g / count
            out[k] = g / scale
        return out


class LossScale:
    """loss_scale(): the GradScaler's scale, offered by the fp16 trainers (the overflow gate checks it)."""

    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
