"""DeepSpeed's engine (examples/deepspeed_zero.py) at each ZeRO stage on one case at world 2: its count row (what
the stage reduces, gathers and broadcasts before and at the boundary) holds, and the ranks' result is the big
batch's. bf16 with fp32 accumulation at stage 1 is the configuration of DeepSpeed PR #7985 (BF16_Optimizer, a
boundary micro-batch left out of the average in 0.18.6-0.18.9): the current release passes it here, and
benchmarks/frameworks.py proves the old ones rejected. DeepSpeed's Muon under ZeRO-3 (#8443, fixed in 0.19.8 by PR
#8600) is the release matrix's alone: its rows run the recipe's muon_zero3 through the plugin on 0.19.5 (rejected)
and the current release (passes); here it cost 60-100 s of CI."""
import importlib.util

import pytest

import verify
from verify import Case, Gate

# slow: every rank imports DeepSpeed (~5-10 s on 2 cores) and runs its engine end to end: CI, not the dev loop
pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed (the [examples] extra)")]


def _case(stage, precision="fp32", world=2):
    from examples.deepspeed_zero import Options

    return Case(accum_steps=3, micro_batch=2, steps=2, world=world, seed=1, data_seed=2, options=Options(stage=stage),
                precision=precision)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_meets_its_count_row_and_the_big_batch(stage):
    from examples.deepspeed_zero import factory

    r = verify.check(Gate.DP_EQUIVALENCE, factory, _case(stage))
    assert r.ratio < 1 and r.extra["comm"].steps, r
    assert verify.check(Gate.EQUIVALENCE, factory, _case(stage, world=1)).ratio < 1


def test_bf16_with_fp32_accumulation_at_stage_1_passes_on_this_release():
    from examples.deepspeed_zero import bf16

    assert verify.check(Gate.DP_EQUIVALENCE, bf16, _case(1, "bf16")).ratio < 1


@pytest.mark.parametrize("above", [False, True])
def test_zero3_on_both_sides_of_its_persistence_threshold_meets_its_row_and_the_big_batch(above):
    """Below the threshold (DeepSpeed's default) this model's parameters all persist; above it (0) every one is
    partitioned and gathered for each forward and backward: the row's all-gather range covers both, and both are the
    big batch's. The recipe declares it (verify.Threshold), so every gate runs its first corner on both sides."""
    from examples.deepspeed_zero import factory, persistence_side

    case = _case(3).replace(options=persistence_side(None, above))
    r = verify.check(Gate.DP_EQUIVALENCE, factory, case)
    step1 = next(iter(r.extra["comm"].steps.values()))[1]  # rank 0's step 1: past DeepSpeed's first-step set-up
    gathers = sum(c.op == "all_gather" for cs in step1.micro for c in cs)  # seen at 0.19.8: 0 below, 1 a micro-step above
    assert r.ratio < 1 and (gathers > 0) == above, (r, [[c.op for c in cs] for cs in step1.micro])
