"""torchtitan's own train step (examples/torchtitan_train.py) through the harness: the big batch at world 1, and
FSDP2 over dp = 2 with its count row (it reduce-scatters every micro-step by design) and the one-rank big batch."""
import pytest

import verify
from verify import Case, Gate, GateFailure

# torchtitan 0.3.0 brings ~60 packages (datasets, wandb, tensorboard) and imports triton (286 MB): its own extra
pytest.importorskip("torchtitan", reason="torchtitan is not installed (the [torchtitan] extra)")
pytest.importorskip("triton", reason="torchtitan 0.3.0 imports triton (the [torchtitan] extra)")
pytestmark = pytest.mark.distributed  # a process group even at world 1: a one-rank pool


def _case(world):
    return Case(accum_steps=3, micro_batch=2, steps=2, world=world, seed=1, data_seed=2)


def test_torchtitan_train_step_is_the_big_batch_at_world_1():
    from examples.torchtitan_train import factory

    assert verify.check(Gate.EQUIVALENCE, factory, _case(1)).ratio < 1


def test_a_boundary_gradient_times_n_is_rejected():
    """The recipe's float64 reference starts from its float32 weights (drawn in float32, then cast): before, the
    float64 draws were other numbers, the big-batch error was O(1), and this bug passed at error / bound 0.28."""
    from planted.torchtitan_bugs import grads_times_n

    with pytest.raises(GateFailure, match=r"\[equivalence\] gradient \(step 0\) .*accumulation error 2\.000e\+00"):
        verify.check(Gate.EQUIVALENCE, grads_times_n, _case(1))


@pytest.mark.slow
def test_torchtitan_fsdp2_over_two_ranks_meets_its_count_row_and_the_big_batch():
    from examples.torchtitan_train import factory

    assert verify.check(Gate.DP_EQUIVALENCE, factory, _case(2)).ratio < 1


@pytest.mark.parametrize("op", ["loss_sum_not_mean", "count_from_first_micro"])
def test_a_reported_loss_mutant_is_rejected_on_the_selftests_padded_case(op):
    """The self-test's N=3 B=2 case, padded (rows 1 and 5 of window 0 without a valid target). The mutant's
    parameters match, its loss does not, so the loss's κ runs each row alone: before, the all-padding row reached
    torchtitan's guard ("Loss is not finite ... Stopping training") and the self-test counted an error."""
    from examples.torchtitan_train import factory
    from verify.selftest import OPERATORS, selftest_cases

    case = selftest_cases(factory)[0][1]
    with pytest.raises(GateFailure, match=r"\[equivalence\] loss of step 0"):
        verify.check(Gate.EQUIVALENCE, OPERATORS[op].apply(factory), case)
