"""verify.run's command line: what pytest is asked to collect, and how the launch is described."""
from __future__ import annotations

import pytest

from verify._internal.ranks import launched as pool_launched
from verify.run import pytest_args


@pytest.mark.parametrize("argv,collects_verify", [
    (["--verify-trainer", "mypkg.train:factory"], True),
    # a trainer that lives in verify (a planted bug) is an option's value, not a test to run: the gates still run
    (["--verify-trainer", "planted.broken_dist:all_reduce_every_micro"], True),
    (["--verify-trainer", "m:f", "verify.test_gates_dist::test_data_parallel_boundary_only_and_equivalent"], False),
    (["verify/test_gates.py", "-k", "bit"], False),
])
def test_the_gates_are_collected_unless_tests_of_verify_are_named(argv, collects_verify):
    args = pytest_args(argv)
    at = args.index("--pyargs")
    assert args[:2] == ["-p", "no:xdist"] and args[-len(argv):] == argv
    assert (args[at + 1] == "verify") == collects_verify, args


@pytest.mark.parametrize("agent,rdzv", [
    (["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "verify.run"], "c10d"),
    (["torchrun", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29500", "-m", "verify.run"], "c10d"),
    (["torchrun", "--nnodes", "2", "--rdzv_backend=etcd-v2", "-m", "verify.run"], "etcd-v2"),
    (["torchrun", "--master-addr", "h", "--nproc-per-node", "2", "-m", "verify.run"], "static"),
])
def test_the_rendezvous_is_read_from_the_agents_command_line(monkeypatch, agent, rdzv):
    monkeypatch.setattr(pool_launched, "_agent_argv", lambda: agent)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    env = dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x", MASTER_ADDR="h", MASTER_PORT="1")
    d = pool_launched.describe(env, "gloo")
    assert (d["rendezvous"], d["nodes"], d["ranks_per_node"], d["world"]) == (rdzv, 2, 2, 4), d


def test_a_bare_checkout_loads_the_plugin_once(monkeypatch):
    """Without the pytest11 entry point (a checkout on PYTHONPATH, no pip install: the H200 run that found this
    refused --verify-trainer as unknown), verify.run names the plugin; installed, or already named by the caller
    (gpu_gate's launched step), it does not name it again."""
    import importlib.metadata as md

    monkeypatch.setattr(md, "entry_points", lambda group=None: [])
    assert pytest_args(["--verify-trainer", "m:f"])[:5] == ["-p", "no:xdist", "-p", "_xtrain_pytest.entry", "--pyargs"]
    assert pytest_args(["-p", "_xtrain_pytest.entry", "-q"]).count("_xtrain_pytest.entry") == 1
    monkeypatch.setattr(md, "entry_points", lambda group=None: [type("EP", (), {"value": "_xtrain_pytest.entry"})()])
    assert "_xtrain_pytest.entry" not in pytest_args(["--verify-trainer", "m:f"])
