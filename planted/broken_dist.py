"""Deliberately broken data-parallel trainers. Each reproduces a bug users hit; the distributed gates
must reject every one, with a message naming the micro-step and the collective.

Each subclasses xtrain's DistAccumTrainer or TorchDDPTrainer and changes one thing. The four
over-syncing variants are numerically CORRECT (averaging is linear: avg(avg(a) + b) = avg(a) + avg(b)),
so only the collective counter can catch them — three of them on the paths CommDebugMode cannot see.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import torch.distributed as dist

from xtrain_core.distributed import DistAccumTrainer, TorchDDPTrainer

from xtrain_proof import adapters as xtrain
from planted.broken import Tripled
from planted.template import Planted, SyncSwitch


class _OverSync(Planted, DistAccumTrainer):
    """Correct boundary, plus an extra all-reduce + /W of the gradient buffer after micro-steps 0..N-2."""

    def between(self, micro):
        if self.world > 1:
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


class DDPSyncFlagAfterForward(SyncSwitch, TorchDDPTrainer):
    """build-nanogpt PR #30: `require_backward_grad_sync = micro == last` set between forward and
    backward. DDP arms its reducer at FORWARD, from the flag's previous value: micro-step 0 syncs, the
    last one does not."""

    def switch(self, micro, at):
        if at == "backward":  # too late: the forward already decided
            self.ddp.require_backward_grad_sync = micro == self.accum_steps - 1


class DDPNoSyncAroundBackwardOnly(SyncSwitch, TorchDDPTrainer):
    """`with ddp.no_sync(): loss.backward()` with the forward outside: syncs every micro-step."""

    def backward_context(self, micro):
        return self.ddp.no_sync() if micro < self.accum_steps - 1 else contextlib.nullcontext()


class BroadcastParamsEveryMicro(Planted, DistAccumTrainer):
    """Re-broadcasts the parameters from rank 0 after every micro-step 0..N-2 ("keep ranks in sync, to
    be safe"). Numerically invisible (they are equal already) and a full model of traffic per micro-step;
    before the hole was closed a broadcast before the boundary was filed as "other" and passed."""

    def between(self, micro):
        if self.world > 1:
            for p in self.model.parameters():
                dist.broadcast(p.data, src=0, group=self.group)


class IntViewChecksumEveryMicro(Planted, DistAccumTrainer):
    """All-reduces the gradient buffer's bytes viewed as int32 (a "checksum" of a copy, result discarded)
    after every micro-step 0..N-2. Numerically invisible; integer traffic used to be filed as metadata."""

    def between(self, micro):
        if self.world > 1:
            dist.all_reduce(self.flat[:self.numel].clone().view(torch.int32), group=self.group)


class DiesMidStep(Planted, DistAccumTrainer):
    """Rank 1 ends its process (os._exit(17), no reply, no clean-up) at its second micro-step in that process:
    mid-step when N ≥ 2, at step 1 otherwise. In a launched world (verify.run) torchrun's failure handling
    must end every agent, with stacks and a non-zero exit (tests/examples/test_launcher.py)."""

    micro_steps_here = 0  # across the trainers one process builds (a pool rank or a launched rank)

    def before(self, idx, targets, micro):
        if self.world > 1 and dist.get_rank() == 1:
            DiesMidStep.micro_steps_here += 1
            if DiesMidStep.micro_steps_here == 2:
                os._exit(17)


class IgnoresSpecGroup(DistAccumTrainer):
    """Declares subgroups (its base does) but drops spec.group: it reduces over the default group whatever the
    harness gives it. Only a launched sub-world shows it (verify.run): the ranks ≥ W never join that collective;
    the harness names the cause once c10d's timeout fires (tests/harness/test_launched_pool.py)."""

    def __init__(self, *a, group=None, **k):
        super().__init__(*a, **k)


class DistTripled(Tripled, DistAccumTrainer):
    pass


def make_other_reference(spec):
    """xtrain's data-parallel trainer, right in float32, whose float64 build computes 3× the loss (the reference at
    one rank as the ranks' gradients' judge): the big batch is 0.667 from it, so every step-0 bound admitted anything."""
    cls = DistTripled if spec.dtype == torch.float64 else DistAccumTrainer
    group = {} if spec.group is None else dict(group=spec.group)
    return cls(xtrain.model_for(spec), xtrain.options_of(spec).optim, spec.accum_steps, **group, **xtrain.numerics(spec))


def _adapter(cls, base=xtrain.data_parallel):
    return xtrain.variant(cls, base)


# Module-level names: a pool imports each adapter by name.
all_reduce_every_micro = _adapter(AllReduceEveryMicro)
all_reduce_in_helper_thread = _adapter(AllReduceInHelperThread)
all_reduce_on_backend_object = _adapter(AllReduceOnBackendObject)
# it makes a group of its own, and new_group is collective over the whole world: no launched sub-worlds for it
all_reduce_on_private_group = _adapter(AllReduceOnPrivateGroup, xtrain.data_parallel.replace(subgroups=False))
no_all_reduce = _adapter(NoAllReduce)
divide_by_world_twice = _adapter(DivideByWorldTwice)
reduce_some_params = _adapter(ReduceSomeParams)
broadcast_params_every_micro = _adapter(BroadcastParamsEveryMicro)
int_view_checksum_every_micro = _adapter(IntViewChecksumEveryMicro)
dies_mid_step = _adapter(DiesMidStep)
other_reference = xtrain.data_parallel.replace(factory=make_other_reference, name="broken: float64 of another objective",
                                               precisions=("fp32",))  # under autocast only said unjudged
ignores_spec_group = _adapter(IgnoresSpecGroup)
ddp_sync_flag_after_forward = _adapter(DDPSyncFlagAfterForward, xtrain.torch_ddp)
ddp_no_sync_around_backward_only = _adapter(DDPNoSyncAroundBackwardOnly, xtrain.torch_ddp)

# Which gate must reject each, and what its message must say: planted.py.


# -- FSDP2 ------------------------------------------------------------------------------------------------

from xtrain_core.fsdp import FSDP2Trainer  # noqa: E402


class FSDP2SyncAlways(SyncSwitch, FSDP2Trainer):
    """set_requires_gradient_sync never turned off: every micro-step reduce-scatters every unit."""

    def switch(self, micro, at):
        if at == "forward":
            self.model.set_requires_gradient_sync(True)


class FSDP2SwitchAfterForward(SyncSwitch, FSDP2Trainer):
    """The sync switch set between forward and backward (the build-nanogpt placement)."""

    def switch(self, micro, at):
        if at == "backward":
            self.model.set_requires_gradient_sync(micro == self.accum_steps - 1)


class FSDP2SwitchAfterBackward(SyncSwitch, FSDP2Trainer):
    """The sync switch set AFTER the backward it was meant for: each micro-step runs with the previous
    one's setting (micro-step 0 with FSDP2's default, sync on; the boundary with sync off)."""

    def switch(self, micro, at):
        if at == "after":
            self.model.set_requires_gradient_sync(micro == self.accum_steps - 1)


class FSDP2StepsEmptyWindows(FSDP2Trainer):
    """loss_norm="tokens": a window without a valid token stepped like any other (clip, AdamW and the
    schedule on a zero gradient): momentum and weight decay move the parameters on no data. Its boundary
    sends the clip all-reduce the count row's `skipped` field takes out of such a step."""

    def _window_tokens(self):
        tokens = super()._window_tokens()
        return None if tokens == 0 else tokens  # never "empty": _update always steps


fsdp2_sync_always = _adapter(FSDP2SyncAlways, xtrain.fsdp2)
fsdp2_steps_empty_windows = _adapter(FSDP2StepsEmptyWindows, xtrain.fsdp2_tokens)
fsdp2_switch_after_forward = _adapter(FSDP2SwitchAfterForward, xtrain.fsdp2)
fsdp2_switch_after_backward = _adapter(FSDP2SwitchAfterBackward, xtrain.fsdp2)
