"""Adapters whose runs ERROR (an exception, not a gate's rejection) on some of the self-test's cases: the
self-test must report each as an error with its cause, never count it as a kill (verify/selftest)."""
import time

import torch.distributed as dist

import verify
from examples import ddp_no_sync
from examples.mlp_regressor import Plain, Trainer

_regression = verify.data.regression(features=8)


def _needs_checkpoint(spec):
    """A factory that raises for accum_steps ≥ 3: the checkpoint it loads for those does not exist."""
    if spec.accum_steps >= 3:
        raise FileNotFoundError(f"no checkpoint for accum_steps={spec.accum_steps}: ckpt/accum{spec.accum_steps}.pt")
    return Trainer(spec)


missing_checkpoint = verify.adapter(data=_regression, plain=Plain)(_needs_checkpoint)


def _five_rows_at_most(rows, seed):
    """A data maker whose dataset holds five rows: asked for more, it returns five (the wrong rows)."""
    x, y = _regression(rows, seed)
    return x[:5], y[:5]


short_data = verify.adapter(data=_five_rows_at_most, plain=Plain)(Trainer).replace(
    ref="tests.helpers.erring_adapters:short_data")


class HangsOnRank1(ddp_no_sync.Trainer):
    """A correct DDP trainer whose rank 1 hangs in micro-step 0 at world 2 (a stuck data loader, say): the
    pool's job times out (XTRAIN_DIST_TIMEOUT)."""

    def micro_step(self, x, y, micro):
        if dist.get_world_size() == 2 and dist.get_rank() == 1 and micro == 0:
            time.sleep(600)
        return super().micro_step(x, y, micro)


hangs = ddp_no_sync.factory.replace(factory=HangsOnRank1, ref="tests.helpers.erring_adapters:hangs")


class UpToThree(Trainer):
    """A correct trainer that supports accum_steps ≤ 3 only (the self-test's N=4 case errs on it, and so does a
    mutant that builds it with N + 1)."""

    def __init__(self, spec):
        if spec.accum_steps > 3:
            raise ValueError(f"this trainer supports accum_steps ≤ 3, got {spec.accum_steps}")
        super().__init__(spec)


up_to_three = verify.adapter(data=_regression, plain=Plain)(UpToThree).replace(
    ref="tests.helpers.erring_adapters:up_to_three")
