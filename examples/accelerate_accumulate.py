"""Hugging Face Accelerate: Accelerator(gradient_accumulation_steps=N) and accumulate(), a prepared LambdaLR
warm-up scheduler and accelerator.clip_grad_norm_.

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
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3))  # LR warm-up: 3 steps
        self.model, self.opt, self.sched = self.acc.prepare(net, opt, warmup)
        # a prepared scheduler advances num_processes times per step(): one process stands in for W ranks
        self.sched_calls, self.losses = max(1, spec.schedule_world // self.acc.num_processes), []

    def micro_step(self, x, y, micro):
        with self.acc.accumulate(self.model):  # no_sync() and loss / N until the window's last micro-step
            self.acc.backward(loss := torch.nn.functional.mse_loss(self.model(x), y))
        self.losses = self.losses[:micro] + [loss.detach()]  # micro-step 0 starts the window's list

    def grads(self):
        return {k: p.grad for k, p in self.acc.unwrap_model(self.model).named_parameters()}

    def optimizer_step(self):
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()  # Accelerate's optimizer and scheduler step only once the window is complete
        for _ in range(self.sched_calls):
            self.sched.step()
        self.opt.zero_grad()
        return self.acc.reduce(torch.stack(self.losses).mean(), "mean")

    def params(self):
        return dict(self.acc.unwrap_model(self.model).named_parameters())


# data_parallel: under a process group Accelerate wraps the model in DDP (hence DDP's expected rebuild); in a
# one-rank group too, but it enters no_sync() only when num_processes > 1: verify.DDP_WORLD1_EXPECTED declares
# the all-reduce on every micro-step at world 1 (real behaviour; it excuses nothing at world ≥ 2).
# scheduler_per_rank: Accelerate steps a prepared scheduler num_processes times per optimizer step.
factory = verify.adapter(data=verify.data.regression(features=8), data_parallel=True, scheduler_per_rank=True,
                         expected=verify.DDP_EXPECTED + verify.DDP_WORLD1_EXPECTED)(Trainer)
