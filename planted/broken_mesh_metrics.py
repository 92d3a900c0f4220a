"""Reported-metrics bugs across ranks (issue 28): a norm or a clip coefficient from part of the gradient.

Each is one change to a trainer that is right without it, so a rejection can only come from that change:

    replicated_counted_tp   examples/tensor_parallel.py's trainer (broken_tp.TensorParallel) logging a grad_norm
                            that sums every parameter's local Σg² over the tp group: a replicated parameter
                            (Rowwise's bias) counts tp times (NeMo RL PR #3788). Only the log is wrong.
    fsdp2_shard_norm        xtrain's FSDP2 trainer logging the norm of this rank's gradient shards
                            (p.grad.to_local()), never all-reduced. Only the log is wrong.
    clip_before_reduction   xtrain's data-parallel trainer clipping each rank's own accumulated gradient before
                            the boundary all-reduce: the step's gradient is a mean of differently scaled ones.
    clip_coef_per_rank      the same trainer clipping the reduced gradient by a coefficient from the norm of
                            this rank's 1/W of it (the shard a ZeRO optimizer owns), never all-reduced.

The controls are `tp_logged` (the TP trainer logging get_total_norm's DTensor norm, one all-reduce over tp as
the bug's) and xtrain's own trainers (xtrain_proof/adapters.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from xtrain_core.distributed import DistAccumTrainer
from xtrain_core.fsdp import FSDP2Trainer
from xtrain_proof import adapters as xtrain
from planted.broken_tp import CLASSES, FEATURES, TensorParallel
from verify import CountRow, Metrics, adapter, device_mesh
from verify.data import classification


# -- tensor parallel ---------------------------------------------------------------------------------------

class TPLogged(TensorParallel):
    """The TP trainer with what a loop logs: loss, the norm of the whole gradient, the LR, the window's rows. It
    does not clip, so a wrong norm changes no parameter: only the metrics gate can see it. `norm()` is the hook:
    here get_total_norm over the DTensors, one number on every tp rank by full_tensor() (one all-reduce over tp)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.rows, self.logged, self.tp_group = 0, {}, None
        if spec.mesh.size > 1:  # the recipe's mesh (built once per process): its tp group, for the bug's norm
            self.tp_group = device_mesh(spec)["tp"].get_group()

    def micro_step(self, x, y, micro):
        super().micro_step(x, y, micro)
        self.rows += len(y)

    def norm(self) -> float:
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters()])
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def optimizer_step(self):
        self.logged = dict(grad_norm=self.norm(), lr=self.opt.param_groups[0]["lr"], rows=self.rows * self.dp)
        self.rows = 0
        loss = super().optimizer_step()
        self.logged["loss"] = float(loss)
        return loss

    def metrics(self):
        return self.logged


class ReplicatedCountedTP(TPLogged):
    """Σg² of every parameter's local tensor, summed over the tp group: a sharded weight's shards add up to its
    whole, but a replicated bias is whole on every tp rank and so counts tp times (NeMo RL PR #3788)."""

    def norm(self) -> float:
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in self.model.parameters()]
        sumsq = sum(g.double().pow(2).sum() for g in local)
        if self.tp > 1:
            dist.all_reduce(sumsq, group=self.tp_group)
        return float(sumsq.sqrt())


def tp_logged_counts(case):
    """broken_tp's row (Rowwise's output, the head's input gradient, loss_parallel's three on every micro-step),
    and at the boundary the logged norm's one all-reduce over tp (on a one-rank tp group none reaches c10d)."""
    if case.mesh.tp > 1:
        return {"tp": CountRow("Colwise/Rowwise + loss parallel, norm", before={"all_reduce": 5},
                               boundary={"all_reduce": 6})}
    return {"tp": CountRow("Colwise/Rowwise + loss parallel, norm", before={"all_reduce": 3},
                           boundary={"all_reduce": 3})}


TP_METRICS = Metrics(names=("loss", "grad_norm", "lr", "rows"))


def _tp(cls, name):
    return adapter(data=classification(features=FEATURES, classes=CLASSES), mesh_axes=("dp", "tp"),
                   counts=tp_logged_counts, metrics=TP_METRICS, name=name)(cls)


tp_logged = _tp(TPLogged, "tp_logged")  # the control: must pass the mesh gate, metrics judged
replicated_counted_tp = _tp(ReplicatedCountedTP, "broken_mesh_metrics.replicated_counted_tp")


# -- data parallel (xtrain's trainers, one hook: _clip) -------------------------------------------------------

def _shard_norm(grads) -> torch.Tensor:
    """‖ this rank's local pieces ‖ (a DTensor's shard), not reduced over any rank."""
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))


class FSDP2ShardNorm(FSDP2Trainer):
    """Clips as xtrain does (torch's clip_grad_norm_ over the DTensors: the global norm), but logs the norm of
    this rank's shards, computed before clipping and never all-reduced."""

    def _clip(self):
        shard = _shard_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        super()._clip()
        return shard


class ClipBeforeReduction(DistAccumTrainer):
    """Each rank clips its own accumulated gradient (its own norm, its own coefficient) before the boundary
    all-reduce — the buckets are held until it has — and not after: the reduced gradient is a mean of
    differently scaled ones, not the big batch's gradient clipped once."""

    _clipped_local = False

    def _launch_ready(self):
        if self._clipped_local:  # hold every bucket until this rank's gradient is clipped
            super()._launch_ready()

    def _finish_boundary(self):
        self._local_norm = super()._clip()  # the views into `flat`: this rank's gradient, not yet reduced
        self._clipped_local = True
        try:
            super()._finish_boundary()
        finally:
            self._clipped_local = False

    def _clip(self):
        return self._local_norm if self.world > 1 else super()._clip()


class ClipCoefPerRank(DistAccumTrainer):
    """Clips the reduced gradient by max_norm / ‖this rank's 1/W of it‖ (the shard a ZeRO optimizer would own),
    that norm never all-reduced: each rank applies its own coefficient."""

    def _clip(self):
        if self.world == 1:
            return super()._clip()
        shard = torch.linalg.vector_norm(self.flat[:self.numel].chunk(self.world)[dist.get_rank(self.group)])
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, shard)
        return shard


fsdp2_shard_norm = xtrain.variant(FSDP2ShardNorm, xtrain.fsdp2)
clip_before_reduction = xtrain.variant(ClipBeforeReduction, xtrain.data_parallel)
clip_coef_per_rank = xtrain.variant(ClipCoefPerRank, xtrain.data_parallel)
