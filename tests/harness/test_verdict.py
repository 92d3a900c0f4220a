"""One verdict type (verify/_internal/verdict.py): every gate raises with its `Gate` member, whose value opens the message;
the self-test's columns and the report's keys are Gate members; the self-test reads a failure's gate from its
field, never from its text; and no module outside verdict.py spells a gate's name."""
import ast
import pathlib
import pickle

import pytest

from planted import calib_adapters, count_adapters
from planted import broken_mesh, registry as planted
from xtrain_proof import adapters as xtrain
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure, check_equivalence, check_same_bytes
from verify._internal.gates.worlds import max_world
from verify._internal.gates.mesh import check_mesh_splits
from verify._internal.verdict import Gate
from xtrain_core.config import ModelConfig, OptimConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = xtrain.XtrainOptions(model=ModelConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=1, d_model=8), seq_len=4,
                            optim=OptimConfig(lr=1e-2))
needs_2 = pytest.mark.skipif(max_world() < 2, reason="needs world ≥ 2 (XTRAIN_DIST_MAX_WORLD / GPUs)")
dist = [pytest.mark.distributed, needs_2]

# Every gate with a planted bug in the registry (planted/registry.py) raises with its member there:
# tests/harness/test_planted.py asserts `e.gate is bug.gate` and that the message opens with its name. The
# gates the registry has no bug for are raised here.
RAISES = {
    Gate.DETERMINISM: lambda: check_equivalence(calib_adapters.dropout, Case(accum_steps=1, micro_batch=2, steps=1)),
    Gate.BYTES_PER_STEP: lambda: check_same_bytes(
        count_adapters.logs_each_micro_loss, Case(accum_steps=3, micro_batch=1, steps=1, world=2, lengths=(0, 0, 2, 5, 1, 0))),
    Gate.MESH_SPLIT_INVARIANCE: lambda: check_mesh_splits(  # scale_grads' moving average: wrong once pipelined
        broken_mesh.pipe_ema, Case(accum_steps=4, micro_batch=4, steps=1, pipeline_chunks=2, seed=1, data_seed=2), 4),
}
POOLED = {Gate.BYTES_PER_STEP, Gate.MESH_SPLIT_INVARIANCE}  # runs on rank pools


def test_every_gate_raises_in_some_test():
    assert {b.gate for b in planted.PLANTED if isinstance(b.gate, Gate)} | set(RAISES) == set(Gate)


@pytest.mark.parametrize("gate", [pytest.param(g, marks=dist if g in POOLED else ()) for g in RAISES], ids=str)
def test_each_gate_raises_with_its_member(gate):
    with pytest.raises(GateFailure) as e:
        RAISES[gate]()
    assert e.value.gate is gate and str(e.value).startswith(f"[{gate.value}] "), (e.value.gate, str(e.value)[:200])
    again = pickle.loads(pickle.dumps(e.value))  # as a pool rank sends it back
    assert again.gate is gate and str(again) == str(e.value)


def test_a_gate_has_one_spelling():
    assert len({g.value for g in Gate}) == len(Gate)
    assert GateFailure("x", gate="data-parallel equivalence").gate is Gate.DP_EQUIVALENCE
    for old in ("dp-equivalence", "distributed equivalence", "data-parallel", "data_parallel_equivalence", "bit_exact"):
        with pytest.raises(ValueError):
            GateFailure("x", gate=old)


def test_the_selftest_columns_are_gates_and_read_the_field_not_the_text():
    from verify.selftest import GATES, _column

    assert all(isinstance(g, Gate) for g in GATES) and len(set(GATES)) == len(GATES)
    # a message that says one thing and a field that says another: the field wins
    counter = GateFailure("[data-parallel equivalence] ...", gate=Gate.BOUNDARY_ONLY)
    numbers = GateFailure("[boundary-only] ...", gate=Gate.DETERMINISM)
    assert _column(Gate.DP_EQUIVALENCE, counter) is Gate.BOUNDARY_ONLY
    assert _column(Gate.DP_EQUIVALENCE, numbers) is Gate.DP_EQUIVALENCE  # a diagnosis of the numbers' verdict
    assert _column(Gate.EQUIVALENCE, numbers) is Gate.EQUIVALENCE
    assert _column(Gate.MESH_EQUIVALENCE, counter) is Gate.BOUNDARY_ONLY  # the mesh gate's counter, per axis
    assert _column(Gate.MESH_EQUIVALENCE, numbers) is Gate.MESH_EQUIVALENCE


SELFTESTED = xtrain.single.replace(defaults=TINY, precisions=("fp32",), ref="tests.harness.test_verdict:SELFTESTED")


def test_the_selftest_table_and_report_keys_are_gate_names():
    from verify._internal import report
    from verify.selftest import GATES, run_selftest

    res = run_selftest(SELFTESTED, operators=["grads_times_N"])
    assert res.ok and res.rows["grads_times_N"][Gate.EQUIVALENCE] == "rejects", res.table()
    header = [h.strip() for h in res.table().splitlines()[0].split("  ") if h.strip()]
    assert header[1:-1] == [g.value for g in GATES]
    assert set(res.rows["grads_times_N"]) - {"verdict"} == set(GATES) and set(res.baseline[0]) <= set(GATES)
    assert set(report.BOUNDS) <= set(Gate) and set(report.ORDER) <= {g.value for g in Gate}


