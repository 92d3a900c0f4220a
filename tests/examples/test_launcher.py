"""Multi-node without a cluster (issue 19 item 3): two torchrun agents on this host (--nnodes 2, c10d
rendezvous on localhost, 2 ranks each, gloo) run `python -m verify.run`, and the suite checks that

* the gates pass with ONE report (rank 0's), the launch described in it, and give the same verdicts and
  counts as the pool-based gates on the same seed; worlds 1..4 are drawn, as in the pool-based run: the
  sub-worlds 2 and 3 on subgroups of the launched ranks (xtrain's adapter declares subgroups), world 1 and
  the references in one-rank pools on rank 0's node;
* a planted bug fails with the same message as under the pool-based plugin;
* a rank killed mid-step (the registry's `dies_mid_step`) ends every agent within the timeout: exit ≠ 0,
  stacks printed, no process of the run left (every process it started carries a marker in its environment).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import pytest

from planted import registry as planted

ROOT = pathlib.Path(__file__).resolve().parents[2]
GATE = "verify.test_gates_dist::test_data_parallel_boundary_only_and_equivalent"
LINKS = ("boundary_bytes_intra_node", "boundary_bytes_inter_node")  # the report's keys: the nodes the groups span
TIMEOUT = 60  # XTRAIN_DIST_TIMEOUT of the runs: a lost rank must end them well within the test's limit
pytestmark = [pytest.mark.distributed]


def _env(mark: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HYPOTHESIS_PROFILE": "dev", "XTRAIN_DIST_TIMEOUT": str(TIMEOUT),
            "XTRAIN_THREADS": "1", "XTRAIN_LAUNCHER_TEST": mark}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (every process a run started inherits it)."""
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if f"XTRAIN_LAUNCHER_TEST={mark}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def launch(trainer: str, report: pathlib.Path, limit: float = 420) -> tuple[list[int], list[str], float, str]:
    """Two torchrun agents (node ranks 0 and 1) of `verify.run` on the gate test; returns their exit codes,
    outputs, the seconds until both ended, and the marker of their processes."""
    mark, port = uuid.uuid4().hex, _port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "-m", "verify.run", "--verify-trainer",
         trainer, "--verify-report", str(report), "--hypothesis-seed=1", "-p", "no:cacheprovider", GATE],
        cwd=ROOT, env=_env(mark), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for n in (0, 1)]
    t0, outs = time.monotonic(), []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=max(1.0, limit - (time.monotonic() - t0)))[0])
    finally:
        for a in agents:
            if a.poll() is None:  # the test's own limit: end what it started, by process group
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    return [a.returncode for a in agents], outs, time.monotonic() - t0, mark


def pooled(trainer: str, report: pathlib.Path) -> subprocess.Popen:
    """The same gate test under the pool-based plugin, worlds 1..4 (the launched run's) on the same seed, started
    beside the launch (torchrun's rendezvous and exit barrier leave the cores idle for ~15 s): `finish()` it."""
    env = {**_env("pooled"), "XTRAIN_DIST_MIN_WORLD": "1", "XTRAIN_DIST_MAX_WORLD": "4"}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                             "--pyargs", GATE, "--verify-trainer", trainer, "--verify-report", str(report),
                             "--hypothesis-seed=1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 420) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _report(folder: pathlib.Path) -> dict:
    return json.loads((folder / "verify-report.json").read_text())


def _no_pg(message: str) -> str:
    return re.sub(r"process group \S+ '[^']*'", "process group", message)


def _verdicts(doc: dict) -> dict:
    """What must agree between the launched and the pooled run: per gate the examples, worlds and counts
    (every field but timing), and the failures' messages."""
    gates = {name: {k: v for k, v in g.items() if "time" not in k and "second" not in k and k not in LINKS}
             for name, g in doc["gates"].items()}
    return dict(gates=gates, failures=[_no_pg(f["message"]) for f in doc.get("failures", [])])


@pytest.mark.slow  # two torchrun agents of 4 ranks: ~35-60 s on a 2-core box
def test_two_agents_pass_with_one_report_and_the_pools_verdicts(tmp_path):
    reference = pooled("xtrain_proof.adapters:adapter", tmp_path / "pooled")
    codes, outs, seconds, mark = launch("xtrain_proof.adapters:adapter", tmp_path / "launched")
    ref = finish(reference)
    assert codes == [0, 0], outs
    assert sorted(p.name for p in (tmp_path / "launched").iterdir()) == ["verify-report.json", "verify-report.md"]
    doc = _report(tmp_path / "launched")
    how = doc["settings"]["launch"]
    assert how == dict(launcher="torchrun", nodes=2, ranks_per_node=2, world=4, backend="gloo", rendezvous="c10d",
                       endpoint=how["endpoint"], launched_worlds=how["launched_worlds"]), doc["settings"]
    assert doc["settings"]["worlds"] == [1, 4]
    drawn = sorted({w for g in doc["gates"].values() for w in g.get("worlds", [])})
    assert how["launched_worlds"] == [w for w in drawn if w > 1], (how, drawn)  # world 1: a one-rank pool
    assert min(how["launched_worlds"]) < 4, how  # seed 1 draws a sub-world: it ran on the launched ranks
    assert ref.returncode == 0, ref.stdout + ref.stderr
    pool_doc = _report(tmp_path / "pooled")
    # the same cases by construction: a gate draws from the seed alone, not from the constants of the modules its
    # process imported (verify._internal.cases.strategies.seed_only_draws; the controller has imported verify.run and more)
    assert _verdicts(doc) == _verdicts(pool_doc)
    # counts split by link: a group of ranks 0..W-1 spans both nodes from W = 3 on (world 2 is node 0's ranks);
    # a pool's ranks are one host's. Each example's bytes go to one link, so the largest is the pool's largest.
    for name, g in doc["gates"].items():
        if name.startswith("boundary-only") and max(g["worlds"]) > 1:
            intra, inter = (g[k] for k in LINKS)
            p = pool_doc["gates"][name]
            assert inter[1] > 0 and (intra[1] > 0) == (2 in g["worlds"]), g
            assert p["boundary_bytes_inter_node"] == [0, 0] and p["boundary_bytes_intra_node"][1] == max(intra[1], inter[1]), (g, p)
    assert not _marked(mark)
    print(f"launched run: {seconds:.1f} s")


