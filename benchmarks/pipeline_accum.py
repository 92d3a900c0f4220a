"""Pipeline parallel with outer accumulation vs the same schedule in one step (CPU, gloo, 2 ranks).

    python -m benchmarks.pipeline_accum [--width 512] [--rows 256] [--n 8] [--outer 1,2,4] [--out reports/cpu]

One optimizer step = N micro-batches of B rows (E = N·B rows, the same in every row of the table): the
schedule runs chunks = N/outer micro-batches per schedule.step, outer times, gradients accumulating across the
steps (scale_grads=False, each micro loss / N: examples/pipeline_schedule.py's recipe). outer = 1 is the
schedule without outer accumulation. An MLP of --layers Linear+Tanh, half on each rank, float32.

Per rank: the median step time (wall, after a barrier, over --steps measured optimizer steps), its CPU time
(time.process_time: the work, which neighbours on a shared box disturb far less than the wall) and the peak
memory a step adds (verify.memory's CPU probe: VmHWM reset right before the measured steps, minus the RSS
then; parameters, optimizer state and the pre-drawn batches are in that baseline). Every configuration runs
in fresh processes (a process's peak never goes down), with glibc's MALLOC_MMAP_THRESHOLD_ fixed as
verify.memory does, so freed activations leave the RSS; --rounds repeats the configurations interleaved:
the table gives each rank's best round's step time (the box is shared) and the median round's peak.
Writes OUT/pipeline-accum.json (the common report header) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

SCHEDULES = ("gpipe", "1f1b")


def _rank(rank, cfg, path, q):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from verify.memory.probes import RssProbe

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    torch.manual_seed(0)
    w, layers, n, chunks = cfg["width"], cfg["layers"], cfg["n"], cfg["chunks"]
    full = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(w, w), torch.nn.Tanh())])
    half = len(full) // 2
    sub = full[:half] if rank == 0 else full[half:]
    stage = PipelineStage(sub, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if cfg["schedule"] == "gpipe" else Schedule1F1B
    sched = cls(stage, chunks, loss_fn=lambda out, y: F.mse_loss(out, y) / n, scale_grads=False)
    opt = torch.optim.SGD(sub.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n * cfg["rows"], w, generator=g), torch.randn(n * cfg["rows"], w, generator=g))
               for _ in range(cfg["warmup"] + cfg["steps"])]

    def step(x, y):
        for xs, ys in zip(x.chunk(n // chunks), y.chunk(n // chunks)):  # outer: one schedule.step each
            sched.step(*([xs] if rank == 0 else []), target=ys if rank == 1 else None)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for x, y in batches[:cfg["warmup"]]:
        step(x, y)
    times, cpu, probe = [], [], RssProbe()
    probe.start()
    for x, y in batches[cfg["warmup"]:]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step(x, y)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    mem = probe.stop()
    q.put(json.dumps(dict(rank=rank, step_s=statistics.median(times), cpu_s=statistics.median(cpu), times=times,
                          cpu_times=cpu, **mem)))
    dist.barrier()
    dist.destroy_process_group()


def measure(cfg: dict) -> list[dict]:
    """One configuration on 2 fresh processes: per-rank rows."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, cfg, os.path.join(d, "store"), q)) for r in range(2)]
        for p in procs:
            p.start()
        rows = sorted((json.loads(q.get(timeout=600)) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(60)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed on {cfg}: exit codes {[p.exitcode for p in procs]}")
    return rows


def _ints(text):
    try:
        v = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"must be integers ≥ 1, got {text!r}")
    return v


def _pos(text):
    v = _ints(text)
    if len(v) != 1:
        raise argparse.ArgumentTypeError(f"must be one integer ≥ 1, got {text!r}")
    return v[0]


def table(results) -> str:
    rows = ["| schedule | chunks × outer | step time rank 0 / 1 (s) | CPU time rank 0 / 1 (s) "
            "| peak added rank 0 / 1 (MiB) |", "|---|---|---|---|---|"]
    for r in results:
        t = " / ".join(f"{x['step_s']:.3f}" for x in r["ranks"])
        c = " / ".join(f"{x['cpu_s']:.3f}" for x in r["ranks"])
        m = " / ".join(f"{x['peak_bytes'] / 2**20:.1f}" for x in r["ranks"])
        rows.append(f"| {r['schedule']} | {r['chunks']} × {r['outer']} | {t} | {c} | {m} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_accum", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="reports/cpu")
    p.add_argument("--width", type=_pos, default=512)
    p.add_argument("--layers", type=_pos, default=8, help="Linear+Tanh layers, half on each of the 2 stages")
    p.add_argument("--rows", type=_pos, default=256, help="rows per micro-batch (B)")
    p.add_argument("--n", type=_pos, default=8, help="micro-batches per optimizer step (N)")
    p.add_argument("--outer", type=_ints, default=[1, 2, 4], help="schedule steps per optimizer step; divide N")
    p.add_argument("--steps", type=_pos, default=3, help="measured optimizer steps per configuration")
    p.add_argument("--warmup", type=_pos, default=1)
    p.add_argument("--rounds", type=_pos, default=1, help="repetitions, interleaved; medians reported")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    a = p.parse_args(argv)
    scheds = a.schedules.split(",")
    if any(s not in SCHEDULES for s in scheds) or a.layers % 2 or any(a.n % o for o in a.outer) \
            or any(a.n // o < 2 for o in a.outer if "1f1b" in scheds):
        p.error(f"--schedules of {', '.join(SCHEDULES)}; --layers even; every --outer divides --n={a.n} "
                f"(1F1B needs chunks = N/outer ≥ 2 stages)")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned ranks (verify.memory's)
    cfgs = [dict(schedule=s, chunks=a.n // o, outer=o, width=a.width, layers=a.layers, rows=a.rows, n=a.n,
                 steps=a.steps, warmup=a.warmup) for s in scheds for o in a.outer]
    runs = {i: [] for i in range(len(cfgs))}
    for rnd in range(a.rounds):
        for i, cfg in enumerate(cfgs):
            print(f"round {rnd + 1}/{a.rounds}: {cfg['schedule']} chunks={cfg['chunks']} outer={cfg['outer']}",
                  file=sys.stderr, flush=True)
            runs[i].append(measure(cfg))
    results = []
    for i, cfg in enumerate(cfgs):
        # time: the best round (the box is shared: a slower round measured its neighbours); memory: the median
        ranks = [dict(rank=r, step_s=min(run[r]["step_s"] for run in runs[i]),
                      cpu_s=min(run[r]["cpu_s"] for run in runs[i]),
                      peak_bytes=int(statistics.median(run[r]["peak_bytes"] for run in runs[i])),
                      rounds=[run[r] for run in runs[i]]) for r in range(2)]
        results.append(dict(cfg, effective_rows=a.n * a.rows, ranks=ranks))
    import torch

    from verify._meta import atomic_write, header

    doc = dict(header("pipeline-accum"), settings=vars(a), threads_per_rank=1, torch=torch.__version__,
               results=results)
    os.makedirs(a.out, exist_ok=True)
    atomic_write(os.path.join(a.out, "pipeline-accum.json"), json.dumps(doc, indent=1, default=str))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
