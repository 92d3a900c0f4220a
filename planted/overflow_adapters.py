"""fp16 trainers on FLOAT data (verify.data.regression), for the injected-overflow gate's generic route: the
harness injects the overflow into the backward (verify._internal.gates.overflow.BackwardInf); nothing is declared but fp16.

    scaled          a textbook GradScaler loop (scaled backward per micro-step, one unscale_/step/update per
                    window), data-parallel by one all-reduce of the gradients at the boundary: passes
    no_fp16         the same trainer without fp16 declared: the gate is skipped, saying why
    local_clean     ranks ≥ 1 clear non-finite entries of their OWN gradient before the all-reduce
                    (nan_to_num): an overflow there vanishes and every rank steps: rejected
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from planted.template import ModelState, window_loss


def _world():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Scaled(ModelState):
    local_clean = False

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.n, self.losses, self.device = spec.accum_steps, [], torch.device(spec.device).type
        self.fp16 = spec.precision == "fp16"
        self.scaler = torch.amp.GradScaler(self.device, init_scale=2.0**8, enabled=self.fp16)

    def micro_step(self, x, y, micro):
        with torch.autocast(self.device, dtype=torch.float16, enabled=self.fp16):
            loss = F.mse_loss(self.model(x).float(), y)
        self.scaler.scale(loss / self.n).backward()
        self.losses.append(loss.detach())
        if micro == self.n - 1 and _world() > 1:
            grads = [p.grad for p in self.model.parameters()]
            if self.local_clean and dist.get_rank() > 0:  # the bug: an overflow on this rank never reaches the sum
                for g in grads:
                    torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
            for g in grads:
                dist.all_reduce(g)
                g.div_(_world())

    def grads(self):
        if self.fp16 and not getattr(self, "_unscaled", False):
            self.scaler.unscale_(self.opt)  # once per window
        self._unscaled = True
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.grads()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        self._unscaled = False
        loss, self.losses = window_loss(self.losses, _world()), []
        return loss

    def loss_scale(self):
        return self.scaler.get_scale()


class LocalClean(Scaled):
    local_clean = True


_data = verify.data.regression(features=8)
scaled = verify.adapter(data=_data, precisions=("fp32", "fp16"), data_parallel=True)(Scaled)
no_fp16 = verify.adapter(data=_data, data_parallel=True)(Scaled)
local_clean = verify.adapter(data=_data, precisions=("fp32", "fp16"), data_parallel=True)(LocalClean)


# Module-level (rank pools import adapters by name): xtrain's fp16 trainers without their overflow= hook, so the
# harness injects the overflow itself (verify._internal.gates.overflow.BackwardInf), on integer token inputs
from xtrain_proof import adapters as _xtrain  # noqa: E402

_HERE = __name__


def _injected(base, name):  # ref: the factory's module is xtrain's, so the pools find it here by name
    return base.replace(overflow=None, name=f"{base.name}, harness-injected", ref=f"{_HERE}:{name}")


tokens_injected = _injected(_xtrain.tokens_adapter, "tokens_injected")
ddp_injected = _injected(_xtrain.torch_ddp, "ddp_injected")
dist_injected = _injected(_xtrain.data_parallel, "dist_injected")
