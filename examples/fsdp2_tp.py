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
from verify._internal.ranks.mesh import device_mesh


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the full model; TP, then FSDP2, keep their shards
        net = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))
        self.model = net.to(spec.device, spec.dtype)
        self.n = spec.accum_steps
        self.dp = spec.mesh.dp
        self.loss = 0.0
        # at Mesh() (the 1×1×1 reference) the plain model: no process group needed
        self.fsdp = spec.mesh.size > 1
        if self.fsdp:
            self.mesh = device_mesh(spec)  # dims ("dp", "pp", "tp"): TP within a replica, FSDP2 across replicas
            parallelize_module(self.model, self.mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(self.model, mesh=self.mesh["dp"])  # one unit, the root; its reduce-scatter averages over dp
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def micro_step(self, x, y, micro):
        if self.fsdp:
            # set before the forward, read in the backward: sync only on the window's last micro-step
            self.model.set_requires_gradient_sync(micro == self.n - 1)
        loss = F.mse_loss(self.model(x), y)
        (loss / self.n).backward()
        self.loss += loss.item() / (self.n * self.dp)

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}  # 2-D DTensors: the harness gathers them

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss = torch.tensor(self.loss, dtype=torch.float64)
        self.loss = 0.0
        if self.dp > 1:
            dist.all_reduce(loss, group=self.mesh["dp"].get_group())  # the global batch's mean loss
        return loss

    def params(self):
        return dict(self.model.named_parameters())


def counts(case):
    """Each micro-step: FSDP2's all-gather of its one unit over dp, Rowwise's all-reduce over tp. The boundary
    adds FSDP2's reduce-scatter over dp (gloo has none: an all-reduce) and the loss's all-reduce."""
    tp = {"all_reduce": 1} if case.mesh.tp > 1 else {}  # a one-rank tp group reaches no c10d
    rows = {"tp": verify.CountRow("Rowwise", before=tp, boundary=tp)}
    if case.mesh.dp > 1:
        gather = {"all_gather": 1}
        if verify.Settings.current().backend == "nccl":
            boundary = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}
        else:
            boundary = {"all_gather": 1, "all_reduce": 2}
        rows["dp"] = verify.CountRow("FSDP2, root unit", before=gather, boundary=boundary)
    return rows


factory = verify.adapter(data=verify.data.regression(features=8), mesh_axes=("dp", "tp"), counts=counts)(Trainer)
