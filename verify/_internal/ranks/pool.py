"""Persistent rank pools: `world` worker processes that stay alive across examples.

    pool = get_pool(world=2)                      # spawned on first use, reused afterwards
    results = pool.run(fn, *args)                 # fn(ctx, *args) on every rank; a list by rank

One pool per (world, backend) per process: fresh processes (a forkserver that imported torch for gloo, spawn
for NCCL), the parent's Settings pickled to each rank, a FileStore rendezvous, jobs as pickle bytes over one
pipe per rank, tracebacks and hung ranks' stacks on failure, no orphans, a clean shutdown. The rank side is
verify/_internal/ranks/worker.py; torch loads lazily, after the flight recorder is on.
Why each choice, and what it measured: docs/design/distributed.md, "Rank pools".
"""
from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing import connection

from verify._internal.ranks.worker import RankContext, worker_main  # noqa: F401  (RankContext: re-exported)
from verify._internal.settings import Settings, current, env_of

ENV_TIMEOUT, ENV_START = env_of("timeout"), env_of("pool_start")
# What the forkserver imports once, so each rank starts in ~0.1 s instead of ~3 s (import torch, and
# the first optimizer's import of torch._dynamo). The server is single-threaded when it forks.
PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.nn.parallel"]


def _preload(settings: Settings | None = None) -> list[str]:
    """PRELOAD, plus on the cpu the trainer modules verify._internal.protocol.load_adapter imported: a rank then does not
    import its framework again (Lightning or transformers cost each rank 1.5-2.5 s of CPU). Not on cuda: a module
    that touches CUDA when imported would break every child forked after it. Read when this process starts its
    forkserver, i.e. at its first gloo pool."""
    from verify._internal.protocol import loaded_modules

    return PRELOAD + (loaded_modules() if (settings or current()).device == "cpu" else [])


def start_method(backend: str = "gloo", settings: Settings | None = None) -> str:
    """gloo: forkserver (torch preloaded) where available, else spawn. NCCL: spawn — a server that has
    imported torch might have touched the CUDA runtime, which a forked child cannot use. Override with
    XTRAIN_POOL_START=spawn|forkserver."""
    import multiprocessing as mp

    fork_ok = backend != "nccl" and "forkserver" in mp.get_all_start_methods()
    return (settings or current()).pool_start or ("forkserver" if fork_ok else "spawn")


def job_timeout(settings: Settings | None = None) -> float:
    return (settings or current()).timeout


def default_backend(settings: Settings | None = None) -> str:
    """XTRAIN_DIST_BACKEND, else by the device: nccl on cuda, gloo on the cpu (verify/_internal/settings.py)."""
    return (settings or current()).backend


class DistJobError(AssertionError):
    """A job failed on some rank (message: every rank's traceback), or hung (message: stack dumps)."""


class DistTimeout(DistJobError):
    def __init__(self, msg: str = "", hung=()):
        super().__init__(msg)
        self.hung = list(hung)  # the ranks that never answered (their stacks are in the message)


# -- the parent side ------------------------------------------------------------------------------

