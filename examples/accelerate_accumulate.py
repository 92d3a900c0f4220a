"""Hugging Face Accelerate: Accelerator(gradient_accumulation_steps=N) and accumulate(), and
accelerator.clip_grad_norm_.

    pip install "/path/to/xtrain[examples]"      # accelerate (README: Install)
    pytest --pyargs verify --verify-trainer examples.accelerate_accumulate:factory -n auto
    python -m verify.selftest --verify-trainer examples.accelerate_accumulate:factory
"""
import torch
from accelerate import Accelerator

import verify


class Trainer:
    def __init__(self, spec):
        self.acc = Accelerator(gradient_accumulation_steps=spec.accum_steps, cpu=spec.device == "cpu")
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(spec.dtype)
        self.model, self.opt = self.acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        self.losses = []

    def micro_step(self, x, y, micro):
        with self.acc.accumulate(self.model):  # no_sync() and loss / N until the window's last micro-step
            self.acc.backward(loss := torch.nn.functional.mse_loss(self.model(x), y))
        self.losses = self.losses[:micro] + [loss.detach()]  # micro-step 0 starts the window's list

    def grads(self):
        return {k: p.grad for k, p in self.acc.unwrap_model(self.model).named_parameters()}

    def optimizer_step(self):
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()  # Accelerate's optimizer steps only once the window is complete
        self.opt.zero_grad()
        return self.acc.reduce(torch.stack(self.losses).mean(), "mean")

    def params(self):
        return dict(self.acc.unwrap_model(self.model).named_parameters())


# data_parallel: under a process group Accelerate wraps the model in DDP (hence DDP's expected rebuild); in a
# one-rank group too, but it enters no_sync() only when num_processes > 1: verify.DDP_WORLD1_EXPECTED declares
# the all-reduce on every micro-step at world 1 (real behaviour; it excuses nothing at world ≥ 2).
factory = verify.adapter(data=verify.data.regression(features=8), data_parallel=True,
                         expected=verify.DDP_EXPECTED + verify.DDP_WORLD1_EXPECTED)(Trainer)
