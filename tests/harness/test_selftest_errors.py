"""The self-test never counts a crash as a kill: a run that raises something other than a gate's verdict (the
factory, the data, a rank's job timing out) is an "error" cell with its one-line cause, the score counts only
rejections by a gate, and the self-test fails while any cell errs. Adapters: tests/helpers/erring_adapters.py."""
import os
import subprocess
import sys

import pytest

from tests.helpers import erring_adapters as ea
from verify.selftest import run_selftest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ["drop_micro_step", "grads_times_N"]


def _erred(res, needle: str) -> None:
    assert res.errors and all(needle in why for why in res.errors.values()), res.errors
    assert res.killed == [] and not res.ok and res.score == f"0/{len(res.applicable)}"
    assert all(res.rows[op]["verdict"] == "error" for op in res.applicable), res.rows
    assert "FAIL" in res.as_dict()["verdict"] and "error" in res.as_dict()["verdict"]


def test_a_factory_that_raises_is_an_error_not_a_kill():
    res = run_selftest(ea.raises_in_factory, operators=OPS)
    _erred(res, "FileNotFoundError")
    assert ("(unwrapped trainer)", "equivalence") in res.errors


def test_a_data_maker_with_the_wrong_rows_is_an_error_not_a_kill():
    res = run_selftest(ea.wrong_rows, operators=OPS)
    _erred(res, "rows, asked for")


@pytest.mark.distributed
def test_a_rank_job_that_times_out_is_an_error_not_a_kill(monkeypatch):
    from verify.pool import close_all

    monkeypatch.setenv("XTRAIN_DIST_TIMEOUT", "2")
    try:
        res = run_selftest(ea.slow_on_ranks, operators=["divide_by_world_again"], max_world=2)
    finally:
        close_all()
    dist = [why for (who, gate), why in res.errors.items() if gate in ("boundary-only", "data-parallel equivalence")]
    assert dist and res.rows["divide_by_world_again"]["verdict"] == "error" and not res.ok, res.errors


def test_the_terminal_names_each_error_and_the_exit_status_is_nonzero(tmp_path):
    r = subprocess.run([sys.executable, "-m", "verify.selftest", "--verify-trainer", "tests.helpers.erring_adapters:wrong_rows",
                        "--verify-report", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("error: ")]
    assert any(ln.startswith("error: (unwrapped trainer), equivalence: ") and "rows, asked for" in ln for ln in errors)
    (score,) = [ln for ln in r.stdout.splitlines() if ln.startswith("mutation score ")]
    assert score.startswith("mutation score 0/") and "FAIL" in score and "not counted as a kill" in score
