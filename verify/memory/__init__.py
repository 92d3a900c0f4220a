"""verify.memory: the peak memory of gradient accumulation follows ONE micro-batch, not N of them.

    python -m verify.memory --effective-batch 32 [--trainer xtrain|leaky_graph|MODULE:FACTORY] ...
    row = measure(adapter, spec, micro_batch=B, steps=K, probe=CudaProbe(device, nvml=None))

`measure` is the protocol every configuration goes through, for any adapter: data drawn up front, the trainer
built, `warmup` optimizer steps, then the probe around `steps` measured steps. Modules: plan, runners,
probes, invariants, prediction, anchor, report, plot, timing, _zygote, cli (extended by a `Wing`); none knows
a trainer. Importing this package imports neither torch nor matplotlib. Design: docs/design/memory.md.
"""
from __future__ import annotations

import importlib
import time

from verify.memory.prediction import PeakQuery, Prediction

__all__ = ["measure", "RssProbe", "CudaProbe", "NvmlSampler", "ProbeUnavailable", "cuda_full_reset", "PeakQuery",
           "Prediction"]

_PROBES = {"RssProbe", "CudaProbe", "NvmlSampler", "ProbeUnavailable", "cuda_full_reset"}


def __getattr__(name: str):
    if name in _PROBES:
        value = getattr(importlib.import_module(".probes", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _draw(adapter, spec, micro_batch: int, n_steps: int, data_seed: int, device):
    """n_steps optimizer steps of N micro-batches of B rows, one data seed per step (as verify._internal.cases.case draws
    them), on `device`; and what one row of inputs looks like."""
    from verify._internal.cases.case import _to, split

    out, first = [], None
    for k in range(n_steps):
        x, y = adapter.batch(spec.accum_steps * micro_batch, (data_seed << 16) + k, spec.options)
        first = x if first is None else first
        out.append([(_to(a, device, spec.dtype), _to(b, device, spec.dtype))
                    for a, b in split(x, y, spec.accum_steps)])
    return out, first


def _runqueue_wait_s() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a core (Linux schedstat, field 2
    of /proc/self/task/*/schedstat, summed over threads); None where the kernel does not say."""
    import os

    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that just ended
    except OSError:
        return None
    return total / 1e9


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(adapter, spec, *, micro_batch: int, steps: int, probe, data_seed: int = 1, warmup: int = 1) -> dict:
    """One configuration (N = spec.accum_steps micro-steps of B = micro_batch rows) under `probe`: the
    probe's figures, the static state, timing and losses (see the module docstring for the protocol).
    `warmup` optimizer steps precede the probe (1: the anchor's protocol; torch DDP rebuilds its gradient
    buckets in the forward of its SECOND iteration, so its steady state starts after 2).

    Throughput is `tok_s` (N·B·S per second) when the inputs are 2-D integer token ids (rows, S), else
    `rows_s` (N·B rows per second): a token count is only claimed where there are tokens."""
    import torch

    from verify.memory.probes import optimizer_info, optimizer_state_bytes, tensor_bytes

    device = torch.device(spec.device)
    N, B = spec.accum_steps, micro_batch
    if warmup < 1:
        raise ValueError(f"warmup must be ≥ 1 (the first step allocates the optimizer state), got {warmup}")
    data, x0 = _draw(adapter, spec, B, steps + warmup, data_seed, device)
    tokens = x0.dim() == 2 and not x0.is_floating_point() and not x0.is_complex()
    trainer = adapter(spec)

    def one_step(micro_batches, boundary=None):
        for m, (x, y) in enumerate(micro_batches):
            trainer.micro_step(x, y, m)
        if boundary is not None:
            boundary()
        return trainer.optimizer_step()

    grad_bytes = []
    one_step(data[0], lambda: grad_bytes.append(tensor_bytes(list(trainer.grads().values()))))  # warm-up
    for mb in data[1:warmup]:
        one_step(mb)
    _sync(device)
    params = list(trainer.params().values())
    param_bytes, param_count = tensor_bytes(params), sum(p.numel() for p in params)
    del params
    opt_bytes = optimizer_state_bytes(trainer)
    opt_info = optimizer_info(trainer)

    probe.start()
    cuda = device.type == "cuda"
    # Per-step times for the stability check (timing.py): CUDA events (no host sync inside the timed loop),
    # wall clock on the CPU, where every op is synchronous; process CPU time shows waiting for a core.
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    t0, wait0, walls, losses = time.perf_counter(), _runqueue_wait_s(), [], []
    for i, mb in enumerate(data[warmup:]):
        if cuda:
            marks[i].record()
        losses.append(one_step(mb))
        walls.append(time.perf_counter())
    if cuda:
        marks[-1].record()
    _sync(device)
    wall = time.perf_counter() - t0
    wait1 = _runqueue_wait_s()
    dt = wall / steps
    if cuda:
        step_s = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(steps)]
    else:
        step_s = [b - a for a, b in zip([t0, *walls[:-1]], walls)]
    peaks = probe.stop()
    losses = [float(v) for v in losses]
    trainer_class = type(trainer).__name__
    del trainer, data
    rate = dict(S=x0.shape[1], tok_s=N * B * x0.shape[1] / dt) if tokens else dict(rows_s=N * B / dt)
    return dict(
        N=N, B=B, eff=N * B, steps=steps, warmup=warmup, input_shape=list(x0.shape[1:]), input_dtype=str(x0.dtype),
        **peaks,
        param_bytes=param_bytes, param_count=param_count, grad_bytes=grad_bytes[0], optim_state_bytes=opt_bytes,
        static_bytes=param_bytes + grad_bytes[0] + (opt_bytes or 0),
        step_ms=dt * 1e3, step_s=step_s, threads=torch.get_num_threads(),
        cpu_wait=None if wait0 is None or wait1 is None or wall <= 0 else (wait1 - wait0) / wall,
        **rate, losses=losses, optimizer=opt_info, trainer_class=trainer_class,
    )

