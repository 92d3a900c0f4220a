"""Which fault operators apply to an adapter (verify.selftest.operators, Operator.applies): an operator whose
edit plants nothing for this adapter must be "n/a", never a survivor the score counts."""
import dataclasses

import verify
from examples.mlp_regressor import factory as mlp
from verify.selftest.operators import OPERATORS


def test_the_norm_after_clipping_is_a_bug_only_where_the_adapter_clips():
    """grad_norm_post_clip rescales the logged norm by min(1, max_norm / norm): without a max_norm it changes
    nothing, and the self-test once counted it SURVIVED on a trainer that logs grad_norm and never clips (the
    zoo's t77, a tp MLP)."""
    op = OPERATORS["grad_norm_post_clip"]
    names = ("loss", "grad_norm", "lr", "rows")
    unclipped = mlp.replace(metrics=verify.Metrics(names=names), ref="examples.mlp_regressor:factory")
    assert op.applies(mlp) and not op.applies(unclipped)
    drawn = mlp.replace(metrics=verify.Metrics(names=names, max_norm=lambda o: o), ref="examples.mlp_regressor:factory")
    assert op.applies(dataclasses.replace(drawn, defaults=10.0)) and not op.applies(drawn)  # defaults None: no clip
    assert OPERATORS["grad_norm_zero"].applies(unclipped)  # the other norm bugs exist without clipping


def test_the_self_tests_cases_leave_a_declared_per_micro_term_out_as_the_gates_do():
    """A per_micro term differs from the big batch by declaration: every gate but the normaliser judges the loss
    without it (Spec.terms = the window-level terms), the self-test's fixed cases too. They once held every term,
    so the unwrapped trainer of an honest per-micro MoE aux failed equivalence (the zoo's t57, t72)."""
    from planted import objective_adapters as oa
    from verify.selftest import mesh_cases, run_selftest, selftest_cases

    single, dist = selftest_cases(oa.z_per_micro)
    assert {c.terms for c in single + dist} == {("ce",)}
    assert all(c.terms is None for c in selftest_cases(oa.two_terms)[0])  # no per_micro term: the whole loss
    from examples.tensor_parallel import factory as tp

    assert all(c.terms is None for c in mesh_cases(tp, 4))
    res = run_selftest(oa.z_per_micro, operators=["grads_times_N"])
    assert res.baseline_ok and not res.errors and res.rows["grads_times_N"]["verdict"] == "killed", res.as_dict()
