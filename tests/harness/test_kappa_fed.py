"""κ's runs feed the trainer blocks and rows of a window alone (gates/kappa.py): never one without a valid target
where the adapter declares empty_windows=False. The torchtitan row's two "errors" (loss_sum_not_mean and
count_from_first_micro on the self-test's N=3 B=2 K=2 case) were the loss κ running an all-padding row alone on
the unwrapped trainer, whose non-finite-loss guard stopped it; the mutants' own runs were finite."""
import math

import pytest
from tests.helpers.guarded_lm import guarded, last_micro
from verify._internal.cases.case import Case
from verify._internal.cases.case import Trace
from verify._internal.gates import check_equivalence
from verify._internal.gates.metrics import check_metrics
from verify._internal.gates.kappa import block_runs, loss_blocks, loss_condition
from verify._internal.gates.metrics_bounds import loss_kappa
from verify._internal.verdict import GateFailure
from verify.selftest import OPERATORS, run_selftest, selftest_cases

CASE = selftest_cases(guarded)[0][1]  # N=3 B=2 K=2, padded: rows 1 and 5 of window 0 hold no valid target


def test_the_case_holds_rows_and_a_micro_batch_without_a_valid_target():
    assert CASE.accum_steps == 3 and CASE.lengths[:6] == (8, 0, 2, 8, 4, 0)
    # the N=4 B=1 case: micro-batches of one row, some empty
    assert 0 in selftest_cases(guarded)[0][2].lengths[:4]


def test_loss_blocks_leave_out_the_rows_it_cannot_feed():
    """Before: the row without a valid target ran alone and the trainer's guard raised (RuntimeError)."""
    losses = loss_blocks(guarded, CASE, "cpu", 0, rows=True)
    assert len(losses) == 3 + 6  # the three blocks, then each row of each
    empty = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    assert empty == [3 + 1, 3 + 5]  # rows 1 and 5, NaN: undefined, in their places
    assert 1.0 < loss_condition(losses, 1.0) < math.inf  # the others still set κ


EMPTY_MICRO = selftest_cases(guarded)[0][2]  # N=4 B=1: micro-batch 1 of window 0 is one all-padding row


def test_block_runs_keep_an_empty_micro_batch_in_its_place_without_running_it():
    _, y = EMPTY_MICRO.batches(guarded)[0]
    assert [int((r != -100).sum()) for r in y] == [8, 0, 2, 8]
    runs = block_runs(guarded, EMPTY_MICRO, "cpu")
    assert len(runs) == 4 and runs[1].grads0 == {} and math.isnan(runs[1].losses[0])  # no term of the sums
    assert all(runs[i].grads0 and math.isfinite(runs[i].losses[0]) for i in (0, 2, 3))


def test_the_metrics_loss_kappa_leaves_out_an_empty_micro_batch():
    whole = Trace(losses=[2.0], grads0={}, params=[])  # step 0's window loss (k = 0 reads it from the big batch)
    kappa = loss_kappa(guarded, EMPTY_MICRO, "cpu", EMPTY_MICRO.batches(guarded), 0, whole)
    assert math.isfinite(kappa) and kappa > 1.0  # Σ of the three micro-batches' |loss| / 2


@pytest.mark.parametrize("op", ["loss_sum_not_mean", "count_from_first_micro"])
def test_a_mutant_of_the_reported_loss_is_killed_not_an_error(op):
    """Its float64 parameters agree with the big batch's while its loss does not: the loss's κ is measured, over
    the window's blocks and rows. Before the fix that raised RuntimeError (the guard) instead of the verdict."""
    check_equivalence(guarded, CASE)  # the unwrapped trainer passes this case
    with pytest.raises(GateFailure) as e:
        check_equivalence(OPERATORS[op].apply(guarded), CASE)
    assert "loss of step 0" in str(e.value), str(e.value)


def test_the_selftest_kills_both_without_errors():
    res = run_selftest(guarded, operators=["loss_sum_not_mean", "count_from_first_micro"])
    assert res.errors == [] and res.baseline_ok, res.error_lines()
    assert res.killed == ["loss_sum_not_mean", "count_from_first_micro"], res.table()


def test_a_last_micro_loss_is_not_learned_by_running_an_empty_micro_batch_alone():
    """Metrics(loss="last_micro"): the harness runs the last micro-batch alone for the value to expect. Where it holds
    no valid target it is not run (before: the guard raised), and the report says that loss was not checked."""
    case = Case(accum_steps=2, micro_batch=1, steps=1, seed=1, data_seed=2, lengths=(8, 0))
    r = check_metrics(last_micro, case)
    assert "holds no valid target" in r.extra["metrics_unchecked"]["loss"], r.extra
    full = check_metrics(last_micro, case.replace(lengths=(8, 5)))  # one that holds some: judged
    assert "loss" not in full.extra["metrics_unchecked"] and full.extra["metrics_checked"]["loss"], full.extra


def test_the_uneven_diagnosis_runs_no_rank_without_a_valid_target_alone():
    """gates/uneven.py names equal rank weights by each rank's own mean: a rank holding no valid target has none, and
    the trainer is not run on its rows (the guard would raise inside a failure's diagnosis)."""
    from types import SimpleNamespace

    from verify._internal.gates.uneven import rank_grads_job

    case = Case(accum_steps=1, micro_batch=1, steps=1, seed=1, data_seed=2, world=2, lengths=(8, 0))
    own = rank_grads_job(SimpleNamespace(device="cpu"), guarded, case)
    assert own[0] and own[1] is None