class RankPool:
    """`world` spawned ranks in one process group (gloo on CPU, or NCCL with rank r on cuda:r), under `settings`
    (default: this process's, settings.current()), which every rank gets as its own."""

    def __init__(self, world: int, backend: str | None = None, *, threads: int | None = None,
                 start_timeout: float | None = None, per_node: int | None = None, settings: Settings | None = None):
        import multiprocessing as mp

        self.settings = s = settings or current()
        self.world, self.backend = world, backend or s.backend
        # ranks per (emulated) node: each rank's LOCAL_WORLD_SIZE, whence comm.group_links' nodes
        self.per_node = per_node or s.per_node(world)
        self.threads = threads or s.threads
        reclaim_stale()
        # The owner's pid is in the name: a later pool can tell whether this folder's owner still lives.
        self.dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}w{world}-{os.getpid()}-")
        self.start_method = start_method(self.backend, s)
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(_preload(s))
        self.procs, self.conns, self.dumps = [], [], []
        self.broken = False
        self._pending: str | None = None  # the job in flight (one at a time)
        try:
            for r in range(world):
                here, there = ctx.Pipe(duplex=True)
                dump = os.path.join(self.dir, f"stacks-rank{r}.txt")
                p = ctx.Process(target=worker_main, name=f"xtrain-rank{r}-of-{world}", daemon=True,
                                args=(r, world, self.backend, os.path.join(self.dir, "store"), there, dump,
                                      self.threads, os.getpid(), max(600.0, 2 * s.timeout), self.per_node, s))
                p.start()
                there.close()
                self.procs.append(p)
                self.conns.append(here)
                self.dumps.append(dump)
            replies = self._collect("start-up", start_timeout or max(180.0, s.timeout))
        except BaseException:
            self.kill()
            raise
        self.pids = replies

    @property
    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """fn(ctx, *args, **kwargs) on every rank; returns the results by rank, or raises DistJobError."""
        self.submit(fn, *args, **kwargs)
        return self.result(timeout)

    def submit(self, fn, *args, **kwargs) -> None:
        """Start fn(ctx, *args, **kwargs) on every rank and return at once; `result()` collects it. Lets the
        harness keep two pools busy at the same time (e.g. the world-1 reference beside a world-W run)."""
        if not self.alive:
            raise DistJobError(f"pool of world {self.world} is not usable (a previous job failed or hung)")
        if self._pending is not None:
            raise RuntimeError(f"pool of world {self.world} already runs {self._pending}")
        from verify._internal.ranks import wire

        payload = wire.dumps((fn, args, kwargs))
        try:
            for c in self.conns:
                c.send_bytes(payload)
        except BaseException:
            self.kill()
            raise
        self._pending = getattr(fn, "__qualname__", repr(fn))

    def result(self, timeout: float | None = None) -> list:
        what, self._pending = self._pending, None
        if what is None:
            raise RuntimeError("result() without a submitted job")
        try:
            return self._collect(what, timeout or self.settings.timeout)
        except BaseException:
            self.kill()  # KeyboardInterrupt included: ranks may be mid-collective
            raise

    def _collect(self, what: str, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple] = {}
        pending = {c: r for r, c in enumerate(self.conns)}
        first_err = None
        while pending:
            now = time.monotonic()
            if first_err is not None:  # one rank failed: the others get a short grace, then are dumped
                limit = min(deadline, first_err + 3.0)
            else:
                limit = deadline
            ready = connection.wait(list(pending), timeout=max(0.0, limit - now))
            if not ready:
                break
            for c in ready:
                r = pending.pop(c)
                try:
                    got[r] = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    got[r] = ("err", f"rank {r} died ({self._death(r)}) without a reply")
                if got[r][0] == "err" and first_err is None:
                    first_err = time.monotonic()
        errors = {r: v for r, (k, v) in sorted(got.items()) if k == "err"}
        if not pending and not errors:
            return [got[r][1] for r in range(self.world)]
        # Failure: collect stacks of ranks that never answered, then replace the pool.
        stuck = sorted(pending.values())
        stacks = self._stacks(stuck)
        self.kill()
        parts = []
        for r, tb in errors.items():
            parts.append(f"--- rank {r} raised:\n{tb.rstrip()}")
        for r in stuck:
            parts.append(f"--- rank {r} did not finish; its Python stacks:\n{stacks.get(r, '(no dump)').rstrip()}")
        if errors:
            head = f"{what} failed on rank(s) {sorted(errors)} of world {self.world}"
            raise DistJobError(head + "\n" + "\n".join(parts))
        raise DistTimeout(f"{what} timed out after {timeout:.0f} s ({ENV_TIMEOUT} overrides) in a pool of world "
                          f"{self.world} ({self.backend}); rank(s) {stuck} hung\n" + "\n".join(parts), hung=stuck)

    def _death(self, r: int) -> str:
        """How rank r ended: its pipe closed first, so wait a moment for the process to be reaped."""
        p = self.procs[r]
        p.join(5)
        code = p.exitcode
        if code is None:
            return "pipe closed, process still running"
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        if not ranks:
            return {}
        sizes = {}
        for r in ranks:
            try:
                sizes[r] = os.path.getsize(self.dumps[r])
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        _settled(self.dumps, sizes)
        out = {}
        for r in sizes:
            try:
                with open(self.dumps[r]) as f:
                    f.seek(sizes[r])
                    out[r] = f.read()
            except OSError:
                pass
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Graceful: each rank barriers, destroys its group and exits 0; stragglers are killed."""
        if self.alive:
            try:
                for c in self.conns:
                    c.send_bytes(pickle.dumps(None))
                deadline = time.monotonic() + timeout
                for p in self.procs:
                    p.join(max(0.0, deadline - time.monotonic()))
            except (OSError, EOFError):
                pass
        self.kill()

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        for c in self.conns:
            c.close()
        shutil.rmtree(self.dir, ignore_errors=True)


DIR_PREFIX = "xtrain-pool-"


def reclaim_stale() -> list[str]:
    """Remove the rendezvous folders of pool owners that are gone (an owner killed with SIGKILL never
    cleans up): <tmp>/xtrain-pool-w<W>-<owner pid>-<random> with no process of that pid. Returns them."""
    tmp, out = tempfile.gettempdir(), []
    try:
        names = os.listdir(tmp)
    except OSError:
        return out
    for name in names:
        parts = name[len(DIR_PREFIX):].split("-") if name.startswith(DIR_PREFIX) else []
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): keep it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        out.append(name)
    return out


_POOLS: dict[tuple, RankPool] = {}
_LOCK = threading.Lock()


_LAUNCHED = None  # the launched world's pool (verify/_internal/ranks/launched.py), under `python -m verify.run`


def set_launched(pool) -> None:
    """Under a launcher: get_pool(its world) returns `pool` (None: back to spawned pools only)."""
    global _LAUNCHED
    _LAUNCHED = pool


def launched():
    """The launched world's pool, or None when the gates run on spawned pools."""
    return _LAUNCHED


