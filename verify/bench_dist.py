"""Benchmarks for data-parallel accumulation (a script, not a timed test).

Pool mode — what one distributed gate example costs, cold vs warm, and the bytes counted per step:

    python -m verify.bench_dist [--backend gloo|nccl] [--max-world 4] [--out reports]

Step-time mode — xtrain's DistAccumTrainer vs torch DDP no_sync() side by side in ONE run (interleaved
repetitions, median), on the anchor model (preset gpt2-ish: GPT 12L d768 vocab 8192 seq 512, fp32,
TF32 off), N=4, B=8 per rank; plus the collectives the flight recorder counts per optimizer step:

    python -m torch.distributed.run --standalone --nproc-per-node W -m verify.bench_dist --device cuda --out DIR

Both write JSON (schema_version, machine_info, git_commit, utc, results; written atomically) and print a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _meta() -> dict:
    """The common report header (verify/_meta.py): schema_version, machine_info, git commit, UTC time."""
    import torch

    from ._meta import header

    return header("bench_dist", "cuda" if torch.cuda.is_available() else None)


def _write(out_dir: str, name: str, payload: dict) -> str:
    from ._meta import atomic_write

    path = os.path.join(out_dir, name)
    atomic_write(path, json.dumps(payload, indent=1, default=str))
    return path


# -- pool mode -------------------------------------------------------------------------------------

def _fixed_cases(world: int):
    from xtrain_core.config import PRESETS, ModelConfig, OptimConfig

    from .interface import Case

    small = Case(accum_steps=4, micro_batch=2, seq_len=16, steps=2, world=world, optim=OptimConfig(lr=1e-3),
                 model=ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16))
    tiny = Case(accum_steps=4, micro_batch=2, seq_len=32, steps=2, world=world, optim=OptimConfig(lr=1e-3),
                model=PRESETS["tiny"])
    return {"test-size (L1 d16 V64, N4 B2 S16 K2)": small, "preset tiny (L2 d64 V256, N4 B2 S32 K2)": tiny}


def _drawn_cases(world: int, n: int):
    """The ci profile's draws: derandomized, as the suite sees them."""
    from hypothesis import HealthCheck, given, settings

    from .strategies import dist_cases

    got = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=dist_cases(min_world=world, max_world=world))
    def collect(case):
        got.append(case)

    collect()
    return got


def _time_example(factory, case, pool) -> float:
    from .gates_dist import check_distributed

    t0 = time.perf_counter()
    check_distributed(factory, case, pool=pool)
    return time.perf_counter() - t0


def pools(args) -> dict:
    import torch

    from .gates_dist import IMPL_FACTORIES, check_boundary_only, run_distributed
    from .pool import ENV_START, RankPool, get_pool

    torch.set_num_threads(int(os.environ.get("XTRAIN_TEST_THREADS", "1")))
    os.environ["XTRAIN_DIST_BACKEND"] = args.backend
    xtrain = IMPL_FACTORIES["xtrain"]
    rows = []
    worlds = sorted({int(w) for w in args.worlds.split(",")}) if args.worlds else range(1, args.max_world + 1)
    for world in worlds:
        fixed = _fixed_cases(world)
        first = next(iter(fixed.values()))
        row = dict(world=world)
        # cold: a new pool + one example (+ shutdown not counted); spawn vs forkserver start
        for method in ("spawn", "forkserver") if args.backend == "gloo" else ("spawn",):  # NCCL: spawn only
            old = os.environ.get(ENV_START)
            os.environ[ENV_START] = method
            try:
                t0 = time.perf_counter()
                pool = RankPool(world, args.backend)
                startup = time.perf_counter() - t0
                ex = _time_example(xtrain, first, pool)
                pool.close()
            finally:
                os.environ.pop(ENV_START) if old is None else os.environ.__setitem__(ENV_START, old)
            row[f"cold_{method}_s"] = startup + ex
            row[f"pool_start_{method}_s"] = startup
        warm = get_pool(world, args.backend)
        from .dist_jobs import whoami

        ts = []
        for _ in range(50):  # the pool's own overhead: a job that does nothing
            t0 = time.perf_counter()
            warm.run(whoami)
            ts.append(time.perf_counter() - t0)
        row["warm no-op job"] = dict(median_s=statistics.median(ts), max_s=max(ts), n=len(ts))
        for label, case in fixed.items():
            _time_example(xtrain, case, warm)  # first use of these shapes
            ts = [_time_example(xtrain, case, warm) for _ in range(args.reps)]
            row[f"warm {label}"] = dict(median_s=statistics.median(ts), min_s=min(ts), max_s=max(ts), n=len(ts))
        ts = sorted(_time_example(xtrain, c, warm) for c in _drawn_cases(world, args.drawn))
        row["warm drawn (ci strategy)"] = dict(median_s=statistics.median(ts), p90_s=ts[int(0.9 * (len(ts) - 1))],
                                               max_s=ts[-1], n=len(ts))
        rows.append(row)
        print(_pool_row(row), flush=True)
        _write(args.out, f"bench_dist_pools_{args.backend}.json",  # after every world: a timeout keeps the rest
               {**_meta(), "results": dict(backend=args.backend, reps=args.reps, examples=rows, partial=True)})
    # bytes per optimizer step, counted: the tiny preset at world 2, N = 1, 4, 8, both implementations
    counted = []
    if max(worlds) >= 2:
        import dataclasses

        base = _fixed_cases(2)["preset tiny (L2 d64 V256, N4 B2 S32 K2)"]
        for impl, factory in IMPL_FACTORIES.items():
            for n in (1, 4, 8):
                case = dataclasses.replace(base, accum_steps=n, steps=3)
                outs = run_distributed(factory, case, pool=get_pool(2, args.backend), dtypes=(torch.float32,),
                                       references=False)
                rep = check_boundary_only(outs, case)
                steps = rep.per_step(0, "torch.float32")
                init = rep.init[(0, "torch.float32")]
                counted.append(dict(impl=impl, N=n, grad_elements=rep.grad_elements,
                                    grad_bytes=4 * rep.grad_elements, steps=steps,
                                    init=[f"{c.backend}:{c.op} {c.kind} {c.numel} el" for c in init]))
                s = steps[-1]
                print(f"  {impl:6s} N={n}: per step {s['gradient_collectives']} gradient collective(s), "
                      f"{s['boundary_bytes']} B at the boundary (grads {4 * rep.grad_elements} B), micro-steps "
                      f"{s['micro_collectives']}; step 1 other: {steps[1]['other']}", flush=True)
    return dict(backend=args.backend, reps=args.reps, examples=rows, bytes_per_step=counted)


