"""DTensor tensor parallel (ColwiseParallel / RowwiseParallel, loss parallel) with data-parallel replicas
on a dp × tp mesh: tp's collectives run on every micro-step, the dp reduction once, at the boundary.

    pytest --pyargs verify --verify-trainer examples.tensor_parallel:factory -n auto
    python -m verify.selftest --verify-trainer examples.tensor_parallel:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

import verify
from verify._internal.ranks.mesh import device_mesh


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the full model; parallelize_module keeps its shards
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 24), torch.nn.Tanh(),
            torch.nn.Linear(24, 24), torch.nn.Tanh(),
            torch.nn.Linear(24, 12),
        )
        self.model = model.to(spec.device, spec.dtype)
        self.n = spec.accum_steps
        self.dp = spec.mesh.dp
        self.loss = torch.zeros((), dtype=torch.float64)
        if spec.mesh.size > 1:  # at Mesh() (the 1×1×1 reference) the plain model: no process group needed
            self.mesh = device_mesh(spec)  # dims ("dp", "pp", "tp"); the harness gives each dp replica its rows
            # the head's logits stay a DTensor sharded over the classes: loss_parallel's cross entropy reads them so
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(use_local_output=False)}
            parallelize_module(self.model, self.mesh["tp"], plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def micro_step(self, x, y, micro):
        # loss_parallel() covers the backward too: the loss's gradient flows into the sharded logits
        with loss_parallel():
            loss = F.cross_entropy(self.model(x), y)  # the replica's mean, on every tp rank
            (loss / self.n).backward()
        self.loss += loss.item() / (self.n * self.dp)
        if micro == self.n - 1 and self.dp > 1:
            self.average_over_dp()

    def average_over_dp(self):
        """The boundary: the replicas' means, one all-reduce over dp per gradient, and the global batch's loss."""
        group = self.mesh["dp"].get_group()
        for p in self.model.parameters():
            # a DTensor's local shard: each tp rank reduces its own
            dist.all_reduce(p.grad.to_local(), group=group)
            p.grad.div_(self.dp)
        dist.all_reduce(self.loss, group=group)

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}  # DTensors: the harness gathers them

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss = self.loss
        self.loss = torch.zeros((), dtype=torch.float64)
        return loss

    def params(self):
        return dict(self.model.named_parameters())


def counts(case):
    """tp's all-reduces on every micro-step: Rowwise's output, the head's input gradient and loss_parallel's
    three (max, sum of exponentials, target logit); on a one-rank tp group only loss_parallel's reach c10d.
    dp keeps the default row: nothing before the boundary."""
    tp = {"all_reduce": 5 if case.mesh.tp > 1 else 3}
    return {"tp": verify.CountRow("Colwise/Rowwise + loss parallel", before=tp, boundary=tp)}


# mesh_sizes: tp shards the widths 24 and 12 evenly
factory = verify.adapter(data=verify.data.classification(features=8, classes=12), mesh_axes=("dp", "tp"),
                         counts=counts, mesh_sizes={"tp": (2, 3, 4, 6)})(Trainer)
