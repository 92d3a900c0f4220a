"""The gradient where the optimizer reads it: Adapter(grads_from="optimizer").

Many loops normalise in their step: a token-weighted trainer backwards the SUM of its losses and divides
the accumulated gradient by the window's token count inside optimizer_step(), just before opt.step(). Its
updates are the big batch's, but its grads() (read before the step) is not the gradient it steps with. For
such a trainer the harness reads the gradient each parameter holds when an optimizer's step() begins
(torch.optim's global step pre-hook, armed only inside optimizer_step()), and names it by identity with
params(). That is the gradient after every normalisation AND after clipping: the big batch it is compared
with clips its whole window the same way. What that view cannot show, and what the gates do: gates/clipped.py.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["GRADS_FROM", "OptimizerGrads"]

GRADS_FROM = ("grads", "optimizer")  # Adapter.grads_from: where the harness reads the boundary gradient


class OptimizerGrads:
    """A trainer seen through its optimizer: step_with_grads() runs optimizer_step() and returns (the gradient of
    every parameter of params() as the first optimizer step() of it saw it, the step loss). Only the protocol's
    methods pass through, with loss_scale() and metrics() (the gates read them of the trainer as they are):
    partial_grads() would be read before the normalisation, so it is not offered."""

    def __init__(self, trainer):
        self.inner = trainer
        for optional in ("loss_scale", "metrics"):
            if callable(getattr(trainer, optional, None)):
                setattr(self, optional, getattr(trainer, optional))

    def micro_step(self, inputs, targets, micro):
        return self.inner.micro_step(inputs, targets, micro)

    def grads(self):
        return self.inner.grads()

    def params(self):
        return self.inner.params()

    def optimizer_step(self):
        return self.step_with_grads()[1]

    def step_with_grads(self):
        names = {id(p): k for k, p in self.inner.params().items()}
        seen: dict = {}

        def pre(opt, args, kwargs):  # every optimizer stepped: each parameter's gradient as it is first stepped
            for group in opt.param_groups:
                for p in group["params"]:
                    k = names.get(id(p))
                    if k is not None and k not in seen and p.grad is not None:
                        seen[k] = p.grad.detach().clone()

        handle = register_optimizer_step_pre_hook(pre)
        try:
            loss = self.inner.optimizer_step()
        finally:
            handle.remove()
        return seen, loss
