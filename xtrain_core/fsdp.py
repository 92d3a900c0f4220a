"""Accumulation under FSDP2 (torch.distributed.fsdp.fully_shard): one FSDP unit per transformer block plus
the root (embeddings, final norm, head), parameters and gradients sharded over the W ranks.

`model.set_requires_gradient_sync(micro == N - 1)` before each forward is the gate: micro-steps 0..N-2
accumulate unsharded gradients locally, micro-step N-1 reduce-scatters each unit once. reshard_after_forward
picks 2 or 1 all-gathers per unit per micro-step. The step loss travels in one 2-element all-reduce (tokens:
it turns FSDP2's average into the global token mean). No fp16 (GradScaler cannot agree across shards).

Why, the counts and the measurements: docs/design/distributed.md ("FSDP2"); memory per mode:
docs/design/memory.md.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import OptimConfig
from .distributed import RankAveraged
from .trainer import make_optimizer


class FSDP2Trainer(RankAveraged):
    """xtrain's GPT under FSDP2 with set_requires_gradient_sync as the accumulation gate."""

    def __init__(self, model: nn.Module, optim: OptimConfig, accum_steps: int, *, reshard_after_forward: bool = True,
                 loss_norm: str = "mean", precision: str = "fp32", init_scale: float = 2.0**16, group=None):
        from torch.distributed.fsdp import fully_shard

        if precision == "fp16":
            raise ValueError("precision fp16 is not offered under FSDP2 (its GradScaler would not agree on inf/NaN "
                             "across gradient shards); use bf16 or fp32")
        if group is not None:
            raise ValueError("FSDP2Trainer shards over the default process group")
        self._setup(model, optim, accum_steps, loss_norm, precision, init_scale)
        self.world = dist.get_world_size()
        for block in model.blocks:  # one unit per block: its all-gather / reduce-scatter overlap the next's
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)  # the root: everything else
        self.opt, self.sched = make_optimizer(model, optim)  # AdamW over this rank's shards

    def micro_step(self, idx: torch.Tensor, targets: torch.Tensor, micro: int) -> None:
        self._enter(micro)
        self.model.set_requires_gradient_sync(micro == self.accum_steps - 1)  # before the forward that uses it
        m = self.model
        self._backward(self._objective(m.loss_batched, m.loss_sum, idx, targets, micro, alone=self.world == 1))
        self._next_micro = micro + 1

    def _clip(self):
        """Without clipping, the logged norm must not cost a collective at the boundary (FSDP2's count row has
        none there): this rank's Σ g² over its shards now, their all-reduce when metrics() reads it."""
        if self.cfg.max_grad_norm is not None:
            return super()._clip()  # clip_grad_norm_ over DTensors: the row's one norm all-reduce
        local = torch.stack([g.detach().double().pow(2).sum() for g in self._grads_list()]).sum()

        def norm() -> torch.Tensor:
            total = local.clone()
            dist.all_reduce(total)  # the shards partition every parameter: their sum is the whole gradient's
            return total.sqrt()

        return norm

    def _grads_list(self) -> list[torch.Tensor]:
        return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                for p in self.model.parameters() if p.grad is not None]

    def grads(self) -> dict[str, torch.Tensor]:
        """Full gradients (all-gathered from the shards: the harness reads them; training never does)."""
        self._require_boundary("grads")
        self._finish_window()
        return {k: p.grad.full_tensor() for k, p in self.model.named_parameters() if p.grad is not None}

    def params(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().full_tensor() for k, p in self.model.named_parameters()}
