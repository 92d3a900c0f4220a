"""python -m verify.run [--verify-trainer MODULE:FACTORY] [--verify-report DIR] [pytest args]

The gates inside the world a launcher started, instead of rank pools spawned on one host:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m verify.run --verify-trainer mypkg.train:factory --verify-report reports

Every rank serves jobs (verify/_internal/ranks/launched.py); rank 0 starts the controller that runs pytest on
the gate tests and writes the one report. Alone, it runs the gates at world 1. Exit status: pytest's, on every
rank (0 passed, 1 a gate failed, 4 usage error). Why and how: docs/design/distributed.md, "Launched worlds".
"""
from __future__ import annotations

import faulthandler
import json
import signal
import subprocess
import sys

HOW = ("verify.run: no launcher (RANK/WORLD_SIZE/LOCAL_WORLD_SIZE unset): the gates run at world 1. For more "
       "ranks: torchrun --nnodes M --nproc-per-node G [--rdzv-backend c10d --rdzv-endpoint HOST:PORT] "
       "-m verify.run --verify-trainer MODULE:FACTORY (docs/verify-your-trainer.md, \"On your cluster\")")


def _option(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _factory(arg: str) -> bool:
    """MODULE:FACTORY (an option's value, e.g. --verify-trainer mypkg.train:factory), not a test id
    (which separates with '::')."""
    return ":" in arg and "::" not in arg


def pytest_args(argv: list[str]) -> list[str]:
    """verify's gate tests in this process: `--pyargs verify` unless the arguments name tests of verify
    themselves (e.g. verify.test_gates_dist::test_...); never xdist (the launched world is the parallelism)."""
    named = any(a.split("::")[0].split(".")[0].split("/")[0] == "verify" and not _factory(a)
                for a in argv if not a.startswith("-"))
    from verify._internal.cli import plugin_args

    return ["-p", "no:xdist", *plugin_args(argv), "--pyargs"] + ([] if named else ["verify"]) + argv


CONTROLLER = "XTRAIN_RUN_CONTROLLER"  # set in the controller's environment: the launch and rank 0's Settings, as JSON


def _die_with_parent() -> None:
    """The controller ends with rank 0: SIGTERM when its parent dies (faulthandler prints its stacks first)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def controller(argv: list[str], launch: dict, settings: dict) -> int:
    """Rank 0's child, outside the process group: pytest on the gate tests, the launched world as the pool of
    its world (under rank 0's Settings, sent as `settings`: Settings.to_dict), the one report."""
    _die_with_parent()
    from verify._internal.ranks import pool, launched as pool_launched
    from verify._internal.settings import Settings

    pool.keep_sigterm()
    s = Settings.from_dict(settings)
    world = pool_launched.LaunchedPool(pool_launched.connect(s.timeout), launch, s)
    pool.set_launched(world)
    import pytest

    status = 1  # pytest raised: a failed run
    try:
        status = int(pytest.main(pytest_args(argv)))
        return status
    finally:
        pool.close_all()  # the one-rank pools of the references
        world.close(status=status)  # every launched rank exits with it
        pool.set_launched(None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # torchrun stops a failed run's ranks with SIGTERM: print where each was first (chain: then die of it)
    faulthandler.enable()
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    from verify._internal.settings import Settings, SettingError, child_environ, env_of, install, launcher_var

    if launcher_var(CONTROLLER):
        sent = json.loads(launcher_var(CONTROLLER))
        return controller(argv, sent["launch"], sent["settings"])
    from verify._internal.ranks import launched as pool_launched

    env = pool_launched.launched_env()
    if env is None:
        print(HOW, file=sys.stderr)
        # alone: world 1 only, in a pytest of its own whose environment says so (this one's is left as it is)
        one = {env_of("min_world"): "1", env_of("max_world"): "1"}
        return subprocess.run([sys.executable, "-m", "pytest", *pytest_args(argv)], env={**child_environ(), **one}).returncode
    try:
        s = install(Settings.from_env(backend=_option(argv, "--verify-backend"), device=_option(argv, "--verify-device")))
    except SettingError as e:
        print(f"verify.run: error: {e}", file=sys.stderr)
        return 4
    from verify._internal.ranks import comm

    comm.enable(nccl=s.backend == "nccl")  # before torch.distributed creates the group
    ctx, store = pool_launched.start(s.backend, s)
    if ctx.rank != 0:
        return pool_launched.serve(ctx, store, settings=s) or 0
    # The controller: a fresh process with no process group (the gates of one process build their trainers in
    # it, and a trainer that sees an initialized world of W would join it) and no launched rank's variables.
    child_env = child_environ(drop=pool_launched.LAUNCH_VARS[:6])
    child_env[CONTROLLER] = json.dumps(dict(launch=pool_launched.describe(env, s.backend), settings=s.to_dict()))
    child = subprocess.Popen([sys.executable, "-m", "verify.run", *argv], env=child_env)
    if pool_launched.serve(ctx, store, alive=lambda: child.poll() is None, settings=s) is None:
        print(f"verify.run: the controller ended ({child.returncode}) without stopping the ranks", file=sys.stderr)
        return child.returncode or 1
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