def test_a_mutant_stops_at_its_first_kill_unless_every_case_is_asked():
    """stale_micro_batch shows at N=1 on bit-exact while equivalence passes there, and on equivalence from N=3 on:
    by default the N=3 and N=4 cases are not run, so equivalence says "not run", not "passes"."""
    from verify.selftest import NOT_RUN, run_selftest

    first = run_selftest(SELFTESTED, operators=["stale_micro_batch"])
    row = first.rows["stale_micro_batch"]
    assert (row[Gate.BIT_EXACT], row[Gate.EQUIVALENCE], row["verdict"]) == ("rejects", NOT_RUN, "killed"), first.table()
    assert first.ok and "not run" in first.table() and first.baseline == run_selftest(SELFTESTED, operators=[]).baseline
    every = run_selftest(SELFTESTED, operators=["stale_micro_batch"], every_case=True)
    row = every.rows["stale_micro_batch"]
    assert (row[Gate.BIT_EXACT], row[Gate.EQUIVALENCE], row["verdict"]) == ("rejects", "rejects", "killed"), every.table()
    assert NOT_RUN not in every.table()


def test_report_keys_are_gate_names(monkeypatch):
    """One data-parallel run is tallied under both of its gates' names; a case whose reference has no gradient
    (every window without a valid target) has no bytes ratio, and no ZeroDivisionError either."""
    from types import SimpleNamespace

    from verify._internal import report
    from verify._internal.verdict import GateResult

    monkeypatch.setattr(report, "_STATS", {})
    case = Case(accum_steps=2, micro_batch=1, steps=1, world=2, lengths=(0, 0, 0, 0))
    report.record(GateResult(Gate.DP_EQUIVALENCE, case, "rank 1: ", 0.0, comm=SimpleNamespace(expected_used=[]),
                             boundary_bytes=[1656], boundary_collectives=[1], gradient_bytes=0))
    report.record(GateResult(Gate.EQUIVALENCE, case.replace(world=1, precision="bf16"), "loss", 0.5))
    report.skip(Gate.BIT_EXACT, "no plain step")
    assert set(report._STATS) == {"boundary-only", "data-parallel equivalence", "equivalence@bf16", "bit-exact"}
    assert "boundary_bytes_over_gradient_bytes" not in report._STATS["boundary-only"]


def test_the_docs_name_the_gates_as_the_code_does():
    import re

    from verify.selftest import GATES

    guide = (ROOT / "docs" / "verify-your-trainer.md").read_text(encoding="utf-8")
    listed = re.search(r"`gate` is one of `verify.Gate`'s names\s*\((.*?)\);", guide, re.S)
    assert [n.strip() for n in listed.group(1).split(",")] == [g.value for g in Gate]
    matrix = (ROOT / "docs" / "design" / "self-test.md").read_text(encoding="utf-8")  # the self-test's whole matrix
    header = re.search(r"^\| operator \| (.*) \| verdict \|$", matrix, re.M).group(1).split(" | ")
    assert header == [g.value for g in GATES]


# -- no second spelling: a gate's name is written once, in verify/_internal/verdict.py --------------------------------

RETIRED = {"distributed equivalence", "dp-equivalence", "data-parallel", "bit-exact accum=1", "reference"}
# strings that spell a gate's name but are not one, each with why
NOT_GATES = {
    ("protocol.py", "overflow"): "the Adapter field `overflow` (how to make rows overflow fp16)",
    ("gates/diagnose.py", "determinism"): "the function `determinism`, named in __all__",
}
def _spellings(name: str) -> set:
    return {name, name.replace(" ", "_").replace("-", "_"), name.replace(" ", "-").replace("_", "-"),
            name.replace("-", " ").replace("_", " ")}


def _string_constants(tree):
    """(node, value) of every str constant that is not a docstring or an __all__ entry (the example budgets and the
    corners are keyed by Gate itself: one name per gate)."""
    skip = set()
    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))  # a docstring
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            skip |= {id(c) for c in ast.walk(n.value)}
    return [(n, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_no_module_outside_verdict_spells_a_gate_name():
    names = set().union(*(_spellings(g.value) | _spellings(g.name.lower()) for g in Gate)) | RETIRED
    found = []
    for path in sorted((ROOT / "verify").rglob("*.py")):
        rel = path.relative_to(ROOT / "verify").as_posix().removeprefix("_internal/")
        if rel == "verdict.py":
            continue
        for node, s in _string_constants(ast.parse(path.read_text(encoding="utf-8"))):
            bracket = s.startswith("[") and s[1:].split("]", 1)[0] in names  # a message opening "[gate] ..."
            if (s.strip() in names or bracket) and (rel, s) not in NOT_GATES:
                found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: {s[:60]!r}")
    assert not found, "gate names spelled outside verify/_internal/verdict.py (use verify._internal.verdict.Gate):\n" + "\n".join(found)


def test_every_gate_failure_is_raised_with_a_member():
    """Every GateFailure the harness builds names its gate by a Gate expression, never a string literal."""
    bad = []
    for path in sorted((ROOT / "verify").rglob("*.py")):
        if path.name == "verdict.py":
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "GateFailure":
                gate = next((k.value for k in n.keywords if k.arg == "gate"), None)
                if gate is None or (isinstance(gate, ast.Constant) and gate.value is not None):
                    bad.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    assert not bad, bad


def test_the_grep_can_fail(tmp_path):
    tree = ast.parse('def f():\n    """docstring: [equivalence]"""\n    x = "dp-equivalence"\n    return f"[split invariance] {x}"\n')
    names = {s for _, s in _string_constants(tree)}
    assert "dp-equivalence" in names and "[split invariance] " in names and not any("docstring" in s for s in names)
