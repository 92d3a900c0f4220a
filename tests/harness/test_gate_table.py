"""The gate table (verify/_internal/gates/table.py) is the one definition of each gate: every gate has a row, every
row a planted bug its check must reject, and the gate tests, the report and the planted bench read the row."""
import inspect

import pytest

from planted import registry as planted
from verify._internal import report
from verify._internal.gates.table import TABLE, GateRow, why_not
from verify._internal.verdict import Gate
from xtrain_proof import adapters as xtrain

GATES = [g for g in Gate if g is not Gate.DETERMINISM]  # determinism: a diagnosis of a failure, never drawn


def test_every_gate_has_one_row_and_the_report_prints_its_claim():
    assert set(TABLE) == set(GATES), sorted(g.value for g in set(TABLE) ^ set(GATES))
    for gate, row in TABLE.items():
        assert row.gate is gate and len(row.claim) > 20 and callable(row.check)
        assert report.BOUNDS[gate] == row.claim
        if row.runs_in is not None:  # judged on another gate test's runs: that one has its own budget
            assert TABLE[row.runs_in].budget is not None


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.value)
def test_every_gate_has_a_planted_bug_it_must_reject(gate):
    """A gate nothing is planted against proves nothing: each has a registry row, which test_planted.py runs
    through the row's check (TABLE[gate].check) and expects rejected with its message."""
    assert planted.of_gate(gate), f"no planted bug for {gate.value!r}: add one to planted/registry.py"


def test_a_row_needs_a_budget_or_the_test_whose_runs_judge_it():
    with pytest.raises(ValueError, match="'equivalence': give a budget .* not neither"):
        GateRow(Gate.EQUIVALENCE, "claim", print)
    with pytest.raises(ValueError, match="not both"):
        GateRow(Gate.EQUIVALENCE, "claim", print, (1, 1), runs_in=Gate.LONG_WINDOW)


def test_why_not_names_the_declaration_that_enables_a_gate():
    """xtrain's one-process adapter: no ignore_index, objective, mesh, metrics or parity; each gate that needs one
    says which declaration turns it on; those it satisfies apply."""
    a = xtrain.single
    applies = {g for g in GATES if why_not(g, a) is None}
    assert {Gate.EQUIVALENCE, Gate.BIT_EXACT, Gate.LONG_WINDOW, Gate.PARTIAL_SUMS} <= applies
    assert "ignore_index=" in why_not(Gate.SPLIT_INVARIANCE, a) and "ignore_index" in why_not(Gate.EMPTY_WINDOW, a)
    assert "mesh_axes=" in why_not(Gate.MESH_EQUIVALENCE, a) and "parity=" in why_not(Gate.PATH_PARITY, a)
    assert "data_parallel=True" in why_not(Gate.DP_EQUIVALENCE, a.replace(data_parallel=False))
    assert why_not(Gate.BOUNDARY_ONLY, a.replace(data_parallel=False)) == why_not(Gate.DP_EQUIVALENCE,
                                                                                  a.replace(data_parallel=False))


def test_the_gate_tests_are_their_rows():
    """Every plugin gate test is its gate's row run by prove (skip through the table's why_not, its draw, corners,
    budget): one per gate with a draw, each calling prove and spelling no declaration check, draw or budget itself."""
    import verify.test_gates as single
    import verify.test_gates_dist as dist
    import verify.test_gates_mesh as mesh

    proved = []
    for module in (single, dist, mesh):
        for name, test in inspect.getmembers(module, inspect.isfunction):
            if not name.startswith("test_"):
                continue
            src = inspect.getsource(test)
            assert src.count("prove(Gate.") == 1, f"{module.__name__}.{name} is not one prove() call"
            proved.append(src.split("prove(Gate.", 1)[1].split(",", 1)[0])
            for spelled in ("ignore_index is None", ".plain is None", ".parity is None", ".metrics is None",
                            "not_declared(", "overflow_hook(", "needs_world(", "@given", "random_budget("):
                assert spelled not in src, f"{module.__name__}.{name} spells '{spelled}': the gate table's row does"
    # each gate with a draw has a test (overflow two: one process, and ranks), none without one
    assert sorted(set(proved)) == sorted(g.name for g, row in TABLE.items() if row.draw is not None), proved


def test_verify_check_runs_one_gate_on_one_case_as_the_plugin_does():
    """The public door to one gate (verify.check, the guide's §10): a pass returns its GateResult, a bug raises
    the plugin's GateFailure, a gate that does not apply raises GateSkipped."""
    import verify

    case = verify.Case(accum_steps=2, micro_batch=1, steps=1, seed=1, data_seed=2)
    assert verify.check(verify.Gate.EQUIVALENCE, xtrain.single, case).ratio < 1
    bug = planted.BY_NAME["missing_1_over_N"]
    with pytest.raises(verify.GateFailure, match=r"^\[equivalence\] ") as e:
        verify.check(verify.Gate.EQUIVALENCE, bug.adapter, bug.case)
    assert e.value.gate is verify.Gate.EQUIVALENCE
    with pytest.raises(verify.GateSkipped, match="declares no objective and no ignore_index"):
        verify.check(verify.Gate.NORMALISER, xtrain.single, case)


def test_every_gate_the_self_test_runs_has_an_operator_aimed_at_it_and_every_operator_a_gate():
    """The self-test's columns are the gates with operators in the table; every operator is aimed at one gate, and
    each aimed name is an operator. A gate without one would have a column nothing is shown to reach."""
    from verify.selftest import GATES, OPERATORS

    aimed = {g: row.operators for g, row in TABLE.items() if row.operators}
    assert set(aimed) == set(GATES), sorted(g.value for g in set(aimed) ^ set(GATES))
    names = [o for ops in aimed.values() for o in ops]
    assert sorted(names) == sorted(OPERATORS), (sorted(set(names) - set(OPERATORS)), sorted(set(OPERATORS) - set(names)))
