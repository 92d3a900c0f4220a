"""torch DistributedDataParallel with no_sync() on micro-steps 0..N-2 (gloo on CPU, NCCL on GPUs).

    XTRAIN_DIST_MIN_WORLD=2 XTRAIN_DIST_MAX_WORLD=3 pytest --pyargs verify \
        --verify-trainer examples.ddp_no_sync:factory -n auto
    python -m verify.selftest --verify-trainer examples.ddp_no_sync:factory
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import verify


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        # spec.group: None (the default group), or a sub-world's group under `python -m verify.run`
        self.ddp = DDP(net.to(spec.device, spec.dtype), process_group=spec.group)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-2)
        self.n = spec.accum_steps
        self.loss_sum = 0.0

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

    def grads(self):
        return {name: p.grad for name, p in self.ddp.module.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        # the global batch's mean loss, over DDP's group (every rank holds equal micro-batches)
        group = self.ddp.process_group
        loss = self.loss_sum / (self.n * dist.get_world_size(group))
        self.loss_sum = 0.0
        dist.all_reduce(loss, group=group)
        return loss

    def params(self):
        return dict(self.ddp.module.named_parameters())


# process_group: DDP needs one even alone, so its single-process gates run on a one-rank group.
# DDP_EXPECTED: DDP's one-time bucket rebuild broadcasts at micro-step 0 of step 1, declared.
# subgroups: every collective goes over spec.group, so a launched world also runs its sub-worlds.
factory = verify.adapter(data=verify.data.regression(features=8), process_group=True,
                         expected=verify.DDP_EXPECTED, subgroups=True)(Trainer)
