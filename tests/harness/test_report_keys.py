"""The terminal and the report agree, and one trainer's state never lands on another's: the skipped-gates list
names each gate once by its report key (verify.Gate), only where it ran no example; a run over another trainer's
report says what it replaced; hypothesis' example database is kept per trainer (verify/_internal/plugin.py)."""
import json
import os
import subprocess
import sys

import pytest

from verify._internal import plugin, report
from verify._internal.verdict import Gate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**{k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_STORAGE_DIRECTORY")},
       "PYTHONPATH": ROOT, "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1"}


class _Terminal:
    def __init__(self):
        self.lines, self.stats = [], {}

    def write_sep(self, sep, title):
        self.lines.append(title)

    def write_line(self, line, **kw):
        self.lines.append(line)


class _Config:
    def __init__(self, stats):
        self.stash = {plugin._KEY: dict(stats=stats, failures=[])}
        self.option = type("O", (), dict(force_short_summary=False, verbose=0))()


def test_the_skipped_list_names_each_gate_once_and_only_where_it_ran_nothing(monkeypatch):
    """Split invariance ran 10 examples while the mesh split gate was skipped: only the mesh split gate is listed,
    by the name the report uses (they were one name, and the list said split invariance was skipped)."""
    monkeypatch.setattr(report, "_STATS", {})  # this process's tally, put back after
    for gate in (Gate.SPLIT_INVARIANCE, Gate.MESH_SPLIT_INVARIANCE, Gate.BYTES_PER_STEP):
        report.skip(gate, f"{gate.value}: reason")
    stats = {k: dict(v) for k, v in report._STATS.items()}
    stats[Gate.SPLIT_INVARIANCE.value]["examples"] = 10  # ran on the token windows as well
    tr = _Terminal()
    plugin._Reporter(_Config(stats)).pytest_terminal_summary(tr)
    assert tr.lines[0] == "verify: not checked", tr.lines
    for gate in (Gate.MESH_SPLIT_INVARIANCE, Gate.BYTES_PER_STEP):  # once each, by its report key, with its reason
        assert tr.lines.count(f"{gate.value}: {gate.value}: reason") == 1, tr.lines
    assert not [ln for ln in tr.lines if ln.startswith(f"{Gate.SPLIT_INVARIANCE.value}:")], tr.lines
    assert tr.lines[-1].startswith("verify: checked 1 of 15 gates and 0 of 6 metrics"), tr.lines
    assert Gate.MESH_SPLIT_INVARIANCE.value in report.ORDER  # the report has a row for it, by the same name


def test_writing_another_trainers_report_says_what_it_replaced(tmp_path):
    assert report.replaces(str(tmp_path), "a:b") is None  # nothing there yet
    report.write(str(tmp_path), trainer="a:b", settings={})
    assert report.replaces(str(tmp_path), "a:b") is None  # the same trainer: its sections merge, nothing lost
    said = report.replaces(str(tmp_path), "c:d")
    assert said.startswith("the report of a:b (") and report.read(str(tmp_path))["utc"] in said


def _files(folder) -> dict:
    return {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(folder) for f in fs}


@pytest.mark.slow  # two plugin runs of the equivalence gate
def test_a_buggy_trainers_saved_examples_survive_a_correct_trainers_run(tmp_path):
    """Same cache home, same report folder: the buggy trainer's failing examples are saved under its own key and
    untouched by the correct trainer's run (not replayed, not deleted); its report is replaced, and the terminal
    says so."""
    cache, here = tmp_path / "cache", tmp_path / "user"
    here.mkdir()

    def run(ref):
        return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q",
                               "-k", "big_batch", "--verify-trainer", ref], capture_output=True, text=True,
                              cwd=here, env={**ENV, "XDG_CACHE_HOME": str(cache)}, timeout=600)

    # unseeded: a seeded hypothesis run saves no examples; any draw with N ∉ {1, 3} shows this bug
    bad = run("tests.helpers.corner_blind:adapter")  # found by a random draw (a corner's failure is never saved)
    assert bad.returncode == 1, bad.stdout[-3000:]
    db = cache / "xtrain-verify" / "hypothesis"
    saved = _files(db / "tests.helpers.corner_blind_adapter")
    assert any(p.startswith("examples" + os.sep) for p in saved), saved  # the shrunk failure, kept for next time
    good = run("examples.mlp_regressor:factory")
    assert good.returncode == 0, good.stdout[-3000:]
    assert _files(db / "tests.helpers.corner_blind_adapter") == saved  # neither replayed away nor deleted
    # the correct trainer's run keeps its own folder, if it keeps anything (a passing run may keep nothing)
    assert set(os.listdir(db)) - {"examples.mlp_regressor_factory"} == {"tests.helpers.corner_blind_adapter"}
    assert ("; it replaced the report of tests.helpers.corner_blind:adapter (" in good.stdout
            and "(--verify-report DIR keeps one per trainer)" in good.stdout), good.stdout[-2000:]
    assert report.read(str(here / "reports"))["trainer"] == "examples.mlp_regressor:factory"


