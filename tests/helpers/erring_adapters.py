"""Adapters whose runs ERR (raise something other than a gate's verdict), for the self-test: a crash proves
nothing about the gates, so it must be reported as an error with its cause, never counted as a kill
(tests/harness/test_selftest_errors.py)."""
import torch

import verify
from examples.mlp_regressor import Plain, Trainer

_data = verify.data.regression(features=8)


def missing_checkpoint(spec):
    """A factory that loads a file that is not there (a user's checkpoint path)."""
    with open("/nonexistent/xtrain-selftest/checkpoint.pt", "rb") as f:  # raises FileNotFoundError
        return torch.load(f)


def short_rows(rows: int, seed: int):
    """A data maker that returns one row fewer than asked for."""
    x, y = _data(rows, seed)
    return x[:-1], y[:-1]


class Correct(Trainer):
    """The MLP example's correct trainer, defined here (an adapter is found by its factory's module)."""


raises_in_factory = verify.adapter(data=_data)(missing_checkpoint)
wrong_rows = verify.adapter(data=short_rows, plain=Plain)(Correct)


class SlowOnRanks(Trainer):
    """Sleeps in every micro-step on a rank of a process group: its data-parallel jobs outlive a small timeout
    (its one-process runs, in this process, do not sleep)."""

    def micro_step(self, x, y, micro):
        import time

        import torch.distributed as dist

        if dist.is_initialized():
            time.sleep(3)
        return super().micro_step(x, y, micro)


slow_on_ranks = verify.adapter(data=_data, data_parallel=True)(SlowOnRanks)
