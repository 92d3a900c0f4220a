"""One gate's test, as every gate test of the plugin runs it (verify/test_gates*.py; the gate's row in
gates/table.py says how it draws): skip, saying why, where the gate does not apply; the worlds it draws; its
known-hard corners first (cases/corners.py), then random draws within its budget (a profile's share: the table);
each example judged and recorded in the run report. A gate test is this call, and a new gate's test is a row and a
line (docs/design/gates.md)."""
from __future__ import annotations

import pytest

from verify._internal import report
from verify._internal.cases.corners import corners
from verify._internal.cases.strategies import with_corners
from verify._internal.gates.table import TABLE, random_budget
from verify._internal.gates.worlds import world_range
from verify._internal.verdict import Gate

__all__ = ["prove"]


def prove(gate: Gate, adapter, settings, *, ranks: bool = False, elsewhere: str | None = None) -> None:
    """Run `gate`'s test on `adapter` under `settings`: in one process, or over its worlds on rank pools (`ranks`).
    `elsewhere`: why this test leaves an applicable gate to its other test (the overflow gate: one process or
    ranks)."""
    from hypothesis import Phase, given, settings as examples

    row = TABLE[Gate(gate)]
    d = row.draw
    if d is None:
        raise ValueError(f"gate {row.gate.value!r} has no draw in the gate table: its runs are another test's")
    reason = report.not_applicable(adapter, settings, row.gate, *d.also)
    if reason or elsewhere:
        pytest.skip(reason or elsewhere)
    lo, hi = world_range(None if d.mesh else adapter, settings, at_least=d.least_world) if ranks else (1, 1)
    hard = corners(adapter, row.gate, min_world=lo, max_world=hi)

    @examples(max_examples=random_budget(row.gate, hard), deadline=None,  # the loaded profile's phases
              phases=tuple(p for p in examples.default.phases if d.shrink or p is not Phase.shrink))
    @given(drawn=d.strategy(adapter, lo, hi))
    def one(drawn):
        judged = d.judge(adapter, drawn, settings) if d.judge else [
            row.check(adapter, *drawn) if isinstance(drawn, tuple) else row.check(adapter, drawn)]
        for item in judged:  # recorded as it comes: a later check's failure leaves the earlier passes counted
            if isinstance(item, tuple):  # (gate, why it did not apply): a gate judged on these runs
                report.skip(*item)
            else:  # under its own name where it is judged on this gate's runs (partial sums), else this gate's
                report.record(item, item.gate if TABLE[item.gate].runs_in is row.gate else row.gate)

    with_corners(one, hard, "drawn")()
