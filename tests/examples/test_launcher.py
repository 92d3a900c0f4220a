"""Multi-node without a cluster (issue 19 item 3): two torchrun agents on this host (--nnodes 2, c10d
rendezvous on localhost, 2 ranks each, gloo) run `python -m verify.run`, and the suite checks that

* the gates pass with ONE report (rank 0's), the launch described in it, and give the same verdicts and
  counts as the pool-based gates on the same seed;
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

import pytest

from verify.adapters import planted

ROOT = pathlib.Path(__file__).resolve().parents[2]
GATE = "verify.test_gates_dist::test_data_parallel_boundary_only_and_equivalent"
LINKS = ("boundary_bytes_intra_node", "boundary_bytes_inter_node")  # the one difference: the nodes the groups span
TIMEOUT = 60  # XTRAIN_DIST_TIMEOUT of the runs: a lost rank must end them well within the test's limit
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


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


def pooled(trainer: str, report: pathlib.Path) -> subprocess.CompletedProcess:
    """The same gate test under the pool-based plugin, at the launched world (4) on the same seed."""
    env = {**_env("pooled"), "XTRAIN_DIST_MIN_WORLD": "4", "XTRAIN_DIST_MAX_WORLD": "4"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--pyargs",
                           GATE, "--verify-trainer", trainer, "--verify-report", str(report), "--hypothesis-seed=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)


def _report(folder: pathlib.Path) -> dict:
    return json.loads((folder / "verify-report.json").read_text())


def _verdicts(doc: dict) -> dict:
    """What must agree between the launched and the pooled run: per gate the examples, worlds and counts
    (every field but timing), and the failures' messages."""
    gates = {name: {k: v for k, v in g.items() if "time" not in k and "second" not in k and k not in LINKS}
             for name, g in doc["gates"].items()}
    return dict(gates=gates, failures=[f["message"] for f in doc.get("failures", [])])


def test_two_agents_pass_with_one_report_and_the_pools_verdicts(tmp_path):
    codes, outs, seconds, mark = launch("verify.adapters.xtrain:adapter", tmp_path / "launched")
    assert codes == [0, 0], outs
    assert sorted(p.name for p in (tmp_path / "launched").iterdir()) == ["verify-report.json", "verify-report.md"]
    doc = _report(tmp_path / "launched")
    assert doc["settings"]["launch"] == dict(
        launcher="torchrun", nodes=2, ranks_per_node=2, world=4, backend="gloo", rendezvous="c10d",
        endpoint=doc["settings"]["launch"]["endpoint"]), doc["settings"]
    assert doc["settings"]["worlds"] == [4, 4]
    ref = pooled("verify.adapters.xtrain:adapter", tmp_path / "pooled")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    pool_doc = _report(tmp_path / "pooled")
    assert _verdicts(doc) == _verdicts(pool_doc)
    # counts split by link: the launched world's group spans both nodes, a pool's ranks are one host's
    for name, g in doc["gates"].items():
        if name.startswith("boundary-only"):
            intra, inter = (g[k] for k in LINKS)
            assert intra == [0, 0] and inter[0] > 0, g
            p = pool_doc["gates"][name]
            assert p["boundary_bytes_inter_node"] == [0, 0] and p["boundary_bytes_intra_node"] == inter, (g, p)
    assert not _marked(mark)
    print(f"launched run: {seconds:.1f} s")


def test_a_planted_bug_fails_with_the_pools_message(tmp_path):
    bug = next(b for b in planted.PLANTED if b.name == "all_reduce_every_micro_step")
    ref_ = "verify.adapters.broken_dist:all_reduce_every_micro"
    codes, outs, _, mark = launch(ref_, tmp_path / "launched")
    assert codes[0] == 1, outs  # rank 0's pytest: a gate failed (the serving ranks end cleanly)
    got = _report(tmp_path / "launched")["failures"]
    assert got and re.search(bug.pattern, got[0]["message"]), got
    ref = pooled(ref_, tmp_path / "pooled")
    assert ref.returncode == 1, ref.stdout + ref.stderr
    assert [f["message"] for f in got] == [f["message"] for f in _report(tmp_path / "pooled")["failures"]]
    assert not _marked(mark)


def test_a_rank_killed_mid_step_ends_every_agent(tmp_path):
    bug = next(b for b in planted.PLANTED if b.gate == "launcher")
    codes, outs, seconds, mark = launch("verify.adapters.broken_dist:dies_mid_step", tmp_path / "r", limit=4 * TIMEOUT)
    assert all(c != 0 for c in codes), (codes, outs)
    assert re.search(bug.pattern, "\n".join(outs)), outs  # torchrun names the dead rank's exit code
    assert seconds < 4 * TIMEOUT
    # stacks: faulthandler's on the ranks torchrun stopped, Python's on the ranks whose store went away
    assert "most recent call first" in "\n".join(outs), outs
    time.sleep(1.0)  # the agents have returned; give the kernel a moment to reap what they stopped
    assert not _marked(mark), "processes of the run still alive"
    print(f"killed run: every agent ended {seconds:.1f} s after the start")
