"""An MLP regressor (MSE loss, SGD with momentum, a warm-up, clip_grad_norm_) in a textbook accumulation loop:
not a GPT, not xtrain. metrics() returns what the loop logs per step.

    pytest --pyargs verify --verify-trainer examples.mlp_regressor:factory -n auto
    python -m verify.selftest --verify-trainer examples.mlp_regressor:factory
"""
import torch
import torch.nn.functional as F

import verify

MAX_NORM = 10.0  # the clip threshold; the drawn cases' norms straddle it, so clipped and unclipped steps are checked


def warmup(step):
    """The LR factor of a 3-step linear warm-up (the LR moves, so logging the wrong step's would show)."""
    return min(1.0, (step + 1) / 3)


class Trainer:
    """N micro-steps of backward(loss / N), then one clipped SGD step; at N == 1 no scale at all."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        # built in spec.dtype on spec.device: verify runs float64 references too
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup)
        self.n = spec.accum_steps
        self.losses = []
        self.rows = 0
        self.logged = {}

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x), y)
        if self.n == 1:
            loss.backward()
        else:
            (loss / self.n).backward()  # each micro-batch's share of the window's mean
        self.losses.append(loss.detach())
        self.rows += len(y)

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}

    def optimizer_step(self):
        # clip_grad_norm_ returns the norm BEFORE it clipped: the one to log
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM).item()
        lr = self.opt.param_groups[0]["lr"]  # read before the step: the LR this step applies
        self.opt.step()
        self.sched.step()  # once per optimizer step, after it
        self.opt.zero_grad()
        loss = torch.stack(self.losses).mean()
        # clip_grad_norm_ scales by max_norm / (norm + 1e-6) where that is below 1
        clip_coef = min(1.0, MAX_NORM / (norm + 1e-6))
        self.logged = {"loss": loss.item(), "grad_norm": norm, "clip_coef": clip_coef, "lr": lr, "rows": self.rows}
        self.losses = []
        self.rows = 0
        return loss

    def metrics(self):
        """What the last step logs: its loss, the pre-clip norm, the scale clipping applied, the LR, the rows."""
        return self.logged

    def params(self):
        return dict(self.model.named_parameters())


class Plain(Trainer):
    """The loop without accumulation: one batch, backward, step. accum_steps=1 must be this, bit for bit."""

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.losses.append(loss.detach())
        self.rows += len(y)


# metrics: what metrics() logs, and the threshold it clips at (the harness checks the scale the optimizer saw)
metrics = verify.Metrics(names=("loss", "grad_norm", "clip_coef", "lr", "rows"), max_norm=MAX_NORM)
factory = verify.adapter(data=verify.data.regression(features=8), plain=Plain, metrics=metrics)(Trainer)
