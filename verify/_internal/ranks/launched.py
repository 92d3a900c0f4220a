"""A launched world as a rank pool: the gates inside a world torchrun (or `srun torchrun`) started.

Under `python -m verify.run` every rank joins the launched process group and serves jobs here; rank 0 also
starts the controller (a child outside the group) that runs the gate tests. `LaunchedPool` has RankPool's
interface, so the gates reach it through `get_pool(world)` unchanged. Control plane: torchrun's c10d store
(jobs under `job/<seq>`, replies under `res/<seq>/<rank>`; no collective). Hypothesis runs on the controller
only. `sub(W)` runs jobs on subgroups of ranks 0..W-1. A partial failure or timeout marks the world broken.

Why and how (failures, hangs, exit status, sub-worlds): docs/design/distributed.md, "Launched worlds".
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import time
import traceback

from verify._internal.ranks.worker import RankContext
from verify._internal.settings import Settings, current, launcher_var

PREFIX = "xtrain-verify/"
# torchrun's variables: the launch, as the report describes it
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


def launched_env(environ=None) -> dict | None:
    """torchrun's variables when this process is a launched rank (RANK, WORLD_SIZE and LOCAL_WORLD_SIZE
    set), else None."""
    get = launcher_var if environ is None else environ.get
    if not all(get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        return None
    return {k: get(k) for k in LAUNCH_VARS if get(k) is not None}


def _agent_argv() -> list[str]:
    """The command line of the torchrun agent that started this rank (its parent), read from /proc (Linux)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return []


def _agent_option(name: str) -> str | None:
    """An option of the torchrun agent that started this rank, or None."""
    argv = _agent_argv()
    for i, a in enumerate(argv):
        for spelling in (f"--{name}", f"--{name.replace('-', '_')}"):
            if a == spelling and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(spelling + "="):
                return a.split("=", 1)[1]
    return None


