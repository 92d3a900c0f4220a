"""FSDP2 over dp (fully_shard) + DTensor tensor parallel over tp on a 2-D mesh: FSDP2's gradient sync is
off on micro-steps 0..N-2 (set_requires_gradient_sync), so its reduce-scatter over dp runs at the boundary only.

    pytest --pyargs verify --verify-trainer examples.fsdp2_tp:factory -n auto
    python -m verify.selftest --verify-trainer examples.fsdp2_tp:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import verify
from verify.mesh import device_mesh


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the full model; TP, then FSDP2, keep their shards
        net = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))
        self.model, self.n, self.dp, self.loss = net.to(spec.device, spec.dtype), spec.accum_steps, spec.mesh.dp, 0.0
        if spec.mesh.size > 1:  # at Mesh() (the 1×1×1 reference) the plain model: no process group needed
            mesh = device_mesh(spec)  # dims ("dp", "pp", "tp"): TP within a replica, FSDP2 across replicas
            parallelize_module(self.model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(self.model, mesh=mesh["dp"])  # its reduce-scatter averages over dp
            self.dp_group = mesh["dp"].get_group()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def micro_step(self, x, y, micro):
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 (a mesh): before the forward, read in backward
            self.model.set_requires_gradient_sync(micro == self.n - 1)
        loss = F.mse_loss(self.model(x), y)
        (loss / self.n).backward()
        self.loss += loss.item() / self.n

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}  # 2-D DTensors: the harness gathers them

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = torch.tensor(self.loss / self.dp, dtype=torch.float64), 0.0
        if self.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)  # the global batch's mean loss
        return loss

    def params(self):
        return dict(self.model.named_parameters())


factory = verify.adapter(data=verify.data.regression(features=8), mesh_axes=("dp", "tp"))(Trainer)
