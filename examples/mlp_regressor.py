"""An MLP regressor (MSE loss, SGD with momentum) in a textbook accumulation loop: not a GPT, not xtrain.

    pytest --pyargs verify --verify-trainer examples.mlp_regressor:factory -n auto
    python -m verify.selftest --verify-trainer examples.mlp_regressor:factory
"""
import torch
import torch.nn.functional as F

import verify


class Trainer:
    """N micro-steps of backward(loss / N), then one SGD step; at N == 1 no scale at all."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        # built in spec.dtype on spec.device: verify runs float64 references too
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.n = spec.accum_steps
        self.losses = []

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x), y)
        if self.n == 1:
            loss.backward()
        else:
            (loss / self.n).backward()  # each micro-batch's share of the window's mean
        self.losses.append(loss.detach())

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss

    def params(self):
        return dict(self.model.named_parameters())


class Plain(Trainer):
    """The loop without accumulation: one batch, backward, step. accum_steps=1 must be this, bit for bit."""

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.losses.append(loss.detach())


factory = verify.adapter(data=verify.data.regression(features=8), plain=Plain)(Trainer)
