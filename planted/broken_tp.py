"""Tensor-parallel bugs from the field, planted in examples/tensor_parallel.py's trainer (issue 18 item 5).

`TensorParallel` is that recipe's trainer (a classifier, ColwiseParallel / RowwiseParallel, loss parallel,
dp replicas reduced once at the boundary) with its three normalisation points as hooks; each bug overrides
one of them, so a rejection can only come from that one thing:

    count(y)          what the micro-batch's summed loss is divided by: its rows (every target counts)
    loss_factor()     what the loss is multiplied by before backward: 1
    boundary_group()  the group the boundary reduction sums over: dp's (the replicas), never tp's

Under tensor parallel every tp rank of a replica holds the SAME rows and computes the same loss, so each
normaliser must be the replica's, not a shard's, and gradients are summed over dp only: a tp rank's shard
is not a replica of its neighbour's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verify import CountRow, adapter, device_mesh
from verify.data import classification

FEATURES, HIDDEN, CLASSES = 8, 24, 12  # HIDDEN and CLASSES divide by every tp ≤ 4: even shards on every rank


class TensorParallel:
    def __init__(self, spec):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        torch.manual_seed(spec.seed)
        L, T = torch.nn.Linear, torch.nn.Tanh
        self.model = torch.nn.Sequential(L(FEATURES, HIDDEN), T(), L(HIDDEN, HIDDEN), T(),
                                         L(HIDDEN, CLASSES)).to(spec.device, spec.dtype)
        self.n, self.dp, self.tp, self.tp_rank, self.loss = spec.accum_steps, spec.mesh.dp, spec.mesh.tp, 0, 0.0
        if spec.mesh.size > 1:  # at Mesh() (the reference) the plain model, as in the recipe
            mesh = device_mesh(spec)
            self.dp_group, self.tp_rank = mesh["dp"].get_group(), mesh["tp"].get_local_rank()
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(use_local_output=False)}
            parallelize_module(self.model, mesh["tp"], plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def micro_step(self, x, y, micro):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(self.model(x), y, reduction="sum") / self.count(y)
            (loss * self.loss_factor() / self.n).backward()
        self.loss += loss.item() / self.n
        if micro == self.n - 1 and self.boundary_group() is not None:
            for p in self.model.parameters():
                dist.all_reduce(p.grad.to_local(), group=self.boundary_group())
                p.grad.div_(self.dp)

    def count(self, y):
        return len(y)

    def loss_factor(self):
        return 1

    def boundary_group(self):
        return self.dp_group if self.dp > 1 else None

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = torch.tensor(self.loss / self.dp, dtype=torch.float64), 0.0
        if self.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)
        return loss

    def params(self):
        return dict(self.model.named_parameters())


class ShardLocalCount(TensorParallel):
    """The loss divided by the targets that fall in this rank's class shard — the mask of a vocab-parallel
    cross entropy — instead of all the replica's targets: each tp rank scales its part of the gradient by
    its own count (Megatron #7513 class: a shard-local count as the normaliser)."""

    def count(self, y):
        per = -(-CLASSES // self.tp)  # torch.chunk's split of the head's rows (Shard(0))
        lo = self.tp_rank * per
        return ((y >= lo) & (y < lo + per)).sum()


class LossTimesTP(TensorParallel):
    """The loss multiplied by the tp size, as if the tp ranks' gradients were averaged like replicas'
    (transformers #39648: the loss scaled up by TP × CP)."""

    def loss_factor(self):
        return self.tp


class BoundaryOverWorld(TensorParallel):
    """The boundary all-reduce on the default group — every rank, tp included — as DDP-style code does: the
    tp ranks' different shards (and the replicated bias's equal gradients) are summed too (torchtitan #3412
    class: a tp-local gradient reduced as if it were a replica's)."""

    def boundary_group(self):
        return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def tp_counts(case):
    """The recipe's row: tp all-reduces on every micro-step (Rowwise's output, the head's input gradient,
    loss_parallel's three; only those three on a one-rank tp group); dp keeps the default boundary-only row."""
    tp = {"all_reduce": 5 if case.mesh.tp > 1 else 3}
    return {"tp": CountRow("Colwise/Rowwise + loss parallel", before=tp, boundary=tp)}


def _tp(cls, name):
    return adapter(data=classification(features=FEATURES, classes=CLASSES), mesh_axes=("dp", "tp"), counts=tp_counts,
                   name=name)(cls)


tensor_parallel = _tp(TensorParallel, "tp_recipe")  # the control: the recipe's trainer, must pass
shard_local_count = _tp(ShardLocalCount, "broken_tp.shard_local_count")
loss_times_tp = _tp(LossTimesTP, "broken_tp.loss_times_tp")
boundary_over_world = _tp(BoundaryOverWorld, "broken_tp.boundary_over_world")
