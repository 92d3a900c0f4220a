"""The self-test never counts a crash as a kill: a run that raises (the factory, the data maker, the trainer
under a mutant, a pool job's timeout) is an "error" cell with its one-line cause, the score counts only a
gate's rejections, and the self-test exits 3 while any run errs (verify/selftest)."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import erring_adapters
from verify.selftest import ERROR, run_selftest
from verify._internal.verdict import Gate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_a_factory_that_raises_is_an_error_not_a_kill(tmp_path):
    """The factory raises FileNotFoundError at N ≥ 3: the mutants that only run there are errors; only
    stale_micro_batch, rejected by bit-exact at N=1 where the unwrapped trainer passes, is a kill. Exit 3."""
    r = subprocess.run([sys.executable, "-m", "verify.selftest", "--verify-trainer",
                        "tests.helpers.erring_adapters:missing_checkpoint", "--verify-report", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert ("error: (unwrapped trainer) equivalence on N=3 B=2 K=2: FileNotFoundError: no checkpoint for "
            "accum_steps=3: ckpt/accum3.pt (erring_adapters.py:17)") in lines, r.stdout
    assert "mutation score 1/9 " in r.stdout and "every operator killed" not in r.stdout  # 8, and normaliser_applied_twice
    assert "the unwrapped trainer errs in one process" in r.stdout and "Traceback" not in r.stdout
    st = json.loads((tmp_path / "verify-report.json").read_text())["selftest"]
    assert not st["ok"] and st["exit_code"] == 3 and st["score"] == "1/9", st["verdict"]
    ops = st["operators"]
    assert ops["stale_micro_batch"]["verdict"] == "killed" and ops["grads_times_N"]["verdict"] == ERROR
    assert ops["grads_times_N"]["equivalence"] == ERROR and "| (unwrapped trainer) | error |" in st["table_md"]
    assert {e["cause"].split(":")[0] for e in st["errors"]} == {"FileNotFoundError"}


def test_a_data_maker_returning_the_wrong_rows_is_an_error():
    """Five rows where six are asked (the N=3 B=2 case): that case errs and kills nothing; the N=4 B=1 case
    (four rows) still judges the mutant."""
    res = run_selftest(erring_adapters.short_data, operators=["grads_times_N"])
    assert res.exit_code == 3 and not res.ok and res.score == "1/1", res.table()
    (line,) = res.error_lines()
    assert line.startswith("error: (unwrapped trainer) equivalence on N=3 B=2 K=2: AdapterError: data of ") and \
        "returned 5 / 5 rows, asked for 6" in line, line
    assert "ERROR in one process" in res.table() and "1 run(s) raised" in res.as_dict()["verdict"]


def test_a_mutant_that_raises_is_an_error_and_never_a_kill():
    """repeat_micro_step builds the trainer with N + 1 = 4 micro-steps, which it refuses: at N=3 the mutant raises
    (its own error, listed under its name), at N=4 the unwrapped trainer raises too (its cell 'error', not run).
    drop_micro_step (N − 1) is rejected by equivalence: the score is 1/2, not 2/2."""
    res = run_selftest(erring_adapters.up_to_three, operators=["repeat_micro_step", "drop_micro_step"])
    assert res.score == "1/2" and res.exit_code == 3, res.table()
    rep, drop = res.rows["repeat_micro_step"], res.rows["drop_micro_step"]
    assert (rep[Gate.EQUIVALENCE], rep["verdict"]) == (ERROR, ERROR) and drop["verdict"] == "killed", res.table()
    assert [(w, str(g), str(res.cases[i]).split(" seed")[0]) for w, g, i, _ in res.errors] == [
        ("(unwrapped trainer)", "equivalence", "N=4 B=1 K=3"), ("repeat_micro_step", "equivalence", "N=3 B=2 K=2")]
    assert "ValueError: this trainer supports accum_steps ≤ 3, got 4" in res.errors[1][3]
    assert "error: ['repeat_micro_step']" in res.as_dict()["verdict"]


@pytest.mark.slow  # ~25 s: pools of worlds 1 and 2, and a 3 s timeout with its stack dumps
@pytest.mark.distributed
def test_a_pool_job_that_times_out_is_an_error(settings_with):
    """Rank 1 hangs at world 2: the job's DistTimeout (XTRAIN_DIST_TIMEOUT=3) is the unwrapped trainer's error at
    W=2, and divide_by_world_twice (which exists only at W ≥ 2) is an error, not a kill."""
    settings_with(timeout=3)
    res = run_selftest(erring_adapters.hangs, max_world=2, operators=["divide_by_world_twice"])
    assert res.score == "0/1" and res.exit_code == 3 and res.rows["divide_by_world_twice"]["verdict"] == ERROR
    (line,) = res.error_lines()
    assert line.startswith("error: (unwrapped trainer) boundary-only on N=3 B=2 W=2 K=2: DistTimeout: ") and \
        "timed out after 3 s" in line, line
    assert "ERROR at world 2" in res.table() and "passes" in res.table()  # world 1 passes