@pytest.mark.slow  # two torchrun agents of 4 ranks: ~35-60 s on a 2-core box
def test_a_planted_bug_fails_with_the_pools_message(tmp_path):
    bug = next(b for b in planted.PLANTED if b.name == "all_reduce_every_micro_step")
    ref_ = "planted.broken_dist:all_reduce_every_micro"
    reference = pooled(ref_, tmp_path / "pooled")
    codes, outs, seconds, mark = launch(ref_, tmp_path / "launched")
    ref = finish(reference)
    assert codes == [1, 1], outs  # rank 0's pytest: a gate failed, and every rank exits with its status ...
    assert seconds < 300, seconds  # ... so no agent waits out torchrun's 300 s exit barrier for the other
    got = _report(tmp_path / "launched")["failures"]
    assert got and re.search(bug.pattern, got[0]["message"]), got
    assert ref.returncode == 1, ref.stdout + ref.stderr
    # the same message, but for the process group it names: a sub-world's subgroup launched, a pool's default group
    assert [_no_pg(f["message"]) for f in got] == [_no_pg(f["message"]) for f in _report(tmp_path / "pooled")["failures"]]
    assert not _marked(mark)


@pytest.mark.slow  # two torchrun agents of 4 ranks: ~35-60 s on a 2-core box
def test_a_rank_killed_mid_step_ends_every_agent(tmp_path):
    bug = next(b for b in planted.PLANTED if b.gate == "launcher")
    codes, outs, seconds, mark = launch("planted.broken_dist:dies_mid_step", tmp_path / "r", limit=4 * TIMEOUT)
    assert all(c != 0 for c in codes), (codes, outs)
    assert re.search(bug.pattern, "\n".join(outs)), outs  # torchrun names the dead rank's exit code
    assert seconds < 4 * TIMEOUT
    # stacks: faulthandler's on the ranks torchrun stopped, Python's on the ranks whose store went away
    assert "most recent call first" in "\n".join(outs), outs
    time.sleep(1.0)  # the agents have returned; give the kernel a moment to reap what they stopped
    assert not _marked(mark), "processes of the run still alive"
    print(f"killed run: every agent ended {seconds:.1f} s after the start")


@pytest.mark.slow  # a verify.run subprocess (~10-30 s on 2 cores); the test below proves the same branch in-process
def test_alone_it_runs_world_1_and_says_how_to_launch_more():
    """No launcher in the environment: world 1, and the one line on how to launch more (collect-only here)."""
    env = {k: v for k, v in _env("alone").items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "verify.run", "--co", "-q", "-p", "no:cacheprovider", GATE], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the gates run at world 1" in r.stderr and "torchrun --nnodes" in r.stderr, r.stderr
    assert "test_data_parallel_boundary_only_and_equivalent" in r.stdout, r.stdout


def test_alone_main_runs_pytest_at_world_1_and_says_how_to_launch_more(monkeypatch, capsys):
    """The no-launcher branch of verify.run.main: the one line, and a pytest of its own on the gate at worlds 1..1."""
    import faulthandler

    import verify.run

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", verify.run.CONTROLLER):
        monkeypatch.delenv(k, raising=False)
    for k in ("XTRAIN_DIST_MIN_WORLD", "XTRAIN_DIST_MAX_WORLD"):
        monkeypatch.setenv(k, "4")  # this process says 4: the child it starts must say 1
    monkeypatch.setattr(faulthandler, "enable", lambda *a, **k: None)
    monkeypatch.setattr(faulthandler, "register", lambda *a, **k: None)
    seen = {}

    def run(cmd, env):  # the pytest of its own that main starts alone
        seen.update(args=cmd, worlds=(env["XTRAIN_DIST_MIN_WORLD"], env["XTRAIN_DIST_MAX_WORLD"]))
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(verify.run.subprocess, "run", run)
    assert verify.run.main(["--co", "-q", GATE]) == 0
    err = capsys.readouterr().err
    assert "the gates run at world 1" in err and "torchrun --nnodes" in err, err
    assert seen["worlds"] == ("1", "1") and seen["args"][-1] == GATE and "no:xdist" in seen["args"], seen
