"""The path-parity gate's trainers (verify/_internal/gates/parity.py): activation checkpointing declared as a switch
that must not change the result.

    correct   rows_counted_in_the_loop   the rows counted where the micro-step is fed: once, whatever recomputes
    broken    rows_counted_in_forward    the rows counted in the checkpointed module's forward, which the backward
                                         runs again: twice under checkpointing (NeMo Automodel PR #3247's expert
                                         load). Both of its sides pass every other gate: with checkpointing on, the
                                         big batch counts twice too; only on vs off tells.

An MLP on regression data, its loss a sum of squared errors per micro-step, the gradient divided at the boundary by
the rows the window held (the count is known only when the window ends).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import verify


@dataclass(frozen=True)
class Options:
    checkpointing: bool = False


def with_checkpointing(options, on: bool) -> Options:
    return dataclasses.replace(options or Options(), checkpointing=on)


class Body(torch.nn.Module):
    """Linear + tanh, counting the rows its forward sees (as a router counts expert load)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.seen = 0

    def forward(self, x):
        self.seen += x.shape[0]
        return torch.tanh(self.lin(x))


class RowsCountedInTheLoop:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.body = Body().to(spec.device, spec.dtype)
        self.head = torch.nn.Linear(16, 1).to(spec.device, spec.dtype)
        self.params_ = [*self.body.parameters(), *self.head.parameters()]
        self.opt = torch.optim.SGD(self.params_, lr=1e-2, momentum=0.9)
        self.checkpointing = (spec.options or Options()).checkpointing
        self.total, self.rows, self.divided = 0.0, 0, False

    def micro_step(self, x, y, micro):
        h = checkpoint(self.body, x, use_reentrant=False) if self.checkpointing else self.body(x)
        loss = ((self.head(h) - y) ** 2).sum()
        loss.backward()
        self.total += float(loss.detach())
        self.rows += x.shape[0]

    def count(self) -> int:
        return self.rows

    def grads(self):
        if not self.divided:  # once, by the window's rows, before anyone reads the gradient
            for p in self.params_:
                p.grad.div_(self.count())
            self.divided = True
        return {**{f"body.{k}": p.grad for k, p in self.body.named_parameters()},
                **{f"head.{k}": p.grad for k, p in self.head.named_parameters()}}

    def optimizer_step(self):
        self.grads()
        loss = self.total / self.count()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.total, self.rows, self.divided, self.body.seen = 0.0, 0, False, 0
        return loss

    def params(self):
        return {**{f"body.{k}": p for k, p in self.body.named_parameters()},
                **{f"head.{k}": p for k, p in self.head.named_parameters()}}


class RowsCountedInForward(RowsCountedInTheLoop):
    def count(self) -> int:
        return self.body.seen  # twice the rows when the backward recomputed the forward


def _declare(cls):
    return verify.adapter(data=verify.data.regression(features=8), name=f"planted {cls.__name__}",
                          options=st.builds(Options, checkpointing=st.booleans()), defaults=Options(),
                          parity=verify.Parity(name="activation checkpointing", apply=with_checkpointing))(cls)


rows_counted_in_the_loop = _declare(RowsCountedInTheLoop)
rows_counted_in_forward = _declare(RowsCountedInForward)