def _pool_row(r: dict) -> str:
    fx = [v for k, v in r.items() if k.startswith("warm ")]
    fork = f" / {r['cold_forkserver_s']:.2f} s (forkserver)" if "cold_forkserver_s" in r else ""
    return (f"world {r['world']}: cold {r['cold_spawn_s']:.2f} s (spawn){fork}; warm medians " + ", ".join(f"{v['median_s'] * 1e3:.1f} ms" for v in fx)
            + " (no-op job; examples: test-size, tiny preset, ci-strategy draws)")


# -- step-time mode (under torchrun) ---------------------------------------------------------------

def steps_mode(args) -> dict | None:
    from . import comm
    from ._meta import fp32_only

    comm.enable(nccl=args.device == "cuda")  # before the process group: the flight recorder counts collectives
    import torch
    import torch.distributed as dist

    from xtrain_core.config import PRESETS, OptimConfig
    from xtrain_core.data import TokenStream
    from xtrain_core.distributed import DistAccumTrainer, TorchDDPTrainer, shard
    from xtrain_core.model import build_model

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda"
    if cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        fp32_only()
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    lead = rank == 0
    cfg = PRESETS[args.model]
    N, B, S = args.n, args.b, args.seq or cfg.seq_len
    optim = OptimConfig(lr=1e-4, max_grad_norm=1.0)
    recorder = comm.Recorder()

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    stream = TokenStream(cfg.vocab_size, S, seed=1)

    def batches(k):  # k steps of this rank's N micro-batches, on the device, made outside the timing
        out = []
        for _ in range(k):
            idx, tgt = stream.next(N * B * world)
            out.append([(x.to(dev), y.to(dev)) for x, y in shard(idx, tgt, N, rank, world)])
        return out

    makers = {"xtrain": lambda: DistAccumTrainer(build_model(cfg, 0, device=dev), optim, N),
              "torch": lambda: TorchDDPTrainer(build_model(cfg, 0, device=dev), optim, N)}
    trainers = {k: make() for k, make in makers.items()}
    for t in trainers.values():  # warm-up: Adam state, DDP's bucket rebuild (second step), allocator
        for micro in batches(2):
            t.train_step(micro)
    data = batches(args.steps)
    times = {k: [] for k in trainers}
    for rep in range(args.reps):
        order = list(trainers) if rep % 2 == 0 else list(trainers)[::-1]  # interleaved, alternating first
        for k in order:
            sync()
            t0 = time.perf_counter()
            for micro in data:
                trainers[k].train_step(micro)
            if cuda:
                torch.cuda.synchronize()
            dt = torch.tensor([(time.perf_counter() - t0) / len(data)], device=dev)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
            times[k].append(dt.item() * 1e3)
    # the collectives of one optimizer step, counted by the flight recorder, per micro-step window
    counted = {}
    for k, t in trainers.items():
        sync()
        recorder.discard()  # the timed reps above overflowed the ring: count from here
        win = comm.Windows()
        for m, (x, y) in enumerate(data[0]):
            win.mark(("micro", m))
            t.micro_step(x, y, m)
        win.mark(("boundary",))
        t.optimizer_step()
        if cuda:
            torch.cuda.synchronize()
        win.mark(("after",))
        got = win.attribute(recorder.read())
        per = {}
        for label, cs in got.items():
            name = "micro %d" % label[1] if label and label[0] == "micro" else (label[0] if label else "before")
            per[name] = [dict(op=f"{c.backend}:{c.op}", kind=c.kind, elements=c.numel, bytes=c.nbytes) for c in cs]
        grads = [c for cs in got.values() for c in cs if c.kind == "gradient"]
        counted[k] = dict(gradient_collectives=len(grads), gradient_bytes=sum(c.nbytes for c in grads),
                          param_bytes=4 * cfg.n_params, per_window=per)
    # peak memory: each implementation alone on the device, after its warm-up
    peaks = {}
    if cuda:
        del trainers
        for k, make in makers.items():
            torch.cuda.empty_cache()
            t = make()
            for micro in data[:2]:
                t.train_step(micro)
            sync()
            torch.cuda.reset_peak_memory_stats()
            for micro in data[:2]:
                t.train_step(micro)
            torch.cuda.synchronize()
            peaks[k] = torch.cuda.max_memory_allocated() / 2**30
            del t
    dist.barrier()  # every rank done before teardown (gloo can abort otherwise, GUIDE §3)
    dist.destroy_process_group()
    if not lead:
        return None
    med = {k: statistics.median(v) for k, v in times.items()}
    res = dict(model=args.model, n_params=cfg.n_params, N=N, B_local=B, seq=S, world=world, device=args.device,
               dtype="float32", tf32=False, optimizer="torch.optim.AdamW (fused on CUDA, foreach on CPU: make_optimizer), clip 1.0", reps=args.reps,
               steps_per_rep=args.steps, step_ms=times, median_step_ms=med,
               ratio_xtrain_over_torch=med["xtrain"] / med["torch"], collectives_one_step=counted,
               peak_alloc_gib=peaks)
    print(f"{args.model} N={N} B={B}/rank S={S} world={world} {args.device}: median ms/step over {args.reps} "
          f"interleaved reps of {args.steps} steps")
    for k in med:
        c = counted[k]
        print(f"  {k:6s} {med[k]:8.1f} ms  (reps {', '.join(f'{x:.1f}' for x in times[k])})  "
              f"{c['gradient_collectives']} gradient collectives/step, {c['gradient_bytes'] / 2**20:.1f} MiB "
              f"(params {c['param_bytes'] / 2**20:.1f} MiB)" + (f", peak {peaks[k]:.2f} GiB" if k in peaks else ""))
    print(f"  xtrain / torch = {res['ratio_xtrain_over_torch']:.4f}")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="verify.bench_dist", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="pool mode")
    p.add_argument("--max-world", type=int, default=4, help="pool mode: worlds 1..max")
    p.add_argument("--worlds", default=None, help="pool mode: a comma list instead, e.g. 1,2,8")
    p.add_argument("--reps", type=int, default=None, help="repetitions (pool mode 15, step mode 9)")
    p.add_argument("--drawn", type=int, default=30, help="pool mode: drawn ci-strategy cases per world")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda", help="step mode")
    p.add_argument("--model", default="gpt2-ish", help="step mode: model preset")
    p.add_argument("--n", type=int, default=4, help="step mode: micro-steps N")
    p.add_argument("--b", type=int, default=8, help="step mode: B per rank")
    p.add_argument("--seq", type=int, default=None, help="step mode: sequence length (default: the model's)")
    p.add_argument("--steps", type=int, default=5, help="step mode: optimizer steps per repetition")
    args = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.reps = args.reps or 9
        res = steps_mode(args)
        if res is not None:
            name = f"bench_dist_steps_{args.device}_w{res['world']}.json"
            print("wrote", _write(args.out, name, {**_meta(), "results": res}))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no second teardown of the process group by the interpreter
    args.reps = args.reps or 15
    res = pools(args)
    print("wrote", _write(args.out, f"bench_dist_pools_{args.backend}.json", {**_meta(), "results": res}))
    from .pool import close_all

    close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
