"""Jobs the distributed tests send to rank pools (top-level functions: a pool unpickles them by name)."""
from __future__ import annotations

import threading
import time
import warnings

import torch
import torch.distributed as dist

from verify._internal.ranks.comm import Windows


def probe_counter(ctx) -> dict:
    """One collective on each path the counter must see; returns window -> [(op, numel, dtypes, kind,
    pg, off_main_thread)]. Paths: dist.all_reduce, all_reduce_coalesced, the backend object, another
    thread, a private group, DDP's C++ reducer, a broadcast."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = ctx.device
    rec, win = ctx.recorder, Windows()
    rec.discard()
    win.mark("dist.all_reduce")
    dist.all_reduce(torch.ones(7, device=dev))
    win.mark("all_reduce_coalesced")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "will be deprecated": still the coalesced path
        dist.all_reduce_coalesced([torch.ones(3, device=dev), torch.ones(4, device=dev)])
    win.mark("backend object")
    dist.group.WORLD._get_backend(dev).allreduce([torch.ones(9, device=dev)]).wait()
    win.mark("helper thread")
    th = threading.Thread(target=dist.all_reduce, args=(torch.ones(5, device=dev),), name="helper")
    th.start()
    th.join()
    win.mark("private group")
    if "private" not in ctx.state:
        ctx.state["private"] = dist.new_group(list(range(ctx.world)))
    dist.all_reduce(torch.ones(6, device=dev), group=ctx.state["private"])
    win.mark("DDP construction")
    lin = torch.nn.Linear(4, 3).to(dev)  # 15 parameters
    ddp = DDP(lin, device_ids=[dev] if dev.type == "cuda" else None)
    win.mark("DDP backward")
    ddp(torch.ones(2, 4, device=dev)).sum().backward()
    win.mark("broadcast")
    dist.broadcast(torch.ones(2, dtype=torch.float64, device=dev), 0)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    win.mark("end")
    got = win.attribute(rec.read())
    return {k: [(c.op, c.numel, c.dtypes, c.kind, c.pg, c.thread != rec.main_thread, c.nbytes) for c in v]
            for k, v in got.items()}


def overflow_recorder(ctx, n: int) -> str:
    """Issue n collectives between two reads; returns the recorder's error (or '' if none)."""
    from verify._internal.ranks.comm import RecorderError

    ctx.recorder.discard()
    t = torch.ones(1, device=ctx.device)
    for _ in range(n):
        dist.all_reduce(t)
    try:
        ctx.recorder.read()
    except RecorderError as e:
        return str(e)
    return ""


def recorder_reads_clean(ctx) -> int:
    """After an overflow the recorder carries on: one collective -> one entry."""
    ctx.recorder.discard()
    dist.all_reduce(torch.ones(1, device=ctx.device))
    return len(ctx.recorder.read())


def raise_on_rank(ctx, bad: int) -> int:
    if ctx.rank == bad:
        raise ValueError(f"deliberate failure on rank {bad}")
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)  # the others wait for it in a collective ...
    return int(t.item())  # ... (NCCL returns at once: .item() waits for the result)


def sleep(ctx, seconds: float) -> int:
    time.sleep(seconds)
    return ctx.rank


def whoami(ctx) -> tuple[int, int]:
    import os

    return ctx.rank, os.getpid()


def exit_on_rank(ctx, bad: int, code: int) -> int:
    """Rank `bad` dies without a reply: os._exit(code), or SIGKILL itself when code < 0."""
    import os
    import signal

    if ctx.rank == bad:
        if code < 0:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(code)
    return ctx.rank


def group_sum(ctx) -> tuple:
    """(rank, world, size of ctx.group, Σ rank+1 over ctx.group, that group's link): a sub-world's view."""
    from verify._internal.ranks.comm import group_links

    t = torch.tensor([ctx.rank + 1.0], device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    name = str((ctx.group or dist.group.WORLD).group_name)
    return ctx.rank, ctx.world, dist.get_world_size(ctx.group), float(t.item()), group_links()[name]



def has_module(ctx, name="examples.mlp_regressor"):
    """Whether this rank had `name` imported before the job ran (nothing in the job references it)."""
    import sys

    return name in sys.modules


def settings_seen(ctx) -> tuple:
    """The Settings a rank runs under (settings.current(), as a dict) and the knob variables of its own
    environment: a rank uses its parent's Settings whatever its environment says."""
    import os

    from verify._internal.settings import KNOBS, current

    return current().to_dict(), {k.env: os.environ.get(k.env) for k in KNOBS}


def verdict_of(adapter, case, device):
    """A single-process "gate" (verify._internal.gates.single.gate_job's callable): its verdict as `adapter` names it."""
    from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped

    if adapter == "skip":
        raise GateSkipped("does not apply here")
    if adapter == "fail":
        raise GateFailure("[equivalence] differs", gate=Gate.EQUIVALENCE, error=2.0, bound=1.0, hint="a hint")
    return GateResult(Gate.EQUIVALENCE, case, "loss", 0.5)


def world1_job(ctx, case):
    """xtrain's own promise, world 1 IS the single-process path: on a one-rank pool, DistAccumTrainer and
    AccumTrainer on the same data, with the collectives the first one issued (it has nobody to talk to: none)."""
    from verify._internal.cases.case import drive
    from xtrain_proof import adapters as xtrain

    batches = case.batches(xtrain.adapter)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # CUDA: no atomics-order differences
    try:
        ctx.recorder.discard()
        spec = case.spec(device=str(ctx.device))
        got = drive(xtrain.dist_factory(spec), batches, case.accum_steps, device=ctx.device)
        n_collectives = len(ctx.recorder.read())
        want = drive(xtrain.single_factory(spec), batches, case.accum_steps, device=ctx.device)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return got, want, n_collectives


def windows_drained_per_step(ctx, per_step: int, steps: int) -> list[int]:
    """`steps` steps of `per_step` collectives each, marked as drive marks them: more in the run than the ring holds,
    fewer in a step. Returns the collectives attributed to each step's micro-step window."""
    from verify._internal.ranks.comm import Windows

    ctx.recorder.discard()
    win, t = Windows(ctx.recorder), torch.ones(1, device=ctx.device)
    for k in range(steps):
        win.mark(("micro", k, 0))
        for _ in range(per_step):
            dist.all_reduce(t)
        win.mark(("after", k))
    got = win.attribute(win.collected())
    return [len(got[("micro", k, 0)]) for k in range(steps)]
