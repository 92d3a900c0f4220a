"""Lightning Fabric: strategy="ddp" with fabric.no_backward_sync(model, enabled=not last), precision
"64-true" for the float64 runs and "32-true" for the float32 ones, fabric.clip_gradients at the boundary,
the loss and gradient norm the loop logs checked.

    pip install "xtrain[examples]"      # lightning
    pytest --pyargs verify --verify-trainer examples.fabric_no_backward_sync:factory -n auto
    python -m verify.selftest --verify-trainer examples.fabric_no_backward_sync:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric

import verify

MAX_NORM = 1.0

class Trainer:
    def __init__(self, spec):
        if dist.is_initialized():
            # the harness's rank processes carry LOCAL_RANK like torchrun's: Fabric's LightningEnvironment
            # sees them, and fabric.launch() joins the process group already set up (it spawns nothing)
            strategy = "ddp"
            devices = dist.get_world_size()
        else:
            strategy = "auto"  # alone: Fabric's single-device strategy
            devices = 1
        accelerator = spec.device.split(":")[0]  # "cpu" or "cuda"
        precision = "64-true" if spec.dtype == torch.float64 else "32-true"
        self.fabric = Fabric(accelerator=accelerator, strategy=strategy, devices=devices, precision=precision)
        self.fabric.launch()
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        self.model, self.opt = self.fabric.setup(net, opt)
        self.n = spec.accum_steps
        self.loss_sum = 0.0
        self.logged = {}

    def micro_step(self, x, y, micro):
        last = micro == self.n - 1
        # like DDP's no_sync(), it must cover the forward as well as the backward
        with self.fabric.no_backward_sync(self.model, enabled=not last):
            # "64-true" casts the forward's OUTPUT to the default dtype, float32 (DoublePrecision.convert_output),
            # so the targets follow: a float64 run's loss is float32, within the float64 checks' measured floor
            loss = F.mse_loss(self.model(x), y.to(torch.get_default_dtype()))
            if self.n == 1:
                self.fabric.backward(loss)
            else:
                self.fabric.backward(loss / self.n)
        self.loss_sum = self.loss_sum + loss.detach()

    def grads(self):
        return {name: p.grad for name, p in self.model.module.named_parameters()}

    def optimizer_step(self):
        # the total norm of the synced gradients, before clipping (what clip_gradients returns with max_norm)
        norm = self.fabric.clip_gradients(self.model, self.opt, max_norm=MAX_NORM)
        self.opt.step()
        self.opt.zero_grad()
        loss = self.fabric.all_reduce(self.loss_sum / self.n, reduce_op="mean")
        self.loss_sum = 0.0
        self.logged = {"loss": loss, "grad_norm": norm}
        return loss

    def metrics(self):
        return self.logged

    def params(self):
        return dict(self.model.module.named_parameters())


# data_parallel: under a process group Fabric wraps the model in DDP (hence DDP's declared bucket rebuild).
# metrics: no LR (a constant one, which Fabric does not log).
METRICS = verify.Metrics(names=("loss", "grad_norm"), max_norm=MAX_NORM)
factory = verify.adapter(data=verify.data.regression(features=8), metrics=METRICS,
                         distributed=verify.Distributed(data_parallel=True, expected=verify.DDP_EXPECTED))(Trainer)
