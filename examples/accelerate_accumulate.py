"""Hugging Face Accelerate: Accelerator(gradient_accumulation_steps=N) and accumulate(), a prepared LambdaLR
warm-up scheduler and accelerator.clip_grad_norm_, the loss, gradient norm and LR the loop logs checked.

    pip install "/path/to/xtrain[examples]"      # accelerate (README: Install)
    pytest --pyargs verify --verify-trainer examples.accelerate_accumulate:factory -n auto
    python -m verify.selftest --verify-trainer examples.accelerate_accumulate:factory
"""
import torch
import torch.nn.functional as F
from accelerate import Accelerator

import verify

MAX_NORM = 1.0

def warmup(step):
    """The LR factor of a 3-step linear warm-up."""
    return min(1.0, (step + 1) / 3)


class Trainer:
    def __init__(self, spec):
        self.acc = Accelerator(gradient_accumulation_steps=spec.accum_steps, cpu=spec.device == "cpu")
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(spec.dtype)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        self.model, self.opt, self.sched = self.acc.prepare(net, opt, sched)
        # A prepared scheduler advances num_processes times per step() call (scheduler_per_rank below):
        # 1 call in a real W-rank run; the harness's one-process reference of that run makes W.
        self.scheduler_calls = spec.scheduler_calls
        self.losses = []
        self.logged = {}

    def micro_step(self, x, y, micro):
        if micro == 0:
            self.losses = []  # a new window
        # accumulate(): no_sync() and loss / N until the window's last micro-step
        with self.acc.accumulate(self.model):
            loss = F.mse_loss(self.model(x), y)
            self.acc.backward(loss)
        self.losses.append(loss.detach())

    def grads(self):
        return {name: p.grad for name, p in self.acc.unwrap_model(self.model).named_parameters()}

    def optimizer_step(self):
        # the total norm of the synced gradients, before clipping (what clip_grad_norm_ returns)
        norm = self.acc.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        # Accelerate's optimizer and scheduler wrappers step only once the window is complete
        self.opt.step()
        for _ in range(self.scheduler_calls):
            self.sched.step()
        self.opt.zero_grad()
        window_loss = torch.stack(self.losses).mean()
        loss = self.acc.reduce(window_loss, "mean")
        # logged after the scheduler's step, as a loop that logs at its end reads it: the NEXT step's LR
        self.logged = {"loss": loss, "grad_norm": norm, "lr": self.sched.get_last_lr()[0]}
        return loss

    def metrics(self):
        return self.logged

    def params(self):
        return dict(self.acc.unwrap_model(self.model).named_parameters())


# data_parallel: under a process group Accelerate wraps the model in DDP (hence DDP's expected rebuild); in a
# one-rank group too, but it enters no_sync() only when num_processes > 1: verify.DDP_WORLD1_EXPECTED declares
# the all-reduce on every micro-step at world 1 (real behaviour; it excuses nothing at world ≥ 2).
# scheduler_per_rank: Accelerate steps a prepared scheduler num_processes times per optimizer step.
# metrics: lr="next", the LR read after the scheduler's step.
METRICS = verify.Metrics(names=("loss", "grad_norm", "lr"), max_norm=MAX_NORM, lr="next")
factory = verify.adapter(data=verify.data.regression(features=8), metrics=METRICS,
                         distributed=verify.Distributed(data_parallel=True, scheduler_per_rank=True,
                                                        expected=verify.DDP_EXPECTED + verify.DDP_WORLD1_EXPECTED))(Trainer)
