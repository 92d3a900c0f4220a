"""Declared size thresholds (verify.Threshold): bugs that live only past a size the toy cases never reach are run, and
the same trainers below it pass. DDP's bucket cap on examples/ddp_no_sync.py; the loss chunk of the Llama recipe is
tests/examples/test_llama_scale.py's."""
import pytest

import verify
from examples import ddp_no_sync
from planted import bucket_adapters

pytestmark = pytest.mark.distributed

CASE = verify.Case(accum_steps=3, micro_batch=2, steps=2, world=2, seed=1, data_seed=2)


def test_a_hook_averaging_only_the_first_bucket_passes_in_one_bucket_and_fails_past_the_cap():
    below, above = (CASE.replace(options=ddp_no_sync.bucket_side(None, side)) for side in (False, True))
    verify.check(verify.Gate.DP_EQUIVALENCE, bucket_adapters.first_bucket_only, below)  # one bucket: right
    with pytest.raises(verify.GateFailure) as e:
        verify.check(verify.Gate.DP_EQUIVALENCE, bucket_adapters.first_bucket_only, above)
    assert e.value.gate == verify.Gate.DP_EQUIVALENCE and "bucket_cap_mb=0.0001" in str(e.value)
    # the recipe itself passes on both sides, its boundary traffic a collective per bucket
    result = verify.check(verify.Gate.DP_EQUIVALENCE, ddp_no_sync.factory, above)
    assert result.gate == verify.Gate.DP_EQUIVALENCE