def describe(env: dict, backend: str) -> dict:
    """The launch as the report shows it: nodes, ranks per node, backend, rendezvous kind."""
    world, per_node = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    nodes = int(env.get("GROUP_WORLD_SIZE") or -(-world // per_node))
    # --standalone is c10d on a local endpoint torchrun picks (it sets no --rdzv-backend on the command line)
    standalone = "--standalone" in _agent_argv()
    rdzv = _agent_option("rdzv-backend") or ("c10d" if standalone else "static" if "TORCHELASTIC_RUN_ID" in env
                                              else "unknown")
    slurm = launcher_var("SLURM_JOB_ID")
    out = dict(launcher="srun torchrun" if slurm else "torchrun", nodes=nodes,
               ranks_per_node=per_node, world=world, backend=backend, rendezvous=rdzv,
               endpoint=_agent_option("rdzv-endpoint") or f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}")
    if slurm:
        out["slurm_job"] = slurm
    return out


def node_of(rank: int, per_node: int) -> int:
    """torchrun numbers ranks node by node: rank r lives on node r // LOCAL_WORLD_SIZE."""
    return rank // per_node


def hang_limit(timeout: float) -> float:
    """Seconds a rank may spend in one job before faulthandler dumps its stacks and ends it: past the process
    group's own timeout (which raises first, in a collective), so only a rank stuck outside c10d hits it."""
    return 2 * timeout + 30.0


def start(backend: str, settings: Settings | None = None) -> tuple[RankContext, object]:
    """Join the launched world (call after comm.enable(), before anything else loads torch.distributed):
    init_process_group from torchrun's env, the flight recorder checked, the store of the control plane.
    `settings`: the rank's (default settings.current())."""
    import datetime

    import torch
    import torch.distributed as dist

    from verify._internal.ranks import comm

    s = settings or current()
    torch.set_num_threads(s.threads)
    rank, world, local = (int(launcher_var(k, "0")) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=s.timeout), device_id=None)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # first optimizer imports torch._dynamo (~1 s)
    comm.record_p2p()
    recorder = comm.Recorder()
    recorder.check_recording(lambda: dist.all_reduce(torch.zeros(1, device=device)))
    return RankContext(rank, world, backend, device, recorder, {}), connect(s.timeout)


def connect(timeout: float):
    """The control plane: a client of the store torchrun's MASTER_ADDR:MASTER_PORT names (the agent's, or rank
    0's), under our prefix. The controller, outside the process group, connects the same way."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(launcher_var("MASTER_ADDR"), int(launcher_var("MASTER_PORT")), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(PREFIX, store)


def _wait(store, key: str, deadline: float | None, alive=None) -> bool:
    """Poll for `key`: True when set, False past the deadline or once `alive()` is false. A store that is
    gone (its host rank or agent died) raises, which ends the rank. Every 2 ms for the first second (a job
    and its reply follow each other closely: coarser polls cost a shrinking run 3x its pool time), then
    every 50 ms (the controller's one-process work can take minutes). A check() is ~10 µs; store.wait()
    would block, but each of its time-outs, needed to watch `alive`, logs a c10d warning."""
    start = time.monotonic()
    while not store.check([key]):
        now = time.monotonic()
        if (deadline is not None and now > deadline) or (alive is not None and not alive()):
            return False
        time.sleep(0.002 if now - start < 1.0 else 0.05)
    return True


def _execute(ctx, job, timeout: float) -> bytes:
    fn, args, kwargs = job
    faulthandler.dump_traceback_later(hang_limit(timeout), exit=True)
    try:
        from verify._internal.ranks import wire

        return wire.dumps(("ok", fn(ctx, *args, **kwargs)))
    except BaseException:
        return pickle.dumps(("err", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


class DefaultGroupCollective(RuntimeError):
    """A sub-world's trainer issued a collective on the default group, which the idle ranks never join."""


def _sub_job(ctx, W: int, fn, args, kwargs):
    """On every launched rank: `fn` on ranks 0..W-1 as a world of W over their subgroup; None on the others."""
    import torch.distributed as dist

    groups = ctx.state.setdefault("subgroups", {})
    if W not in groups:  # new_group is collective over the default group: every rank, in the same job order
        groups[W] = dist.new_group(list(range(W)), group_desc=f"sub-world of {W}")  # named in the counts' messages
    if ctx.rank >= W:
        return None
    sub = RankContext(ctx.rank, W, ctx.backend, ctx.device, ctx.recorder, ctx.state.setdefault(("sub", W), {}),
                      groups[W])
    try:
        return fn(sub, *args, **kwargs)
    except Exception as e:
        whole = _on_default_group(ctx.recorder)
        if whole:  # the idle ranks never join a collective of the whole world: it timed out (or failed) here
            raise DefaultGroupCollective(
                f"in a sub-world of {W} of the launched {ctx.world} ranks the trainer issued {whole} on the default "
                f"group (all {ctx.world} ranks) instead of Spec.group: an adapter that declares subgroups=True must "
                f"reduce over spec.group when it is given (and make no process group of its own)") from e
        raise


def _on_default_group(recorder) -> str:
    """The collectives the recorder saw on the default group since its last read, described ("" if none)."""
    import torch.distributed as dist

    try:
        name = str(dist.group.WORLD.group_name)
        return ", ".join(sorted({c.op for c in recorder.read() if c.group == name}))
    except Exception:  # noqa: BLE001  (an overflowed ring, a destroyed group: no diagnosis, the error stands)
        return ""


def serve(ctx, store, alive=None, settings: Settings | None = None) -> int | None:
    """Every rank: run each job the controller publishes, in order, until told to stop (returns the run's exit
    status, which close() published), or, on rank 0, until its controller child is gone without saying so
    (`alive`; None). Waiting for the next job has no deadline: the controller may spend minutes on gates of one
    process; a store that goes away (its agent or host died) raises and ends the rank."""
    timeout = (settings or current()).timeout
    seq = 0
    while True:
        if not _wait(store, f"job/{seq}", None, alive):
            return None
        job = pickle.loads(store.get(f"job/{seq}"))
        if job is None:
            break
        store.set(f"res/{seq}/{ctx.rank}", _execute(ctx, job, timeout))
        seq += 1
    status = int(store.get("status")) if store.check(["status"]) else 0
    _shutdown()
    return status


def _shutdown() -> None:
    import torch.distributed as dist

    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # a broken world: exit all the same
        pass


class LaunchedPool:
    """RankPool's interface over the launched world, in the controller; `launch` is describe()'s dict, from
    rank 0 (the controller's parent is rank 0, not the agent); `settings`: the controller's (default
    settings.current())."""

    def __init__(self, store, launch: dict, settings: Settings | None = None):
        self.store, self.launch, self.settings = store, launch, settings or current()
        self.world, self.backend = launch["world"], launch["backend"]
        self.broken: str | None = None
        self._seq = 0
        self._pending = None
        self._subs: dict = {}
        self.worlds: set = set()  # the worlds whose jobs ran on the launched ranks (the report says which)

    def sub(self, world: int) -> "SubWorld":
        """The view of ranks 0..world-1 as a world of their own, on a subgroup (2 ≤ world < this world)."""
        if not 2 <= world < self.world:
            raise ValueError(f"a sub-world of the launched {self.world} ranks has 2..{self.world - 1} ranks, got {world}")
        return self._subs.setdefault(world, SubWorld(self, world))

    @property
    def alive(self) -> bool:
        return self.broken is None

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        self.submit(fn, *args, **kwargs)
        return self.result(timeout)

    def submit(self, fn, *args, **kwargs) -> None:
        self._publish((fn, args, kwargs), self.world, fn)

    def _publish(self, job: tuple, world: int, fn) -> None:
        """Publish `job` (fn, args, kwargs) to every launched rank, to be judged as a job of `world` ranks (a
        SubWorld's: fn runs inside _sub_job), named after `fn`."""
        from verify._internal.ranks.pool import DistJobError

        if self.broken is not None:
            raise DistJobError(f"the launched world of {self.world} ranks is not usable: {self.broken}")
        if self._pending is not None:
            raise RuntimeError(f"the launched world already runs {self._pending[1]}")
        from verify._internal.ranks import wire

        self.store.set(f"job/{self._seq}", wire.dumps(job))
        self._pending = (world, getattr(fn, "__qualname__", repr(fn)))
        self.worlds.add(world)

    def result(self, timeout: float | None = None) -> list:
        return self._collect(timeout or self.settings.timeout)

    def _collect(self, timeout: float) -> list:
        """Every launched rank's reply to the pending job, by rank; a job of a sub-world of W keeps ranks < W's."""
        from verify._internal.ranks.pool import DistJobError, DistTimeout

        if self._pending is None:
            raise RuntimeError("result() without a submitted job")
        (W, what), self._pending = self._pending, None
        seq, self._seq = self._seq, self._seq + 1
        replies, deadline = {}, time.monotonic() + timeout
        for r in range(self.world):
            if replies and any(k == "err" for k, _ in replies.values()):  # one failed: a short grace for the rest
                deadline = min(deadline, time.monotonic() + 10.0)
            if _wait(self.store, f"res/{seq}/{r}", deadline):
                replies[r] = pickle.loads(self.store.get(f"res/{seq}/{r}"))
                self.store.delete_key(f"res/{seq}/{r}")
        if len(replies) == self.world:
            self.store.delete_key(f"job/{seq}")  # every rank has read it
        errors = {r: v for r, (k, v) in sorted(replies.items()) if k == "err"}
        stuck = [r for r in range(self.world) if r not in replies]
        if not errors and not stuck:
            return [replies[r][1] for r in range(W)]
        parts = [f"--- rank {r} raised:\n{tb.rstrip()}" for r, tb in errors.items()]
        parts += [f"--- rank {r} did not answer within {timeout:.0f} s (it prints its own stacks when its job "
                  f"passes {hang_limit(timeout):.0f} s)" for r in stuck]
        # some ranks may be inside a collective the others left, or a sub-world's inside one of the whole world
        if stuck or len(errors) < W or any(DefaultGroupCollective.__name__ in tb for tb in errors.values()):
            self.broken = f"{what} failed on rank(s) {sorted(errors) + stuck} only"
        where = f"{self.launch['nodes']} node(s) × {self.launch['ranks_per_node']} ({self.backend}, launched)"
        if W < self.world:
            where = f"ranks 0..{W - 1} (a subgroup) of the {self.world} on {where}"
        if errors:
            raise DistJobError(f"{what} failed on rank(s) {sorted(errors)} of world {W} on {where}\n"
                               + "\n".join(parts))
        raise DistTimeout(f"{what} timed out after {timeout:.0f} s in the world of {W} on {where}; "
                          f"rank(s) {stuck} hung\n" + "\n".join(parts), hung=stuck)

    def close(self, timeout: float = 10.0, status: int = 0) -> None:
        """Tell every rank to stop, and to exit with `status` (the run's): each barriers and destroys its group,
        as pool ranks do. Every rank exits as rank 0 does because torchrun's agents otherwise wait: an agent
        whose ranks succeeded waits up to 300 s at its exit barrier for one whose ranks failed, which never
        comes (seen: a failed gate's two-agent run took 330 s instead of 23 s when the other agent held the store)."""
        if self.broken is None:
            self.store.set("status", str(status))
            self.store.set(f"job/{self._seq}", pickle.dumps(None))
            self.broken = "closed"

    def kill(self) -> None:
        self.broken = self.broken or "killed"


class SubWorld:
    """RankPool's interface over ranks 0..world-1 of a launched world (LaunchedPool.sub): its jobs go to every
    launched rank (the idle ones answer None), through the launched world's one job sequence."""

    def __init__(self, launched: LaunchedPool, world: int):
        self.launched, self.world, self.backend = launched, world, launched.backend

    @property
    def alive(self) -> bool:
        return self.launched.alive

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        self.submit(fn, *args, **kwargs)
        return self.result(timeout)

    def submit(self, fn, *args, **kwargs) -> None:
        self.launched._publish((_sub_job, (self.world, fn, args, kwargs), {}), self.world, fn)

    def result(self, timeout: float | None = None) -> list:
        """Past the process group's own timeout: a collective the idle ranks never join (a trainer that ignores
        Spec.group) raises on its ranks first, with the diagnosis of _sub_job, before the controller gives up."""
        return self.launched._collect((timeout or self.launched.settings.timeout) + 15.0)

    def close(self, timeout: float = 10.0) -> None:
        """Nothing of its own to stop: the launched world's close() ends every rank."""

    def kill(self) -> None:
        self.launched.kill()
