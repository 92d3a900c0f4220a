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
        torch.manual_seed(spec.seed)  # the model is built in spec.dtype on spec.device: verify runs float64 too
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.n, self.losses = spec.accum_steps, []

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x), y)
        (loss if self.n == 1 else loss / self.n).backward()
        self.losses.append(loss.detach())

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.losses = torch.stack(self.losses).mean(), []
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