# -- every gate that ran is counted, serial or under xdist (issue 42, item 9) ---------------------------------------

def _results():
    """One passed example of every kind report.record tallies, in the order a run might record them: each key of
    each tally appears (worst cases, floors, ranges by link, side traffic, uneven, packed, meshes, metrics)."""
    from types import SimpleNamespace

    from verify._internal.cases.case import Case
    from verify._internal.ranks.mesh import Mesh
    from verify._internal.verdict import GateResult

    def dp(world, n, ratio, **kw):
        links = [{"intra-node": 400 * world, "inter-node": 8 * n}]
        return GateResult(Gate.DP_EQUIVALENCE, Case(accum_steps=n, micro_batch=1, steps=1, world=world, **kw),
                          "rank 0: loss", ratio, comm=SimpleNamespace(expected_used=[1] * n), floor64=ratio / 1e9,
                          boundary_bytes=[404 * world], boundary_collectives=[world], boundary_bytes_by_link=links,
                          gradient_bytes=400, declared_side_traffic=n, metrics=metrics(n))

    def metrics(n):
        return dict(metrics_checked={"loss": n, "grad_norm": 2 * n}, metrics_unchecked={"lr": f"why {n}"},
                    clipped_steps=n % 2, metric_steps=n)

    one = lambda gate, n, ratio, **kw: GateResult(gate, Case(accum_steps=n, micro_batch=2, steps=1, **kw),  # noqa: E731
                                                  f"check {n}", ratio, floor64=ratio / 1e10)
    mesh = Case(accum_steps=2, micro_batch=1, steps=1, world=1, mesh=Mesh(pp=2))
    return [
        (one(Gate.EQUIVALENCE, 3, 0.2), None), (one(Gate.EQUIVALENCE, 2, 0.1, precision="bf16"), None),
        (one(Gate.EQUIVALENCE, 64, 0.3), Gate.LONG_WINDOW), (one(Gate.BIT_EXACT, 1, 0.0), None),
        (dp(2, 3, 0.4), None), (dp(1, 2, 0.1), None), (dp(2, 2, 0.2, rank_rows=((2, 1), (1,))), None),
        (dp(3, 2, 0.05), Gate.BYTES_PER_STEP),
        (GateResult(Gate.NORMALISER, Case(accum_steps=2, micro_batch=1, steps=2), "term", 0.3, packed_rows=True,
                    halved_packed=True), None),
        (GateResult(Gate.OVERFLOW, Case(accum_steps=4, micro_batch=1, steps=2, world=2), "params", 0.0), None),
        (GateResult(Gate.REPORTED_METRICS, Case(accum_steps=2, micro_batch=1, steps=2), "lr", 0.2, **metrics(5)), None),
        (GateResult(Gate.MESH_EQUIVALENCE, mesh, "replica 0", 0.5, counts={"unjudged": ["pp"]}, metrics=metrics(1)), None),
        # the second half: larger and smaller worst cases than the first's, new worlds, new precision
        (one(Gate.EQUIVALENCE, 4, 0.25), None), (one(Gate.EQUIVALENCE, 128, 0.1), Gate.LONG_WINDOW),
        (one(Gate.BIT_EXACT, 1, 0.0), None), (dp(4, 2, 0.6), None), (dp(2, 4, 0.3), Gate.BYTES_PER_STEP),
        (dp(3, 3, 0.01, rank_rows=((1,), (2, 2), (1, 1, 1))), None),
        (GateResult(Gate.NORMALISER, Case(accum_steps=3, micro_batch=1, steps=2), "term", 0.1, packed_rows=True), None),
        (GateResult(Gate.OVERFLOW, Case(accum_steps=2, micro_batch=1, steps=2, world=3), "params", 0.0), None),
        (GateResult(Gate.REPORTED_METRICS, Case(accum_steps=3, micro_batch=1, steps=2), "loss", 0.7, **metrics(4)), None),
        (GateResult(Gate.MESH_EQUIVALENCE, mesh.replace(mesh=Mesh(tp=2)), "replica 0", 0.2, counts={"unjudged": []}),
         None),
    ]


