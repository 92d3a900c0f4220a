"""A gradient zero in exact arithmetic (issue 42, item 2): an attention's key bias, whose float64 value is rounding
noise (~1e-18), is judged against the whole gradient (tolerance.param_scale), never relative to itself — in every
check that compares one parameter's gradient alone — while a real bug in one parameter is still rejected."""
import torch

from planted import zero_grad_adapters
from tests.helpers.honest_lm import lm
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure, check_equivalence, check_normaliser
from verify._internal.gates.tolerance import (EPS32, FLOOR, bound64, param_err, param_scale, rel_err, resolved,
                                              whole_norm)
from verify._internal.gates.tokens import _Runs, windows_case
from verify._internal.gates.windows import check_partial_sums
from verify._internal.verdict import Gate

# windows A and B of 3 rows: A padded as the normaliser gate pads it sums the key bias's noise in another order
CASE = Case(accum_steps=3, micro_batch=1, steps=2, seed=0, data_seed=0, lengths=(6, 3, 5, 6, 6, 2))


def test_the_scale_is_the_parameters_own_unless_it_is_zero_at_the_runs_resolution():
    noise = torch.full((8,), 1e-18)
    assert not resolved(noise, 1.0) and param_scale(noise, 1.0) == 1.0
    assert param_err(2 * noise, noise, 1.0) == (noise.double().norm() / 1.0).item()  # not 1.0: noise over noise
    small = torch.full((8,), 1e-4)  # a small but resolved gradient keeps its own scale: a ×2 on it is 100 % off
    assert resolved(small, 1.0) and param_err(2 * small, small, 1.0) == rel_err(2 * small, small) == 1.0
    edge = bound64(EPS32)  # the whole gradient's own float64 bound at κ = 1 draws the line
    assert not resolved(torch.tensor([edge]), 1.0) and resolved(torch.tensor([2 * edge]), 1.0)


def test_the_key_bias_gradient_is_noise_that_the_old_relative_rule_rejects():
    """Window A and A with rows without a valid target (the normaliser gate's padding check): the same token mean,
    so n·g must agree; the key bias's does only at noise level. Relative to itself its difference is O(1), over the
    largest bound any float64 floor gives; relative to the whole gradient it is far within eps32's."""
    r = _Runs(lm, windows_case(lm, CASE), "cpu")  # as the normaliser gate runs them: fresh float64 trainers
    pad, n = r.padded()
    a, p = r.run([(r.xa, r.ya)], CASE.accum_steps, Gate.NORMALISER), r.run([pad], n, Gate.NORMALISER)
    ga, gp, whole = a.grads0["k.bias"], p.grads0["k.bias"], whole_norm(a.grads0)
    assert ga.norm().item() < 1e-12 * whole  # zero in exact arithmetic: softmax ignores a query-wide shift
    assert rel_err(gp, ga) > bound64(FLOOR)  # the old rule: a false alarm whatever the twins measure
    assert param_err(gp, ga, whole) < 1e-3 * bound64(EPS32)
    assert param_err(p.grads0["q.bias"], a.grads0["q.bias"], whole) < bound64(EPS32)  # a resolved bias, unchanged


def test_the_honest_biased_attention_lm_passes_every_per_parameter_check():
    assert check_normaliser(lm, CASE).ratio < 1
    assert check_partial_sums(lm, CASE.replace(accum_steps=4, micro_batch=1, steps=1)).ratio < 1
    for precision in ("fp32", "bf16"):
        assert check_equivalence(lm, CASE.replace(precision=precision)).ratio < 1


def test_a_bug_in_one_parameter_is_still_rejected_by_the_per_parameter_checks():
    """×N on the query bias (its true gradient is nonzero): the fp32 step-0 check and the normaliser's float64
    additivity; the key bias given another's gradient (nonzero where it should be zero): judged against the whole."""
    for check, says in ((check_equivalence, "gradient (step 0) of 'q.bias': accumulation error 2.000e+00"),
                        (check_normaliser, "gradient of 'q.bias': relative error 5.000e-01")):
        try:
            check(zero_grad_adapters.bias_grad_times_n, CASE)
        except GateFailure as e:
            assert says in str(e), str(e)
        else:
            raise AssertionError(f"{check.__name__} passed a query bias whose gradient is ×N")
    try:
        check_equivalence(zero_grad_adapters.zero_grad_made_nonzero, CASE)
    except GateFailure as e:
        assert "of 'k.bias' (zero at the run's resolution: relative to the whole gradient)" in str(e), str(e)
        assert e.error > 100 * e.bound, str(e)
    else:
        raise AssertionError("a nonzero key-bias gradient passed")
