"""Data-parallel gradient accumulation: micro-steps stay local, ONE all-reduce round at the boundary.

`DistAccumTrainer`: every p.grad is a view into one flat buffer (grads, then two loss slots that ride in the
last bucket); `sync = world > 1 and micro == N - 1` is the only line that communicates; the boundary divides
by W (tokens: by the global valid-token count, carried in the loss slots at no extra collective). W == 1 is
AccumTrainer's arithmetic, bit for bit. `TorchDDPTrainer`: the same schedule on torch DDP with `no_sync()`
around micro-steps 0..N-2, its loss in one 2-element all-reduce. `shard`: rank r's rows of a micro-batch.

The math, the buckets and the counts: docs/design/distributed.md ("Data parallel"); token weighting:
docs/design/numerics.md.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import OptimConfig
from .model import ce_mean, ce_sum
from .trainer import MicroSchedule, make_optimizer



def _rank0(group) -> int:
    """Global rank of the group's rank 0 (the broadcast source)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


class DistAccumTrainer(MicroSchedule):
    """xtrain's data-parallel accumulation (see the module docstring). `group`: None = the default group."""

    def __init__(self, model: nn.Module, optim: OptimConfig, accum_steps: int, *, group=None,
                 bucket_mb: float = 25.0, loss_norm: str = "mean", precision: str = "fp32",
                 init_scale: float = 2.0**16):
        self._setup(model, optim, accum_steps, loss_norm, precision, init_scale)
        self.group, self.world = group, dist.get_world_size(group)
        params = [p for p in model.parameters() if p.requires_grad]
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise ValueError("DistAccumTrainer needs every parameter on one device in one dtype")
        # Backward produces grads roughly in reverse registration order (head first, embeddings last):
        # laying `flat` out that way makes each bucket fill up in one piece during the last backward.
        order = params[::-1]
        self.numel = sum(p.numel() for p in order)  # P
        self.flat = torch.zeros(self.numel + 2, dtype=params[0].dtype, device=params[0].device)
        views, o = [], 0
        for p in order:
            views.append(self.flat[o:o + p.numel()].view_as(p))
            o += p.numel()
        if self.world > 1:  # every rank starts from rank 0's parameters: stage them in `flat`, one broadcast
            for p, v in zip(order, views):
                v.copy_(p.detach())
            dist.broadcast(self.flat, src=_rank0(group), group=group)
            with torch.no_grad():
                for p, v in zip(order, views):
                    p.copy_(v)
            self.flat.zero_()
        # Buckets: contiguous slices of `flat`, cut at parameter edges once ≥ bucket_mb; the last one
        # also carries the two loss slots. A hook per parameter counts the bucket's grads in.
        cap = max(1, int(bucket_mb * 2**20 / self.flat.element_size()))
        self.buckets: list[tuple[int, int]] = []  # [start, end) in elements of `flat`
        bucket_of, start, o = [], 0, 0
        for p in order:
            bucket_of.append(len(self.buckets))
            o += p.numel()
            if o - start >= cap:
                self.buckets.append((start, o))
                start = o
        if start < o or not self.buckets:
            self.buckets.append((start, o))
        self.buckets[-1] = (self.buckets[-1][0], self.numel + 2)
        self._members = [bucket_of.count(b) for b in range(len(self.buckets))]
        for p, v, b in zip(order, views, bucket_of):
            p.grad = v  # autograd now accumulates straight into `flat`
            p.register_post_accumulate_grad_hook(self._make_hook(b, v.data_ptr()))
        self._sync = False
        self._works: list = []
        self.opt, self.sched = make_optimizer(model, optim)

    # -- the boundary collective, overlapped with the last backward --------------------------------
    def _make_hook(self, bucket: int, ptr: int):
        # The hook lives on the parameter, the parameter in self.model: a strong reference back to self would
        # be a cycle (param -> hook -> trainer -> model -> param) that only the cyclic GC frees, so a dropped
        # trainer kept its flat buffer and AdamW state (4 x params) on the GPU until some later collection.
        # The 2xH200 memory-modes run found it: peak grew by that much with every configuration.
        trainer = weakref.ref(self)

        def ready(p: torch.Tensor) -> None:  # runs after autograd accumulated into p.grad
            self = trainer()
            if self is None or not self._sync:  # a trainer that is gone (the model lives on) does nothing
                return
            if p.grad is None or p.grad.data_ptr() != ptr:
                raise RuntimeError("a parameter's .grad is no longer its view into the trainer's flat buffer "
                                   "(model.zero_grad()/optimizer.zero_grad() set it to None?): the trainer owns the grads")
            self._left[bucket] -= 1
            self._launch_ready()
        return ready

    def _launch_ready(self) -> None:
        # Strictly in bucket order, so every rank issues the same sequence of collectives.
        while self._next_bucket < len(self.buckets) and self._left[self._next_bucket] == 0:
            s, e = self.buckets[self._next_bucket]
            self._works.append(dist.all_reduce(self.flat[s:e], op=dist.ReduceOp.SUM, group=self.group, async_op=True))
            self._next_bucket += 1

    # -- micro-steps ----------------------------------------------------------------------------
    def micro_step(self, idx: torch.Tensor, targets: torch.Tensor, micro: int) -> None:
        self._enter(micro)
        sync = self.world > 1 and micro == self.accum_steps - 1  # the only line that decides to communicate
        m = self.model
        objective = self._objective(m.loss_batched, m.loss_sum, idx, targets, micro, alone=self.world == 1)
        if sync:  # the step loss's numerator and denominator (tokens: the count), reduced with the grads
            self.flat[-2].copy_(self._num)
            if torch.is_tensor(self._den):
                self.flat[-1].copy_(self._den)
            else:
                self.flat[-1].fill_(float(self._den))
            self._left, self._next_bucket, self._works = list(self._members), 0, []
        self._sync = sync
        try:
            self._backward(objective)
        finally:
            self._sync = False
        self._next_micro = micro + 1
        if sync:
            self._finish_boundary()

    def _finish_boundary(self) -> None:
        for b in range(self._next_bucket, len(self.buckets)):
            self._left[b] = 0  # buckets holding parameters the graph did not use
        self._launch_ready()
        for w in self._works:
            w.wait()
        self._works = []
        if self.loss_norm == "mean":
            self.flat[:self.numel].div_(self.world)  # SUM over ranks -> mean over the global batch
        elif self.flat[-1] > 0:  # Σ_ranks Σ/(N·B_local·S) -> Σ over every rank's valid tokens / their count
            self.flat[:self.numel].mul_(self._positions / self.flat[-1])

    # -- the boundary ---------------------------------------------------------------------------
    def _finish(self) -> None:
        if self.world == 1:
            super()._finish()  # alone: AccumTrainer's arithmetic (the collective's work was done above)

    def _window_tokens(self) -> int | None:
        if self.loss_norm == "tokens" and self.world > 1:
            return int(self.flat[-1])
        return super()._window_tokens()

    def _window_count(self):
        return self.flat[-1].clone() if self.world > 1 else super()._window_count()

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step, schedule, zero. Returns the step loss: the mean CE over the global effective batch
        (tokens: over its valid tokens; NaN for a window without one)."""
        self._update()
        if self.world == 1:
            loss = self._step_loss()  # AccumTrainer's arithmetic
        else:
            loss = self.flat[-2] / self.flat[-1]  # Σ_ranks numerator / Σ_ranks denominator: a new tensor
        self._last_loss = loss
        self.flat.zero_()  # zero_grad: the grads are views, so one memset (never set them to None)
        self._reset_window()
        return loss


class RankAveraged(MicroSchedule):
    """The boundary of a wrapper that averages gradients over ranks itself (torch DDP, FSDP2): one 2-element
    all-reduce of the step loss's [numerator, denominator]; loss_norm="tokens" turns the wrapper's average
    over ranks into the global token mean with it."""

    group = None  # the process group of that all-reduce (None: the default group)

    def _finish(self) -> None:
        num = self._num
        den = self._den.to(num.dtype) if torch.is_tensor(self._den) else num.new_tensor(float(self._den))
        self._slots = torch.stack([num, den])  # in the loss's dtype: float64 runs stay float64
        dist.all_reduce(self._slots, group=self.group)  # [Σ_ranks numerator, Σ_ranks denominator]
        plain = self.accum_steps == 1 and self.world == 1
        if self.loss_norm == "tokens" and not plain:
            self._normalize(int(self._slots[1]), ranks=self.world)  # the wrapper averaged over ranks: ×W

    def _window_tokens(self) -> int | None:
        return int(self._slots[1]) if self.loss_norm == "tokens" else None

    def _window_count(self):
        return self._slots[1]

    def optimizer_step(self) -> torch.Tensor:
        self._update()
        self.opt.zero_grad(set_to_none=True)
        loss = self._last_loss = self._slots[0] / self._slots[1]
        self._reset_window()
        return loss


class TorchDDPTrainer(RankAveraged):
    """torch DistributedDataParallel; `no_sync()` wraps forward+backward of micro-steps 0..N-2.

    DDP decides at FORWARD whether the coming backward all-reduces (it arms its reducer there), so the
    context must cover the forward: wrapping only backward syncs every micro-step. The step loss needs
    one extra 2-element all-reduce at the boundary (DDP's buckets carry gradients only).
    """

    def __init__(self, model: nn.Module, optim: OptimConfig, accum_steps: int, *, group=None,
                 loss_norm: str = "mean", precision: str = "fp32", init_scale: float = 2.0**16):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self._setup(model, optim, accum_steps, loss_norm, precision, init_scale)
        self.group, self.world = group, dist.get_world_size(group)
        dev = next(model.parameters()).device
        # gradient_as_bucket_view: grads live in DDP's buckets, as in the plain-torch reference measurement
        self.ddp = DDP(model, process_group=group, device_ids=[dev] if dev.type == "cuda" else None,
                       gradient_as_bucket_view=True)
        self.opt, self.sched = make_optimizer(model, optim)

    def _forward_mean(self, idx, targets):
        return ce_mean(self.ddp(idx), targets)  # through the wrapper: this forward arms (or not) the reducer

    def _forward_sum(self, idx, targets):
        return ce_sum(self.ddp(idx), targets)

    def micro_step(self, idx: torch.Tensor, targets: torch.Tensor, micro: int) -> None:
        self._enter(micro)
        sync = micro == self.accum_steps - 1
        with contextlib.nullcontext() if sync else self.ddp.no_sync():
            objective = self._objective(self._forward_mean, self._forward_sum, idx, targets, micro,
                                        alone=self.world == 1)
            self._backward(objective)
        self._next_micro = micro + 1


# -- launch ----------------------------------------------------------------------------------------

def shard(idx: torch.Tensor, targets: torch.Tensor, accum_steps: int, rank: int, world: int):
    """One global step batch (N·W·B_local, S) -> this rank's N micro-batches of (B_local, S).

    Global micro-batch n is rows [n·W·B_local, (n+1)·W·B_local) (the single-process split into N),
    and rank r takes its B_local rows [r·B_local, (r+1)·B_local) of it: over all ranks and micro-steps
    the union is exactly the single-process big batch, in the same order.
    """
    rows = idx.shape[0]
    if rows % (accum_steps * world):
        raise ValueError(f"batch of {rows} sequences does not split into {accum_steps} micro-steps × {world} ranks")
    b = rows // (accum_steps * world)
    out = []
    for n in range(accum_steps):
        lo = (n * world + rank) * b
        out.append((idx[lo:lo + b], targets[lo:lo + b]))
    return out
