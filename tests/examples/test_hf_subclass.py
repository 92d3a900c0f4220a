"""verify.hf.trainer: any transformers.Trainer subclass proven with one call (issue 45). The recipes built on it
(HF's Trainer, TRL's SFTTrainer with its own collator and compute_loss) pass the equivalence and normaliser gates on
a padded case; a subclass whose compute_loss drops num_items_in_batch (each micro-batch's own token mean: the shape
of the downstream trainers' bug) is rejected by the same one call; bad arguments get one line naming the field."""
import importlib
import importlib.util

import pytest
from tests.helpers.tiers import imports_framework

import verify
from verify import Case, Gate, GateFailure, check

pytestmark = [imports_framework, pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                                      reason="trl not installed (the [examples] extra)")]
# padded: the micro-batches hold 3, 0 and 8 valid targets, where a per-micro-batch mean parts from the token mean
PADDED = Case(accum_steps=3, micro_batch=1, steps=1, seed=1, data_seed=2, lengths=(3, 0, 8))


def _recipe(name):
    return importlib.import_module(f"examples.{name}").factory


@pytest.mark.parametrize("name", ["hf_trainer", "trl_sft"])
def test_a_subclass_proven_by_one_call_passes_on_padded_windows(name):
    adapter = _recipe(name)
    assert adapter.name.endswith(f"verify.hf.trainer({'SFTTrainer' if name == 'trl_sft' else 'Trainer'})")
    for gate in (Gate.EQUIVALENCE, Gate.NORMALISER):
        check(gate, adapter, PADDED)


def _per_micro_mean():
    from transformers import Trainer

    class PerMicroMean(Trainer):
        """A custom compute_loss that drops num_items_in_batch: HF then divides each micro-batch's own mean by N."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    return PerMicroMean


def test_a_subclass_with_a_per_micro_batch_mean_is_rejected():
    hf = importlib.import_module("examples.hf_trainer")
    broken = verify.hf.trainer(_per_micro_mean(), model=hf.gpt2, data=verify.data.causal_lm(vocab=hf.VOCAB,
                                                                                          seq_len=hf.SEQ))
    with pytest.raises(GateFailure, match=r"\[equivalence\] loss of step 0"):
        check(Gate.EQUIVALENCE, broken, PADDED)


@pytest.mark.parametrize("call, field", [
    (dict(cls=dict, model=lambda spec: None), "cls="),
    (dict(model=None), "model="),
    (dict(model=lambda spec: None, logged=("loss", "perplexity")), "logged="),
    (dict(model=lambda spec: None, train_dataset=[]), "train_dataset="),
    (dict(model=lambda spec: None, args=dict(learning_rate=1e-3)), "args="),
    (dict(model=lambda spec: None, rows=lambda x, y: {}, batch=lambda x, y: {}), "rows="),
])
def test_bad_arguments_get_one_line_naming_the_field(call, field):
    from transformers import Trainer

    call = {"cls": Trainer, **call}
    with pytest.raises((TypeError, ValueError), match=rf"^verify\.hf\.trainer: .*{field}") as e:
        verify.hf.trainer(call.pop("cls"), **call)
    assert "\n" not in str(e.value)
