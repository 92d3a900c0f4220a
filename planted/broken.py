"""Deliberately broken trainers. Each reproduces a bug users hit; the gates must reject every one.

They subclass xtrain's AccumTrainer and change one thing, one hook of the micro-step template
(template.py), so a rejection can only be caused by that one thing. Each is an adapter (xtrain's data and options, this factory) at module level, so rank pools
can import it by name.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from xtrain_core.model import GPT
from xtrain_core.trainer import AccumTrainer

from xtrain_proof import adapters as xtrain
from planted.template import Planted


class MissingScale(AccumTrainer):
    """Backward of the raw micro loss: the boundary gradient is N× the big-batch mean."""

    def _objective(self, forward_mean, *a, **k):
        raw = []  # the trainer's bookkeeping as usual; what it backwards is the raw loss its forward returned
        super()._objective(lambda idx, targets: raw.append(forward_mean(idx, targets)) or raw[-1], *a, **k)
        return raw[0]


class ZeroGradInLoop(Planted, AccumTrainer):
    """zero_grad at the start of every micro-step: only the last micro-batch survives."""

    def before(self, idx, targets, micro):
        self.opt.zero_grad(set_to_none=True)


class StepEveryMicro(Planted, AccumTrainer):
    """optimizer.step() (and zero_grad) after every micro-step: N updates per 'step'."""

    def between(self, micro):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class SchedulerEveryMicro(Planted, AccumTrainer):
    """LR scheduler stepped per micro-step: warm-up runs N× too fast."""

    def between(self, micro):
        with warnings.catch_warnings():  # torch warns when sched.step() precedes opt.step(): that's the bug
            warnings.simplefilter("ignore", UserWarning)
            self.sched.step()


class N1OtherReduction(AccumTrainer):
    """N == 1 path that reduces differently: backward of the SUM over the B·S rows, the gradient divided
    by B·S at the boundary (the token-weighted recipe). Equal in exact arithmetic; in floating point the
    division happens after the backward instead of inside it, so gradients round differently whenever
    B·S is not a power of two. (Its own micro-step: at N == 1 it is a different reduction, not a hook.)"""

    def micro_step(self, idx, targets, micro):
        if self.accum_steps != 1:
            return super().micro_step(idx, targets, micro)
        logits = self.model(idx)  # (B, S, V)
        total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
        total.backward()
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(targets.numel())
        self._raw_sum = total.detach() / targets.numel()
        self._next_micro = 1


class N1ScaledByOne(AccumTrainer):
    """Always multiplies by 1/N, even at N == 1 (x * 1.0 is bit-exact: this one must PASS)."""

    def _backward(self, objective):
        super()._backward(objective * (1.0 / self.accum_steps) if self.accum_steps == 1 else objective)


class WritesIntoTargets(Planted, AccumTrainer):
    """Masks the first target of every sequence IN PLACE (`targets[:, 0] = -100`, "skip the BOS token")
    before its loss. Whoever reads that batch next sees the edit: before the harness handed each call its
    own copy, the plain reference read the edited storage too, and the bit-exact gate passed."""

    def before(self, idx, targets, micro):
        targets[:, 0] = -100


def _adapter(cls):  # fp32: these bugs are about accumulation arithmetic, and override the scaled backward
    return xtrain.variant(cls, xtrain.single.replace(precisions=("fp32",)))


missing_1_over_N = _adapter(MissingScale)
zero_grad_in_micro_loop = _adapter(ZeroGradInLoop)
optimizer_step_every_micro = _adapter(StepEveryMicro)
scheduler_step_every_micro = _adapter(SchedulerEveryMicro)
n1_different_reduction = _adapter(N1OtherReduction)
writes_into_targets = _adapter(WritesIntoTargets)
scaled_by_one = _adapter(N1ScaledByOne)


def make_drawn_in_spec_dtype(spec):
    """The model drawn in Spec.dtype (built under that default dtype, as `Model(dtype=...)` builds one): the float64
    reference starts from other numbers than the float32 runs, so every bound measured against it is O(1) — and the
    1/N scale is missing (MissingScale), which that bound admitted (torchtitan's recipe before 5d79fc6)."""
    o = xtrain.options_of(spec)
    before = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        torch.set_default_dtype(spec.dtype)
        try:
            model = GPT(o.model)
        finally:
            torch.set_default_dtype(before)
    return MissingScale(model.to(spec.device), o.optim, spec.accum_steps, **xtrain.numerics(spec))


drawn_in_spec_dtype = missing_1_over_N.replace(factory=make_drawn_in_spec_dtype, name="broken: drawn in Spec.dtype, ×N")


class Tripled:
    """Mixin of xtrain's trainers: 3× the loss, accumulation right, the objective another one."""

    def _objective(self, forward_mean, forward_sum, *a, **k):
        def mean(idx, targets):
            return 3 * forward_mean(idx, targets)

        def total(idx, targets):
            s, count = forward_sum(idx, targets)
            return 3 * s, count
        return super()._objective(mean, total, *a, **k)


class TripledObjective(Tripled, AccumTrainer):
    pass


def make_other_reference(spec):
    """Same weights, another computation in float64 (as a float64 path a stack takes where its engine refuses
    float64: DeepSpeed Muon's grads() at ZeRO-2 read the update): the float64 runs agree with each other, so only the
    big batch's own error, O(1), shows it; the float32 runs carry ×N (MissingScale), which that bound admitted."""
    cls = TripledObjective if spec.dtype == torch.float64 else MissingScale
    return cls(xtrain.model_for(spec), xtrain.options_of(spec).optim, spec.accum_steps, **xtrain.numerics(spec))


other_reference = missing_1_over_N.replace(factory=make_other_reference, name="broken: float64 of another objective, ×N")
# Which gate must reject each, and on what case: planted.py (scaled_by_one is a control: it must pass).


# -- memory bugs: numerically correct (they pass the equivalence gates), caught by verify.memory ----------

class LeakyGraph(AccumTrainer):
    """Keeps every micro-step's autograd graph alive until the boundary: backward(retain_graph=True) and
    the loss stored in a list (the `losses.append(loss)` + retain_graph pattern). Gradients are right;
    the activations of all N micro-batches stay resident, so peak grows with N like a big batch."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._kept = []

    def _backward(self, objective):
        objective.backward(retain_graph=True)
        self._kept.append(objective)

    def optimizer_step(self):
        out = super().optimizer_step()
        self._kept.clear()
        return out


leaky_graph = _adapter(LeakyGraph)

# name -> adapter: the names `verify.memory --trainer NAME` accepts (it must exit 1 on each; planted.py).
MEMORY_BROKEN = {"leaky_graph": leaky_graph}
