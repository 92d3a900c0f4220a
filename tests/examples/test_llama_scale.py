"""The scale recipe at its tiny size, through the public door as a user's test would: the three gates
`verify.gpu_gate --scale` runs pass on a padded window, in both precisions it declares, and its per-micro token mean
is rejected by the equivalence gate (at 1.1B: reports/scale/)."""
import pytest

import verify
from examples import llama_scale
from planted import scale_adapters

pytestmark = pytest.mark.slow  # a recipe end to end: CI's tier

# one padded window per step: rows of every length, an empty row; the window's micro-batches hold unequal counts
CASE = verify.Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2,
                   lengths=(16, 2, 16, 0, 3, 16, 9, 16, 1, 16, 16, 5))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("gate", [verify.Gate.EQUIVALENCE, verify.Gate.BIT_EXACT, verify.Gate.REPORTED_METRICS])
def test_the_scale_gates_pass_on_the_tiny_size(gate, precision):
    result = verify.check(gate, llama_scale.factory, CASE.replace(precision=precision, options=llama_scale.Options()))
    assert result.gate == gate


def test_checkpointing_and_a_small_loss_chunk_change_nothing():
    options = llama_scale.Options(checkpointing=True, loss_chunk=5)  # chunks that split rows, recomputed blocks
    verify.check(verify.Gate.EQUIVALENCE, llama_scale.factory, CASE.replace(options=options))


def test_a_per_micro_token_mean_is_rejected():
    with pytest.raises(verify.GateFailure) as e:
        verify.check(verify.Gate.EQUIVALENCE, scale_adapters.tiny, CASE.replace(options=llama_scale.Options()))
    assert e.value.gate == verify.Gate.EQUIVALENCE and "step 0" in str(e.value)


def test_a_chunked_mean_right_within_one_chunk_is_rejected_only_past_the_declared_chunk():
    """NeMo Automodel #3803's shape (a chunked mean summing its chunks' means): every corner the recipe's defaults
    give passes (one chunk per micro-batch), so only the declared threshold's corner above it can reject it."""
    below, above = (CASE.replace(options=llama_scale.loss_chunk_side(None, side)) for side in (False, True))
    verify.check(verify.Gate.EQUIVALENCE, scale_adapters.chunk_means, below)
    verify.check(verify.Gate.EQUIVALENCE, scale_adapters.chunk_means, CASE.replace(options=llama_scale.Options()))
    with pytest.raises(verify.GateFailure) as e:
        verify.check(verify.Gate.EQUIVALENCE, scale_adapters.chunk_means, above)
    assert e.value.gate == verify.Gate.EQUIVALENCE
