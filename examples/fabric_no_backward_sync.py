"""Lightning Fabric: strategy="ddp" with fabric.no_backward_sync(model, enabled=not last), precision
"64-true" for the float64 runs and "32-true" for the float32 ones.

    pip install "xtrain[examples]"      # lightning
    pytest --pyargs verify --verify-trainer examples.fabric_no_backward_sync:factory -n auto
    python -m verify.selftest --verify-trainer examples.fabric_no_backward_sync:factory

fabric.launch() spawns nothing here: the harness's rank processes carry LOCAL_RANK like torchrun's, so
Fabric's LightningEnvironment knows the processes exist and joins the process group already set up.
"64-true" casts the forward's OUTPUT to float32 (Fabric's DoublePrecision.convert_output): the loss of a
float64 run is computed in float32, which the float64 checks see through their measured rounding floor.
"""
import torch
import torch.distributed as dist
from lightning.fabric import Fabric

import verify


class Trainer:
    def __init__(self, spec):
        W = dist.get_world_size() if dist.is_initialized() else 0  # 0: alone, Fabric's single-device strategy
        self.fabric = Fabric(accelerator=spec.device.split(":")[0], strategy="ddp" if W else "auto", devices=W or 1,
                             precision="64-true" if spec.dtype == torch.float64 else "32-true")
        self.fabric.launch()
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.model, self.opt = self.fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        self.n, self.loss = spec.accum_steps, 0.0

    def micro_step(self, x, y, micro):
        with self.fabric.no_backward_sync(self.model, enabled=micro < self.n - 1):  # covers forward and backward
            loss = torch.nn.functional.mse_loss(self.model(x), y.to(torch.get_default_dtype()))
            self.fabric.backward(loss if self.n == 1 else loss / self.n)
        self.loss = self.loss + loss.detach()

    def grads(self):
        return {k: p.grad for k, p in self.model.module.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = self.fabric.all_reduce(self.loss / self.n, reduce_op="mean"), 0.0
        return loss

    def params(self):
        return dict(self.model.module.named_parameters())


# data_parallel: under a process group Fabric wraps the model in DDP (hence DDP's declared bucket rebuild).
factory = verify.adapter(data=verify.data.regression(features=8), data_parallel=True,
                         expected=verify.DDP_EXPECTED)(Trainer)