def _tally(results, skips=()) -> dict:
    saved = report._STATS
    report._STATS = {}
    try:
        for r, gate in results:
            report.record(r, gate)
        for gate, why in skips:
            report.skip(gate, why)
        return json.loads(report.dump())
    finally:
        report._STATS = saved


def test_tallies_merged_from_workers_equal_one_process_recording_everything():
    """Under xdist each worker tallies its own examples and the controller merges them: the report must be the one a
    serial run of the same examples writes, every key of every gate (the merge dropped the uneven and packed counts,
    the meshes and the declared side traffic of a second worker, and kept the first worker's case as boundary-only's
    largest). Every key a tally holds has a merge rule."""
    from verify._internal.report_merge import KNOWN, merge

    results = _results()
    half = len(results) // 2
    skips = [(Gate.PARTIAL_SUMS, "no partial_grads()")]
    serial = _tally(results, skips)
    merged = {}
    for part in (_tally(results[:half], skips), _tally(results[half:])):
        merge(merged, json.dumps(part))
    assert merged == serial
    assert {k for g in serial.values() for k in g} <= set(KNOWN), {k for g in serial.values() for k in g} - set(KNOWN)
    assert serial["bytes per step"]["examples"] == 2 and serial["long window"]["examples"] == 2, serial
    assert serial["bytes per step"]["worst_case"]["accum_steps"] == 4 and serial["long window"]["worst_ratio"] == 0.3
    assert serial["data-parallel equivalence"]["uneven_examples"] == 2 and serial["normaliser"]["packed_examples"] == 2


def test_the_long_window_test_counts_under_its_own_gate(monkeypatch):
    """verify/test_gates.py's long-window test on a plain MLP: its passes are the long window's (they were tallied as
    equivalence, and the summary said "long window: no test of this gate ran in this session")."""
    from examples import mlp_regressor
    from verify import test_gates
    from verify._internal.settings import current

    monkeypatch.setattr(report, "_STATS", {})
    test_gates.test_long_accumulation_and_partial_sums(mlp_regressor.factory, current())
    gates = json.loads(report.dump())
    assert gates["long window"]["examples"] >= 3 and "equivalence" not in gates, gates
    assert gates["long window"]["worst_case"]["accum_steps"] >= 64
    missing, last = report.coverage(gates, None)
    assert not [ln for ln in missing if ln.startswith("long window:")] and last.startswith("checked 1 of 15 gates")


def test_an_adapter_that_is_not_data_parallel_says_so_for_each_data_parallel_gate(monkeypatch):
    """Not "data-parallel equivalence: no test of this gate ran": the reason, for each of the three gates."""
    from examples import mlp_regressor
    from verify import test_gates_dist
    from verify._internal.settings import current

    monkeypatch.setattr(report, "_STATS", {})
    for test in (test_gates_dist.test_data_parallel_boundary_only_and_equivalent,
                 test_gates_dist.test_bytes_per_step_independent_of_N):
        with pytest.raises(pytest.skip.Exception):
            test(mlp_regressor.factory, current())
    missing, _ = report.coverage(json.loads(report.dump()), None)
    for gate in (Gate.BOUNDARY_ONLY, Gate.DP_EQUIVALENCE, Gate.BYTES_PER_STEP):
        assert f"{gate.value}: examples.mlp_regressor.Trainer does not declare data parallelism " \
               "(distributed=verify.Distributed(data_parallel=True))" in missing, missing
