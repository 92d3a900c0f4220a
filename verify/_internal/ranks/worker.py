"""The rank side of a rank pool (verify/_internal/ranks/pool.py): what each spawned worker process runs.

A worker releases the forkserver's "owner alive" pipe, arranges to die with its parent, turns the flight
recorder on (verify/_internal/ranks/comm.py) before torch loads, joins the FileStore process group, then serves jobs
from its pipe until told to stop: each job is `fn(ctx, *args, **kwargs)` with a `RankContext`, the reply
is plain pickle bytes ("ok", result) or ("err", traceback). Shutdown: barrier, destroy_process_group,
os._exit(0). Torch is imported inside the worker only.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass


@dataclass
class RankContext:
    """What a job function gets as its first argument, on each rank."""

    rank: int
    world: int
    backend: str
    device: object  # torch.device
    recorder: object  # verify._internal.ranks.comm.Recorder for this process
    state: dict  # per-worker scratch space that survives across jobs (e.g. a cached private group)
    group: object = None  # the group a job's trainer reduces over (Spec.group): a launched world's subgroup, or
    # None (the default group: a pool's whole world)


# -- the worker ---------------------------------------------------------------

def _die_with_parent(owner_pid: int) -> None:
    """SIGKILL this worker when its parent dies (the forkserver, which exits when the owner does, or the
    owner itself under spawn); exit now if the owner is already gone."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    try:
        os.kill(owner_pid, 0)
    except ProcessLookupError:
        os._exit(1)


def _release_forkserver_pipe() -> None:
    """A forkserver child inherits the write end of the server's "owner alive" pipe. Holding it keeps
    the server alive after the owner dies — and so this worker, whose PDEATHSIG waits for the server."""
    try:
        from multiprocessing import forkserver

        fd = forkserver._forkserver._forkserver_alive_fd
        if fd is not None:
            forkserver._forkserver._forkserver_alive_fd = None
            os.close(fd)
    except (AttributeError, OSError):
        pass


def worker_main(rank: int, world: int, backend: str, store_path: str, conn, dump_path: str, threads: int,
            owner_pid: int, pg_timeout: float, per_node: int | None = None, settings=None) -> None:
    """`settings`: the parent's Settings (pickled with the process's arguments), installed as this rank's own
    before anything runs: a rank never reads the knobs from its environment."""
    from verify._internal import settings as knobs

    if settings is not None:
        knobs.install(settings)
    _release_forkserver_pipe()
    _die_with_parent(owner_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import faulthandler

    dump = open(dump_path, "w")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    from verify._internal.ranks import comm

    comm.enable(nccl=backend == "nccl")  # before torch.distributed sets up its recorder
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # Look like a torchrun rank to libraries that read the environment (Accelerate decides on data
    # parallelism from it); the group itself comes from the FileStore below. Nodes of `per_node` ranks
    # (XTRAIN_RANKS_PER_NODE emulates them; default: the whole pool) number ranks as torchrun does, node by node.
    per_node = per_node or world
    knobs.set_library_env(dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank % per_node, LOCAL_WORLD_SIZE=per_node,
                               OMP_NUM_THREADS=threads))
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        knobs.cuda_setup(deterministic=False)  # a job that asks for deterministic algorithms can have them
    else:
        device = torch.device("cpu")
    try:
        dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # first optimizer imports torch._dynamo (~1 s)
        comm.record_p2p()  # pipelines' send / recv, which gloo's recorder leaves out
        recorder = comm.Recorder()
        recorder.check_recording(lambda: dist.all_reduce(torch.zeros(1, device=device)))
        ctx = RankContext(rank, world, backend, device, recorder, {})
        conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    except BaseException:
        conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        os._exit(1)
    from verify._internal.ranks import wire  # torch: loaded once the recorder is on (above)

    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # parent gone
            os._exit(1)
        job = pickle.loads(msg)
        if job is None:
            break
        fn, args, kwargs = job
        try:
            reply = wire.dumps(("ok", fn(ctx, *args, **kwargs)))  # a gate job's value: its verdict object
        except BaseException:
            reply = pickle.dumps(("err", traceback.format_exc()))
        conn.send_bytes(reply)
    try:
        dist.barrier()
        dist.destroy_process_group()
        conn.send_bytes(pickle.dumps(("bye", None)))
    finally:
        dump.close()
        os._exit(0)
