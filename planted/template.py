"""The micro-step template of the planted bugs (broken*.py): a planted bug is one hook on xtrain's trainer.

`Planted` (listed before the trainer: `class ZeroGradInLoop(Planted, AccumTrainer)`) runs the trainer's own
micro_step between hooks, so the bug is the hook and nothing else differs:

    before(idx, targets, micro)   before the trainer's micro-step (it may edit the batch in place)
    after(micro)                  after it, on every micro-step
    between(micro)                after it, on micro-steps 0..N-2 only: where an early sync, step or
                                  unscale is a bug

The trainer's own hooks stay open too (`_objective`, `_backward`, `_finish_boundary`, ...). The micro-step
in progress is `self._next_micro` inside them (the trainer advances it when the micro-step ends).

`SyncSwitch` is the template for wrappers whose gradient sync is a switch set around the forward and
backward (torch DDP's require_backward_grad_sync / no_sync(), FSDP2's set_requires_gradient_sync): the
skeleton of their micro-step, with the switch's placement as the hook.
"""
from __future__ import annotations

import contextlib


class Planted:
    def micro_step(self, idx, targets, micro):
        self.before(idx, targets, micro)
        super().micro_step(idx, targets, micro)
        self.after(micro)
        if micro < self.accum_steps - 1:
            self.between(micro)

    def before(self, idx, targets, micro) -> None:
        pass

    def after(self, micro) -> None:
        pass

    def between(self, micro) -> None:
        pass


class SyncSwitch:
    """One micro-step: switch(micro, "forward"); forward; switch(micro, "backward"); backward inside
    backward_context(micro); switch(micro, "after"). The right placement is the wrapped trainer's own
    micro_step; each bug places the switch (or a no_sync context) somewhere else."""

    def micro_step(self, idx, targets, micro):
        self._enter(micro)
        self.switch(micro, "forward")
        if hasattr(self, "ddp"):  # TorchDDPTrainer forwards through its DDP module
            forward_mean, forward_sum = self._forward_mean, self._forward_sum
        else:
            forward_mean, forward_sum = self.model.loss_batched, self.model.loss_sum
        objective = self._objective(forward_mean, forward_sum, idx, targets, micro, alone=self.world == 1)
        self.switch(micro, "backward")
        with self.backward_context(micro):
            self._backward(objective)
        self.switch(micro, "after")
        self._next_micro = micro + 1

    def switch(self, micro, at: str) -> None:
        pass

    def backward_context(self, micro):
        return contextlib.nullcontext()


class ModelState:
    """The protocol's two reads of a trainer that holds one `self.model` (the hand-written planted trainers and the
    tests' helpers, which are not xtrain's): its gradients and its parameters by name."""

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def params(self):
        return dict(self.model.named_parameters())


class TextbookSteps(ModelState):
    """The textbook micro-step of a hand-written trainer: backward of `scale(loss(x, y))` (the subclass's), the loss
    kept in float64, the gradient averaged over `world` ranks at the boundary; and partial_grads(), the window's
    gradient had it ended after the micro-steps so far. Needs self.model, self.n, self.world, self.losses."""

    def micro_step(self, x, y, micro):
        import torch.distributed as dist

        loss = self.loss(x, y)
        self.scale(loss).backward()
        self.losses.append(loss.detach().double())
        if micro == self.n - 1 and self.world > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= self.world

    def partial_grads(self):
        return {k: p.grad * (self.n / len(self.losses)) for k, p in self.model.named_parameters()}


def window_loss(losses: list, world: int):
    """The window's reported loss: the mean of its micro-steps' losses, averaged over `world` ranks."""
    import torch
    import torch.distributed as dist

    loss = torch.stack(losses).mean()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    return loss
