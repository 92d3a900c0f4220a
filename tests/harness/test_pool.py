"""Rank pools (verify/_internal/ranks/pool.py): warm reuse, a failing rank's traceback, a hung job's stack dumps and
timeout, and no orphan processes whatever way the owner ends."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import dist_jobs
from verify._internal.ranks.pool import DistJobError, DistTimeout, RankPool, get_pool

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def _wait_gone(pids, seconds=15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if not _gone(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def test_pool_is_reused_warm():
    pool = get_pool(2)
    first = pool.run(dist_jobs.whoami)
    again = get_pool(2).run(dist_jobs.whoami)
    assert first == again and [r for r, _ in first] == [0, 1]


def test_failing_rank_traceback_in_the_error():
    pool = RankPool(2)
    with pytest.raises(DistJobError) as e:
        pool.run(dist_jobs.raise_on_rank, 1)
    msg = str(e.value)
    assert "raise_on_rank failed on rank(s) [1] of world 2" in msg
    assert "ValueError: deliberate failure on rank 1" in msg and "Traceback" in msg
    # rank 0 was left waiting in the all_reduce: its stack says so
    assert "rank 0 did not finish" in msg and "in raise_on_rank" in msg, msg
    assert not pool.alive and _wait_gone(pool.pids) == []


@pytest.mark.slow  # waits out a job timeout
def test_hung_job_times_out_with_stack_dumps(settings_with):
    settings_with(timeout=2)
    pool = RankPool(2)
    t0 = time.monotonic()
    with pytest.raises(DistTimeout) as e:
        pool.run(dist_jobs.sleep, 60)
    assert time.monotonic() - t0 < 20
    msg = str(e.value)
    assert "timed out after 2 s (XTRAIN_DIST_TIMEOUT overrides)" in msg and "rank(s) [0, 1] hung" in msg
    assert msg.count('dist_jobs.py", line') >= 2 and "in sleep" in msg, msg  # each rank's Python stack
    assert not pool.alive and _wait_gone(pool.pids) == []


OWNER = """
import sys
sys.path.insert(0, {root!r})
from tests.helpers import dist_jobs
from verify._internal.ranks.pool import get_pool
pool = get_pool(2)
print(*pool.pids, flush=True)
pool.run(dist_jobs.sleep, 120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_no_orphans_when_the_owner_ends(sig):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it), SIGTERM, even SIGKILL of the
    owner: every rank process is gone within seconds."""
    # the owner is a user's process at a terminal: Ctrl-C's default disposition and no launcher variables, whatever
    # the test process inherited (a full CI run failed here twice at 30 s; alone the test passes: suspected leak)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                          "MASTER_ADDR", "MASTER_PORT", "XTRAIN_RUN_CONTROLLER")}
    p = subprocess.Popen([sys.executable, "-c", OWNER.format(root=ROOT)], stdout=subprocess.PIPE, env=env,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = p.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, (line, p.stderr.read() if p.poll() is not None else "")
        time.sleep(0.5)  # the job is running
        if sig == signal.SIGINT:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        p.wait(30)
        assert _wait_gone(pids) == [], f"orphans after {sig.name}: {pids}"
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


@pytest.mark.parametrize("code,needle", [(9, "rank 1 died (exit code 9) without a reply"),
                                         (-9, "rank 1 died (killed by signal SIGKILL) without a reply")])
def test_a_dead_rank_is_reported_with_its_exit_code_or_signal(code, needle):
    pool = RankPool(2)
    with pytest.raises(DistJobError) as e:
        pool.run(dist_jobs.exit_on_rank, 1, code)
    assert needle in str(e.value), str(e.value)
    assert _wait_gone(pool.pids) == []


STALE_OWNER = """
import sys
sys.path.insert(0, {root!r})
from verify._internal.ranks.pool import RankPool
pool = RankPool(1)
print(pool.dir, flush=True)
import time
time.sleep(120)
"""


@pytest.mark.slow
def test_folders_of_sigkilled_owners_are_reclaimed_by_the_next_pool(tmp_path):
    """2 pool owners killed with SIGKILL (nothing of theirs runs to clean up) leave their folders; the next pool
    that starts removes the folders whose owner is dead and keeps its own, live owner's."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    owners = [subprocess.Popen([sys.executable, "-c", STALE_OWNER.format(root=ROOT)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, start_new_session=True) for _ in range(2)]
    dirs = []
    for p in owners:
        line = p.stdout.readline().strip()
        assert line.startswith(str(tmp_path)), (line, p.stderr.read() if p.poll() is not None else "")
        dirs.append(line)
    for p in owners:
        os.killpg(p.pid, signal.SIGKILL)  # the owner and its ranks: nothing gets to clean up
        p.wait(30)
        p.communicate()
    assert all(os.path.isdir(d) for d in dirs), dirs  # nobody left to clean them
    live = subprocess.Popen([sys.executable, "-c", STALE_OWNER.format(root=ROOT)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        live_dir = live.stdout.readline().strip()
        left = [d for d in os.listdir(tmp_path) if d.startswith("xtrain-pool-")]
        assert left == [os.path.basename(live_dir)], left  # both reclaimed, the live owner's kept
    finally:
        os.killpg(live.pid, signal.SIGKILL)
        live.communicate()


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_ranks_fork_with_the_trainer_module_already_imported():
    """On the cpu the gloo pool's forkserver imports the module load_adapter imported, so no rank imports a framework
    again; on cuda it does not (a module touching CUDA at import would break its forks). A fresh process: the
    forkserver's preload is fixed when it starts."""
    code = ("from tests.helpers.dist_jobs import has_module\n"
            "from verify._internal.ranks.pool import RankPool, _preload\n"
            "from verify._internal.protocol import load_adapter\n"
            "load_adapter('examples.mlp_regressor:factory')\n"
            "print(RankPool(1, 'gloo').run(has_module)[0], _preload()[-1])\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "XTRAIN_POOL_START": "forkserver"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "examples.mlp_regressor"], r.stdout
    from verify._internal.ranks.pool import PRELOAD, _preload

    from verify._internal.settings import current

    assert _preload(current().replace(device="cuda")) == PRELOAD
