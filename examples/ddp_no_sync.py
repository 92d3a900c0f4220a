"""torch DistributedDataParallel with no_sync() on micro-steps 0..N-2 (gloo on CPU, NCCL on GPUs), the
averaged gradient clipped; metrics() returns what the loop logs per step.

    XTRAIN_DIST_MIN_WORLD=2 XTRAIN_DIST_MAX_WORLD=3 pytest --pyargs verify \
        --verify-trainer examples.ddp_no_sync:factory -n auto
    python -m verify.selftest --verify-trainer examples.ddp_no_sync:factory
"""
import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import verify

MAX_NORM = 10.0  # the clip threshold; the drawn cases' norms straddle it, so clipped and unclipped steps are checked


@dataclasses.dataclass(frozen=True)
class Options:
    bucket_cap_mb: float = 25.0  # DDP's default: this model's 321 parameters make one gradient bucket


def bucket_side(options, above):
    """DDP's bucket cap as a threshold: past it the gradient spans several buckets (a cap of 100 bytes: one bucket
    per parameter), each all-reduced, and hooked, on its own."""
    return dataclasses.replace(options or Options(), bucket_cap_mb=1e-4 if above else 25.0)


def warmup(step):
    """The LR factor of a 3-step linear warm-up (the LR moves, so logging the wrong step's would show)."""
    return min(1.0, (step + 1) / 3)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        # spec.group: None (the default group), or a sub-world's group under `python -m verify.run`
        self.ddp = DDP(net.to(spec.device, spec.dtype), process_group=spec.group,
                       bucket_cap_mb=(spec.options or Options()).bucket_cap_mb)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup)
        self.n = spec.accum_steps
        self.loss_sum = 0.0
        self.rows = 0
        self.logged = {}

    def micro_step(self, x, y, micro):
        last = micro == self.n - 1
        # DDP decides at the FORWARD whether the coming backward all-reduces, so no_sync() must cover both
        sync = contextlib.nullcontext() if last else self.ddp.no_sync()
        with sync:
            loss = F.mse_loss(self.ddp(x), y)
            if self.n == 1:
                loss.backward()
            else:
                (loss / self.n).backward()
        self.loss_sum = self.loss_sum + loss.detach()
        self.rows += len(y)

    def grads(self):
        return {name: p.grad for name, p in self.ddp.module.named_parameters()}

    def optimizer_step(self):
        # DDP averaged the gradient over the ranks at the last backward: every rank holds the whole batch's,
        # so clip_grad_norm_'s local norm (returned before it clips) is the global one
        norm = torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), MAX_NORM).item()
        lr = self.opt.param_groups[0]["lr"]  # read before the step: the LR this step applies
        self.opt.step()
        self.sched.step()  # once per optimizer step, after it
        self.opt.zero_grad()
        # the global batch's mean loss, over DDP's group (every rank holds equal micro-batches)
        group = self.ddp.process_group
        world = dist.get_world_size(group)
        loss = self.loss_sum / (self.n * world)
        dist.all_reduce(loss, group=group)
        self.logged = {"loss": loss.item(), "grad_norm": norm, "lr": lr, "rows": self.rows * world}
        self.loss_sum = 0.0
        self.rows = 0
        return loss

    def metrics(self):
        """What the last step logs: the global loss, the pre-clip norm, the LR, the window's rows over every rank."""
        return self.logged

    def params(self):
        return dict(self.ddp.module.named_parameters())


# process_group: DDP needs one even alone, so its single-process gates run on a one-rank group.
# DDP_EXPECTED: DDP's one-time bucket rebuild broadcasts at micro-step 0 of step 1, declared.
# subgroups: every collective goes over spec.group, so a launched world also runs its sub-worlds.
# metrics: what metrics() logs, and the threshold it clips at (the harness checks the scale the optimizer saw).
# thresholds: DDP's bucket cap, so every gate also runs with the gradient in one bucket and in several.
metrics = verify.Metrics(names=("loss", "grad_norm", "lr", "rows"), max_norm=MAX_NORM)
factory = verify.adapter(data=verify.data.regression(features=8), metrics=metrics, defaults=Options(),
                         distributed=verify.Distributed(process_group=True, expected=verify.DDP_EXPECTED, subgroups=True),
                         thresholds=(verify.Threshold(name="DDP bucket cap", apply=bucket_side),))(Trainer)
