"""The launched world's sub-worlds (verify/_internal/ranks/launched.py), without torchrun: three ranks serve a LaunchedPool
over a TCPStore this test hosts (as a torchrun agent hosts its store: TORCHELASTIC_USE_AGENT_STORE), as two
"nodes" (LOCAL_WORLD_SIZE 2). The two-agent torchrun runs are tests/examples/test_launcher.py."""
from __future__ import annotations

import datetime
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import dist_jobs
from verify._internal.ranks import pool, launched as pool_launched
from planted import registry as planted
from verify._internal.ranks.comm import INTER, INTRA, family
from verify._internal.gates.distributed import rank_job
from verify._internal.ranks.pool import DistJobError

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORLD, TIMEOUT = 3, 5  # XTRAIN_DIST_TIMEOUT of the ranks: how long a collective the idle rank never joins waits
RANK = "from verify._internal.ranks import comm, launched; comm.enable(); launched.serve(*launched.start('gloo'))"
pytestmark = [pytest.mark.distributed]


def _ranks(port: int) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "XTRAIN_DIST_TIMEOUT": str(TIMEOUT), "XTRAIN_TEST_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", RANK], env={**env, "RANK": str(r), "LOCAL_RANK": str(r % 2)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]


@pytest.mark.slow  # waits out a c10d time-out (~19 s): CI only, as the other job time-outs
def test_sub_worlds_run_on_subgroups_and_a_trainer_ignoring_spec_group_fails_naming_it():
    """Worlds 3 and 2 on the same three ranks; then the registry's ignores_spec_group in the sub-world of 2."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ranks = _ranks(store.port)
    launched = pool_launched.LaunchedPool(dist.PrefixStore(pool_launched.PREFIX, store),
                                          dict(world=WORLD, backend="gloo", nodes=2, ranks_per_node=2))
    pool.set_launched(launched)
    try:
        assert pool.get_pool(WORLD) is launched
        sub = pool.get_pool(2, "gloo", subgroups=True)
        assert sub is launched.sub(2) and sub.world == 2
        # world 3 spans both nodes; ranks 0..1 are node 0's, and rank 2 answers nothing of theirs
        assert [r[3:] for r in launched.run(dist_jobs.group_sum)] == [(6.0, INTER)] * WORLD
        assert sub.run(dist_jobs.group_sum) == [(r, 2, 2, 3.0, INTRA) for r in range(2)]
        assert sub.run(dist_jobs.group_sum) == [(r, 2, 2, 3.0, INTRA) for r in range(2)]  # the group is kept
        assert launched.worlds == {2, WORLD}
        # a user's recipe that declares subgroups (torch DDP over spec.group) runs its window in the sub-world: the
        # one boundary all-reduce on the subgroup, nothing before it
        from examples.ddp_no_sync import factory as ddp
        from verify._internal.cases.case import Case

        case = Case(accum_steps=2, micro_batch=1, steps=1, world=2, options=ddp.defaults)
        runs = [o.runs["torch.float32"] for o in sub.run(rank_job, ddp, case, dtypes=(torch.float32,))]
        assert [c for r in runs for c in r.comms.get(("micro", 0, 0), [])] == [], runs[0].comms
        assert "all_reduce" in {family(c.op) for r in runs for c in r.comms[("boundary", 0)]}, runs[0].comms
        bug = next(b for b in planted.PLANTED if b.name == "ignores_spec_group")  # declares subgroups, drops spec.group
        t0 = time.monotonic()
        with pytest.raises(DistJobError) as e:  # the idle rank 2 never joins: c10d's timeout, then the diagnosis
            sub.run(rank_job, bug.load(), bug.case)
        assert time.monotonic() - t0 < TIMEOUT + 15
        msg = str(e.value)
        assert "rank_job failed on rank(s) [0, 1] of world 2 on ranks 0..1 (a subgroup) of the 3" in msg, msg
        assert "DefaultGroupCollective" in msg and re.search(bug.pattern, msg), msg
        assert not launched.alive and "not usable" in _raises(lambda: sub.run(dist_jobs.group_sum))
    finally:
        pool.set_launched(None)
        for p in ranks:  # a broken world is not closed: its ranks are ended here
            p.kill()
            p.wait()


def _raises(fn) -> str:
    try:
        fn()
    except DistJobError as e:
        return str(e)
    return ""


def test_spec_group_is_never_pickled_nor_compared_and_subgroups_is_validated():
    from verify._internal.protocol import Adapter, AdapterError, Spec
    import pickle

    spec = Spec(accum_steps=2, group=object())  # a process group lives in one process
    assert pickle.loads(pickle.dumps(spec)).group is None and spec == Spec(accum_steps=2)
    with pytest.raises(AdapterError, match="subgroups must be True or False"):
        Adapter(factory=lambda s: None, data=lambda r, s: None, subgroups="yes")
