"""Fault operators: each wraps ANY trainer behind the protocol and plants one accumulation bug, without
knowing the trainer's internals. A wrapper only uses what the harness itself may: the four methods,
the Spec it hands the factory (so it can build the inner trainer with another accum_steps), the
batches, the tensors grads() returns, and torch.distributed.

    drop_micro_step            the inner trainer accumulates N-1 micro-steps; micro-step 0 is skipped
    repeat_micro_step          N+1 inner micro-steps: micro-step 0's batch runs twice
    grads_times_N              boundary gradients × N (the 1/N scale missing)
    grads_over_N               boundary gradients ÷ N (the 1/N scale applied twice)
    optimizer_step_every_micro the optimizer steps after every micro-step (inner accum_steps=1)
    keep_only_last_micro_batch zero_grad inside the micro-loop: only the last micro-batch survives
    stale_micro_batch          micro-step 0 of step k gets step k-1's last micro-batch (off-by-one loader)
    loss_sum_not_mean          the reported step loss is the sum of the micro-losses, not their mean
    extra_collective_micro_0   one 1-element all_reduce on micro-step 0 (numerically invisible)
    divide_by_world_again      boundary gradients ÷ W once more (/world applied twice)

`exists(case)` says where the bug can exist at all (e.g. N ≥ 2: dropping one of one micro-step is
not accumulation); the self-test requires every operator to be killed on the cases where it exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Operator", "OPERATORS"]


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Mutant:
    """The wrapper: delegates to the inner trainer; an operator overrides one behaviour."""

    def __init__(self, op: "Operator", factory, spec):
        from dataclasses import replace

        self.op, self.N = op, spec.accum_steps
        self.inner = factory(replace(spec, accum_steps=op.inner_accum(spec.accum_steps)))
        self._scaled = False  # boundary-gradient operators act once per step
        self._stale = None  # stale_micro_batch: the previous step's last micro-batch

    # -- the protocol --------------------------------------------------------------------------------
    def micro_step(self, x, y, micro):
        self.op.micro(self, x, y, micro)

    def grads(self):
        g = self.inner.grads()
        self._boundary(g)
        return g

    def optimizer_step(self):
        if self.op.scale is not None and not self._scaled:
            self._boundary(self.inner.grads())
        self._scaled = False
        loss = self.inner.optimizer_step()
        return self.op.loss(self, loss)

    def params(self):
        return self.inner.params()

    def _boundary(self, grads: dict) -> None:
        if not self._scaled and self.op.scale is not None:
            f = self.op.scale(self)
            if f != 1.0:
                with torch.no_grad():
                    for g in grads.values():
                        g.mul_(f)
        self._scaled = True


@dataclass(frozen=True)
class Operator:
    name: str
    doc: str
    exists: Callable  # (case) -> bool
    inner_accum: Callable = lambda n: n
    micro: Callable = lambda w, x, y, m: w.inner.micro_step(x, y, m)
    scale: Callable | None = None  # (wrapper) -> factor applied in place to the boundary gradients
    loss: Callable = lambda w, loss: loss
    dist_only: bool = False
    at_n1: bool = False
    """Whether the fault acts at accum_steps=1. Most do not (there is nothing to accumulate), so the
    big-batch reference (the same adapter at N=1) stays the unmutated trainer."""

    def apply(self, adapter):
        """The adapter with this fault planted around its factory (pools rebuild it by name)."""
        inner = adapter.factory

        def mutant_factory(spec):
            return Mutant(self, inner, spec) if spec.accum_steps > 1 or self.at_n1 else inner(spec)

        return adapter.replace(factory=mutant_factory, ref=adapter.locate(), mutation=self.name,
                               name=f"{adapter.name} ⊕ {self.name}")


def _drop(w, x, y, m):
    if m > 0:
        w.inner.micro_step(x, y, m - 1)


def _repeat(w, x, y, m):
    if m == 0:
        w.inner.micro_step(x.clone(), y.clone(), 0)
    w.inner.micro_step(x, y, m + 1)


def _every_micro(w, x, y, m):
    w.inner.micro_step(x, y, 0)
    if m < w.N - 1:
        w.inner.optimizer_step()


def _last_only(w, x, y, m):
    if m == w.N - 1:
        w.inner.micro_step(x, y, 0)


def _stale(w, x, y, m):
    prev = w._stale
    if m == w.N - 1:
        w._stale = (x.clone(), y.clone())
    if m == 0 and prev is not None:
        x, y = prev
    w.inner.micro_step(x, y, m)


def _extra_collective(w, x, y, m):
    w.inner.micro_step(x, y, m)
    import torch.distributed as dist

    if m == 0 and m < w.N - 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(torch.zeros(1, device=x.device))


N2 = lambda c: c.accum_steps >= 2  # noqa: E731

OPERATORS = {op.name: op for op in [
    Operator("drop_micro_step", "micro-step 0 never reaches the trainer, which averages the other N-1", N2,
             inner_accum=lambda n: max(1, n - 1), micro=_drop),
    Operator("repeat_micro_step", "micro-step 0's batch runs twice (N+1 micro-steps)", N2,
             inner_accum=lambda n: n + 1, micro=_repeat),
    Operator("grads_times_N", "boundary gradients × N: the 1/N scale is missing", N2,
             scale=lambda w: float(w.N)),
    Operator("grads_over_N", "boundary gradients ÷ N: the 1/N scale is applied twice", N2,
             scale=lambda w: 1.0 / w.N),
    Operator("optimizer_step_every_micro", "the optimizer steps after every micro-step", N2,
             inner_accum=lambda n: 1, micro=_every_micro),
    Operator("keep_only_last_micro_batch", "zero_grad inside the loop: only the last micro-batch counts", N2,
             inner_accum=lambda n: 1, micro=_last_only),
    Operator("stale_micro_batch", "micro-step 0 of step k gets step k-1's last micro-batch",
             lambda c: c.steps >= 2, micro=_stale, at_n1=True),
    Operator("loss_sum_not_mean", "the reported step loss is the sum of the N micro-losses", N2,
             loss=lambda w, loss: loss * w.N),
    Operator("extra_collective_micro_0", "one extra 1-element all_reduce on micro-step 0",
             lambda c: c.world >= 2 and c.accum_steps >= 2, micro=_extra_collective, dist_only=True),
    Operator("divide_by_world_again", "boundary gradients ÷ W once more (/world applied twice)",
             lambda c: c.world >= 2, scale=lambda w: 1.0 / _world(), dist_only=True, at_n1=True),
]}
