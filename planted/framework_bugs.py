"""Planted bugs in the framework recipes (tests/harness/test_pull.py): the recipe as written, one line changed.
Each must be rejected, while the recipe itself passes the same case."""
from unittest import mock

import examples.hf_trainer as hf
import examples.lightning_trainer as lt
import verify


class _PerMicroBatchMean(hf.Trainer):
    """HF Trainer before 4.46 (and any model without **loss_kwargs): the model is not handed the window's
    label count, so each micro-batch's own token mean is taken, then ÷ N."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = False


class _OverNTwice(lt.Regressor):
    def training_step(self, batch, batch_idx):  # Lightning divides by accumulate_grad_batches itself
        return super().training_step(batch, batch_idx) / self.trainer.accumulate_grad_batches


def _lightning_over_n_twice(spec):
    with mock.patch.object(lt, "Regressor", _OverNTwice):
        return lt.factory.factory(spec)


hf_per_micro_batch_mean = verify.hf.trainer(_PerMicroBatchMean, model=hf.gpt2, args=hf.ARGS, data=hf.DATA,
                                            expected=(hf.BUFFERS,))
lightning_over_n_twice = lt.factory.replace(factory=_lightning_over_n_twice)
