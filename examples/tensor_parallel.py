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
from verify.mesh import device_mesh


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the full model; parallelize_module keeps its shards
        net = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(),
                                  torch.nn.Linear(24, 12)).to(spec.device, spec.dtype)
        mesh = device_mesh(spec)  # dims ("dp", "pp", "tp"); the harness gives each dp replica its rows
        self.tp, self.dp, self.n, self.loss = mesh["tp"], mesh["dp"], spec.accum_steps, 0.0
        # the head's logits stay a DTensor sharded over the classes: loss_parallel's cross entropy reads them so
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(use_local_output=False)}
        self.model = parallelize_module(net, self.tp, plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def micro_step(self, x, y, micro):
        with loss_parallel():  # the backward too: the loss's gradient flows into the sharded logits
            loss = F.cross_entropy(self.model(x), y)  # the mean over the replica's rows, on every tp rank
            (loss / self.n).backward()
        self.loss = self.loss + loss.detach().full_tensor()
        if micro == self.n - 1:  # the boundary: the replicas' mean gradient, one all-reduce over dp per tensor
            for p in self.model.parameters():  # a DTensor's local shard: each tp rank reduces its own
                dist.all_reduce(p.grad.to_local(), group=self.dp.get_group())
                p.grad.div_(self.dp.size())

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}  # DTensors: the harness gathers them

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = self.loss / (self.n * self.dp.size()), 0.0
        dist.all_reduce(loss, group=self.dp.get_group())  # the global batch's mean loss
        return loss

    def params(self):
        return dict(self.model.named_parameters())


factory = verify.adapter(data=verify.data.classification(features=8, classes=12), mesh_axes=("dp", "tp"))(Trainer)
