"""Deliberately broken data-parallel trainers. Each reproduces a bug users hit; the distributed gates
must reject every one, with a message naming the micro-step and the collective.

Each subclasses xtrain's DistAccumTrainer or TorchDDPTrainer and changes one thing. The four
over-syncing variants are numerically CORRECT (averaging is linear: avg(avg(a) + b) = avg(a) + avg(b)),
so only the collective counter can catch them — three of them on the paths CommDebugMode cannot see.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from xtrain_core.distributed import DistAccumTrainer, TorchDDPTrainer


class _OverSync(DistAccumTrainer):
    """Correct boundary, plus an extra all-reduce + /W of the gradient buffer after micro-steps 0..N-2."""

    def micro_step(self, idx, targets, micro):
        super().micro_step(idx, targets, micro)
        if self.world > 1 and micro < self.accum_steps - 1:
            grads = self.flat[:self.numel]
            self._reduce(grads)
            grads.div_(self.world)

    def _reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)


class AllReduceEveryMicro(_OverSync):
    """All-reduce after every micro-step (no no_sync): N× the traffic, same numbers."""


class AllReduceInHelperThread(_OverSync):
    """The early all-reduce hidden in a helper thread (invisible to CommDebugMode)."""

    def _reduce(self, t):
        th = threading.Thread(target=dist.all_reduce, args=(t,), kwargs=dict(group=self.group), name="prefetch-sync")
        th.start()
        th.join()


class AllReduceOnBackendObject(_OverSync):
    """The early all-reduce called on the c10d backend object directly, bypassing torch.distributed."""

    def _reduce(self, t):
        group = self.group or dist.group.WORLD
        group._get_backend(t.device).allreduce([t]).wait()


class AllReduceOnPrivateGroup(_OverSync):
    """The early all-reduce on a private process group the trainer made for itself."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._private = dist.new_group(list(range(dist.get_world_size())))

    def _reduce(self, t):
        dist.all_reduce(t, group=self._private)


class NoAllReduce(DistAccumTrainer):
    """Never communicates: every rank steps on its own shard's gradient (and its own loss)."""

    def _launch_ready(self):
        self._next_bucket = len(self.buckets)

    def _finish_boundary(self):
        self._works = []


class DivideByWorldTwice(DistAccumTrainer):
    """/W applied twice (e.g. loss pre-divided by W and the reduced sum averaged again)."""

    def _finish_boundary(self):
        super()._finish_boundary()
        self.flat[:self.numel].div_(self.world)


class ReduceSomeParams(DistAccumTrainer):
    """Reduces only the transformer blocks' gradients (one call per parameter); embeddings, final norm
    and head stay local."""

    def _launch_ready(self):
        self._next_bucket = len(self.buckets)

    def _finish_boundary(self):
        self._works = []
        for p in self.model.blocks.parameters():
            dist.all_reduce(p.grad, group=self.group)
            p.grad.div_(self.world)


class DDPSyncFlagAfterForward(TorchDDPTrainer):
    """build-nanogpt PR #30: `require_backward_grad_sync = micro == last` set between forward and
    backward. DDP arms its reducer at FORWARD, from the flag's previous value: micro-step 0 syncs, the
    last one does not."""

    def micro_step(self, idx, targets, micro):
        self._enter(micro)
        n = self.accum_steps
        logits = self.ddp(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.ddp.require_backward_grad_sync = micro == n - 1  # too late: the forward already decided
        (loss if n == 1 else loss * (1.0 / n)).backward()
        self._account(loss.detach(), idx.shape[0], micro)


class DDPNoSyncAroundBackwardOnly(TorchDDPTrainer):
    """`with ddp.no_sync(): loss.backward()` with the forward outside: syncs every micro-step."""

    def micro_step(self, idx, targets, micro):
        self._enter(micro)
        n = self.accum_steps
        logits = self.ddp(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        if micro < n - 1:
            with self.ddp.no_sync():
                (loss * (1.0 / n)).backward()
        else:
            (loss if n == 1 else loss * (1.0 / n)).backward()
        self._account(loss.detach(), idx.shape[0], micro)


def _factory(cls):
    def make(spec):
        return cls(spec.build_model(), spec.optim, spec.accum_steps)

    make.__name__ = make.__qualname__ = f"make_{cls.__name__}"
    return make


# Factories must pickle by name for the pool: module-level names, one per broken trainer.
make_AllReduceEveryMicro = _factory(AllReduceEveryMicro)
make_AllReduceInHelperThread = _factory(AllReduceInHelperThread)
make_AllReduceOnBackendObject = _factory(AllReduceOnBackendObject)
make_AllReduceOnPrivateGroup = _factory(AllReduceOnPrivateGroup)
make_NoAllReduce = _factory(NoAllReduce)
make_DivideByWorldTwice = _factory(DivideByWorldTwice)
make_ReduceSomeParams = _factory(ReduceSomeParams)
make_DDPSyncFlagAfterForward = _factory(DDPSyncFlagAfterForward)
make_DDPNoSyncAroundBackwardOnly = _factory(DDPNoSyncAroundBackwardOnly)

# name -> (factory, what the rejection message must contain: the micro-step and the collective)
BROKEN_DIST = {
    "all_reduce_every_micro_step": (make_AllReduceEveryMicro, r"micro-step 0 of \d+: 1 gradient collective\(s\) before the boundary: \S+:all_reduce"),
    "all_reduce_in_helper_thread": (make_AllReduceInHelperThread, r"micro-step 0 of \d+: .*all_reduce"),
    "all_reduce_on_backend_object": (make_AllReduceOnBackendObject, r"micro-step 0 of \d+: .*all_reduce"),
    "all_reduce_on_private_group": (make_AllReduceOnPrivateGroup, r"micro-step 0 of \d+: .*all_reduce.* process group [1-9]"),
    "no_all_reduce": (make_NoAllReduce, r"boundary \(micro-step \d+ of \d+, .*\): no gradient all-reduce"),
    "divide_by_world_twice": (make_DivideByWorldTwice, r"gradient \(step 0\) of .*: error .* the boundary's collectives \(step 0, micro-step \d+ of \d+ .*\): \S+:all_reduce"),
    "reduce_some_params": (make_ReduceSomeParams, r"boundary \(micro-step \d+ of \d+, .*\): gradient collectives cover \d+ of \d+ gradient elements"),
    "ddp_sync_flag_after_forward": (make_DDPSyncFlagAfterForward, r"micro-step 0 of \d+: \d+ gradient collective\(s\) before the boundary: \S+:all_reduce"),
    "ddp_no_sync_around_backward_only": (make_DDPNoSyncAroundBackwardOnly, r"micro-step 0 of \d+: \d+ gradient collective\(s\) before the boundary: \S+:all_reduce"),
}