def get_pool(world: int, backend: str | None = None, *, subgroups: bool = False,
             settings: Settings | None = None) -> RankPool:
    """This process's pool for (world, backend, ranks per node: XTRAIN_RANKS_PER_NODE) under `settings` (default
    settings.current(); pools under other Settings are other pools), spawned on first use and
    replaced if it broke. Under a launcher the launched world's pool for its world (a broken one is not
    replaced: its jobs say why), and for 2 ≤ world below it, when `subgroups` (the adapter declares it honours
    Spec.group), the launched ranks 0..world-1 on a subgroup (LaunchedPool.sub); else a pool spawned here."""
    L = _LAUNCHED
    if L is not None and (backend or L.backend) == L.backend and (world == L.world or subgroups and 2 <= world < L.world):
        return L if world == L.world else L.sub(world)
    s = settings or current()
    key = (world, backend or s.backend, s.per_node(world), _key_of(s))
    with _LOCK:
        pool = _POOLS.get(key)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.kill()
            _install_sigterm()
            pool = _POOLS[key] = RankPool(world, key[1], per_node=key[2], settings=s)
        return pool


def _key_of(s: Settings) -> tuple:
    """What of `s` a pool's ranks were started with: another value of any of these is another pool."""
    return (s.device, s.threads, s.timeout, s.pool_start, s.gpu_lock, s.git_commit)


def close_all() -> None:
    while _POOLS:
        _, pool = _POOLS.popitem()
        try:
            pool.close()
        except BaseException:
            pool.kill()


atexit.register(close_all)
_SIGTERM_INSTALLED = False


def keep_sigterm() -> None:
    """Leave SIGTERM to its owner: a launched rank (verify.run) keeps faulthandler's C-level handler, which
    prints the stacks when torchrun stops the run (a Python handler would wait for the main thread to leave
    a collective). Its pools still die with it (PR_SET_PDEATHSIG, EOF on their pipes)."""
    global _SIGTERM_INSTALLED
    _SIGTERM_INSTALLED = True


def _install_sigterm() -> None:
    """On SIGTERM close the pools, then die of SIGTERM as before (only if nobody else handles it)."""
    global _SIGTERM_INSTALLED
    if _SIGTERM_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def on_term(signum, frame):
        for pool in list(_POOLS.values()):
            pool.kill()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    _SIGTERM_INSTALLED = True


def _settled(dumps: list, sizes: dict, within: float = 1.0, step: float = 0.02) -> None:
    """Wait until every signalled rank's dump file has grown and then held its size for one poll (faulthandler writes
    from a signal handler, in pieces), at most `within` seconds: a dump is read whole, in ~50 ms rather than 1 s."""
    deadline, last = time.monotonic() + within, None
    while time.monotonic() < deadline:
        now = {}
        for r, before in sizes.items():
            try:
                now[r] = os.path.getsize(dumps[r])
            except OSError:
                now[r] = before
        if all(now[r] > sizes[r] for r in sizes) and now == last:
            return
        last = now
        time.sleep(step)
