"""The normaliser gate (verify/_internal/gates/objective.py) on one correct trainer per declared normaliser, drawn
cases included, and the declarations around it: a per-micro-batch term, Spec.terms, bad declarations."""
import pytest
from tests.helpers.tiers import dev_first
from hypothesis import given, settings

import verify
from planted import objective_adapters as oa
from planted.registry import OBJECTIVE
from verify._internal.cases.strategies import cases
from verify._internal.gates import GateFailure, GateSkipped, check_equivalence, check_normaliser
from verify._internal.objective import non_equivalences, window_terms
from verify._internal.report import coverage

CORRECT = ["token_mean", "seq_mean", "seq_sum", "summed", "row_mean", "two_terms"]


@pytest.mark.parametrize("name", dev_first(CORRECT))
def test_each_correct_normaliser_passes_on_drawn_windows(name):
    adapter = getattr(oa, name)

    @settings(max_examples=3, deadline=None)
    @given(case=cases(adapter, max_accum=4, max_micro_batch=2, min_steps=2, max_steps=2,
                      padded=adapter.ignore_index is not None, some_padding=True))
    def normaliser(case):
        r = check_normaliser(adapter, case)
        assert r.ratio < 1 and r.extra["terms"] == dict(adapter.objective.terms), r

    normaliser()


def test_the_corner_window_checks_every_declared_term():
    r = check_normaliser(oa.two_terms, OBJECTIVE)
    assert r.extra["terms"] == {"ce": "token_mean", "z": "row_mean"} and r.extra["valid"] == (17, 16), r


def test_a_per_micro_term_is_checked_as_one_and_left_out_of_the_big_batch():
    micro = oa.z_per_micro
    assert window_terms(micro) == ("ce",) and window_terms(oa.two_terms) is None
    assert check_normaliser(micro, OBJECTIVE).ratio < 1
    assert check_equivalence(micro, OBJECTIVE.replace(terms=window_terms(micro))).ratio < 1
    with pytest.raises(GateFailure, match=r"term 'z' \(row_mean.*per micro-batch: window A at N=3 vs the mean of its 3 "
                                          r"micro-batches, each alone"):
        check_normaliser(oa.z_per_micro_over_n_twice, OBJECTIVE)
    lines, last = coverage({}, micro.declarations())
    assert non_equivalences(micro.declarations()["objective"]) == [lines[-1]]
    assert lines[-1].startswith("term 'z' vs the big batch: declared per micro-batch"), last


def test_the_cases_of_a_per_micro_objective_leave_the_term_out():
    @settings(max_examples=2, deadline=None)
    @given(case=cases(oa.z_per_micro))
    def drawn(case):
        assert case.terms == ("ce",) and case.spec().terms == ("ce",)

    drawn()


def test_an_undeclared_row_mean_is_skipped_saying_how_to_declare_it():
    from examples.mlp_regressor import factory

    with pytest.raises(GateSkipped, match=r"declares no objective and no ignore_index.*Objective\(terms="):
        check_normaliser(factory, OBJECTIVE.replace(lengths=None))


@pytest.mark.parametrize("kwargs, says", [
    (dict(terms={}), "Objective.terms must be a non-empty"),
    (dict(terms={"loss": "mean"}), r"Objective.terms\['loss'\] must be one of row_mean, token_mean"),
    (dict(terms={"a": "sum"}, per_micro=("b",)), "Objective.per_micro names 'b', not one of its terms"),
    (dict(terms={"a": "sum"}, per_micro=("a",)), "Objective.per_micro names every term"),
    (dict(sequences=3), "Objective.sequences must be callable"),
])
def test_a_bad_declaration_says_which_field(kwargs, says):
    with pytest.raises(verify.AdapterError, match=says):
        verify.Objective(**kwargs)
    with pytest.raises(verify.AdapterError, match="objective= must be a verify.Objective"):
        verify.adapter(data=oa._tokens, objective={"loss": "sum"})(oa.Normalised)


def test_a_mean_of_micro_batch_means_is_planted_only_where_micro_batches_weigh_unequally():
    """per_micro_mean is the correct trainer under a row-weighted normaliser on the harness's equal micro-batches
    (an equivalent mutant: TRL's grpo and dr_grpo recipes); a bug under a token mean, a sum, or packed rows."""
    from verify.selftest.objective_ops import micro_weights_differ
    from verify.selftest.operators import OPERATORS

    assert not any(micro_weights_differ(verify.Objective(terms={"loss": k})) for k in ("row_mean", "seq_mean", "seq_sum"))
    assert all(micro_weights_differ(verify.Objective(terms={"loss": k})) for k in ("token_mean", "sum"))
    assert micro_weights_differ(verify.Objective(terms={"loss": "seq_mean"}, sequences=verify.data.count_documents))
    assert micro_weights_differ(None) and not micro_weights_differ(verify.Objective(terms={"a": "seq_mean", "b": "batch"}))
    op = OPERATORS["per_micro_mean"]
    assert op.applies(oa.token_mean) and op.applies(oa.summed) and op.applies(oa.two_terms)
    assert not op.applies(oa.seq_mean) and not op.applies(oa.seq_sum)
