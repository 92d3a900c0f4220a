"""The native reference (verify/_internal/gates/native.py; docs/design/tolerance.md, "The native reference"): what it
sees and what it does not, pinned on the planted bench; honest trainers it was not tuned to pass; the report says which
reference ran. The recipes: tests/examples/test_native_recipes.py."""
import os
import sys

import pytest
from hypothesis import given, settings

import verify
from planted import registry
from verify._internal import report
from verify._internal.cases.strategies import cases
from verify._internal.gates.tolerance import NATIVE_TEXT
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # benchmarks/ is a folder of the repository, not part of the installed package
    sys.path.insert(0, ROOT)


def native(adapter, precision="fp32"):
    """The adapter as a trainer without a float64 path would declare it: nothing else changed."""
    return adapter.replace(numerics=verify.Numerics(precisions=adapter.precisions, overflow=adapter.overflow,
                                                    native=precision))


# The planted equivalence bugs the native reference cannot see, and why (docs/design/tolerance.md): the parameters are
# not judged, so an optimizer-side fault whose losses stay within 1e-3 passes; a float64-only fault does not exist.
BLIND = {"narrow_counter": "a micro-step counter that wraps past 256: the losses after the wrap stay within 1e-3",
         "model_not_in_spec_dtype": "a model not built in Spec.dtype: there is no float64 run to get wrong"}
SHORT = ("nominal_n", "positions_disagree")  # short last windows: the native reference judges full windows only


@pytest.mark.slow
@pytest.mark.parametrize("bug", [b for b in registry.of_gate(Gate.EQUIVALENCE) if not b.needs
                                 and not b.module.startswith("native")], ids=lambda b: b.name)
def test_the_planted_equivalence_bench_under_a_native_reference(bug):
    """Every hand-written equivalence bug of the float64 bench, its trainer declared native fp32, on its own case:
    rejected, but for the two BLIND ones (which pass: the documented blind spot) and the short windows (skipped)."""
    adapter = native(bug.load())
    if bug.name in SHORT:
        with pytest.raises(GateSkipped, match="full windows"):
            verify.check(Gate.EQUIVALENCE, adapter, bug.case)
    elif bug.name in BLIND:
        assert verify.check(Gate.EQUIVALENCE, adapter, bug.case).ratio < 1
    else:
        with pytest.raises(GateFailure, match=r"native fp32: "):
            verify.check(Gate.EQUIVALENCE, adapter, bug.case)


# one-process zoo trainers without a declared objective, every family and optimizer among them (benchmarks/zoo)
ZOO = (1, 39, 45, 66, 162, 206, 267, 319, 359, 372)


@pytest.mark.slow
@pytest.mark.parametrize("seed", ZOO)
def test_honest_zoo_trainers_pass_under_a_native_reference(seed):
    """Generated honest trainers, never tuned to this reference (benchmarks/native_zoo.py runs 72 of them): fp32 and
    their declared autocast precisions, padded windows, a zero-gradient key bias (t206: once rejected at fp16, judged
    relative to its own noise), clipping read at the step (t66: the split runs its declared unclipped options)."""
    from benchmarks.zoo import population

    adapter = native(getattr(population, f"t{seed}"))

    @settings(max_examples=6, deadline=None, database=None)
    @given(case=cases(adapter, max_accum=6))
    def one(case):
        assert verify.check(Gate.EQUIVALENCE, adapter, case).ratio < 1

    one()


def test_the_report_names_the_native_reference(monkeypatch, tmp_path):
    monkeypatch.setattr(report, "_STATS", {})
    case = verify.Case(accum_steps=2, micro_batch=2, steps=1)
    report.record(GateResult(Gate.EQUIVALENCE, case, "gradient (step 0) of 'w' vs the split", 0.25, native="native fp8"))
    gates = report._STATS
    assert gates["equivalence"]["native"] == "native fp8"
    md = report.render_md(dict(trainer="t", settings={}, gates=gates, failures=[]))
    row = next(line for line in md.splitlines() if line.startswith("| equivalence |"))
    assert "| native fp8 |" in row and NATIVE_TEXT in row


def test_the_gate_table_runs_only_its_native_rows_for_a_native_trainer():
    from verify._internal.gates.table import TABLE, why_not

    adapter = native(registry.BY_NAME["per_micro_token_mean"].load())
    ran = {g for g, row in TABLE.items() if row.native}
    assert ran == {Gate.EQUIVALENCE, Gate.BIT_EXACT}
    for gate in set(TABLE) - ran:
        assert "Numerics(native='fp32')" in why_not(gate, adapter)
