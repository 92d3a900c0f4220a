"""Benchmarks for data-parallel accumulation (a script, not a timed test).

Pool mode — what one distributed gate example (`check_distributed(xtrain.adapter, case)`) costs, cold
vs warm, and the bytes the flight recorder counts per optimizer step:

    python -m benchmarks.bench_dist [--backend gloo|nccl] [--max-world 4] [--out reports]

  cold = new pools (the world-W pool and, for W > 1, the one-rank pool the reference runs on) + one
  example; warm = the same on pools that already exist, as inside the test suite.

Step-time mode — side by side in ONE run (interleaved repetitions, median), on the anchor model (preset
gpt2-ish: GPT 12L d768 vocab 8192 seq 512, fp32, TF32 off), N=4, B=8 per rank:
  xtrain  xtrain's DistAccumTrainer (one boundary all-reduce per bucket of a flat gradient buffer)
  torch   xtrain's model and optimizer under torch DDP with no_sync() (xtrain_core TorchDDPTrainer)
  plain   benchmarks/plain_torch.py's GPT and loop under torch DDP with no_sync(): plain PyTorch
plus the collectives the flight recorder counts in one optimizer step of each:

    python -m torch.distributed.run --standalone --nproc-per-node W -m benchmarks.bench_dist --device cuda --out DIR

FSDP2's saving: `--sides fsdp2,fsdp2-sync-every-micro` times FSDP2 with set_requires_gradient_sync at the
boundary against the same trainer reducing every micro-step.

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
    """The common report header (verify.report_header): schema_version, machine_info, git commit, UTC time."""
    import torch

    from verify import report_header

    return report_header("bench_dist", "cuda" if torch.cuda.is_available() else None)


def _write(out_dir: str, name: str, payload: dict) -> str:
    from verify import atomic_write

    path = os.path.join(out_dir, name)
    atomic_write(path, json.dumps(payload, indent=1, default=str))
    return path


# -- pool mode -------------------------------------------------------------------------------------

def _fixed_cases(world: int):
    from xtrain_proof.adapters import XtrainOptions
    from verify import Case
    from xtrain_core.config import PRESETS, ModelConfig, OptimConfig

    small = Case(accum_steps=4, micro_batch=2, steps=2, world=world, options=XtrainOptions(
        model=ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=16), seq_len=16,
        optim=OptimConfig(lr=1e-3)))
    tiny = Case(accum_steps=4, micro_batch=2, steps=2, world=world, options=XtrainOptions(
        model=PRESETS["tiny"], seq_len=32, optim=OptimConfig(lr=1e-3)))
    return {"test-size (L1 d16 V64, N4 B2 S16 K2)": small, "preset tiny (L2 d64 V256, N4 B2 S32 K2)": tiny}


def _drawn_cases(world: int, n: int):
    """The ci profile's draws: derandomized, as the suite sees them."""
    from hypothesis import HealthCheck, given, settings

    from verify import Gate
    from verify.study import strategy
    from xtrain_proof import adapters as xtrain

    got = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy(Gate.DP_EQUIVALENCE, xtrain.adapter, world, world))
    def collect(case):
        got.append(case)

    collect()
    return got


def _time_example(adapter, case, pool, ref_pool=None) -> float:
    from verify.study import check_distributed

    t0 = time.perf_counter()
    check_distributed(adapter, case, pool=pool, ref_pool=ref_pool)
    return time.perf_counter() - t0


def _other(c) -> str:
    return f"{c.backend}:{c.op} {c.kind}"


def _step_row(s) -> dict:
    """One optimizer step as the counter saw it (the equivalence gate's comm report, extra['comm'])."""
    non_grad = [c for c in [*(c for cs in s.micro for c in cs), *s.boundary] if c.kind != "gradient"]
    return dict(gradient_collectives=len(s.reduced), boundary_bytes=s.boundary_bytes,
                boundary_elements=s.boundary_elements, ops=[f"{c.backend}:{c.op}" for c in s.reduced],
                micro_collectives=[len(cs) for cs in s.micro],  # micro-steps 0..N-2
                other=[_other(c) for c in non_grad + s.params])


def pools(args) -> dict:
    import torch

    from xtrain_proof import adapters
    from tests.helpers.dist_jobs import whoami  # a no-op job (test plumbing, repo root on the path)
    from verify import Gate, check
    from verify import Settings
    from verify.study import RankPool, install, pool as get_pool, using

    settings = install(Settings.from_env(backend=args.backend))  # the backend: the reference's get_pool(1) too
    torch.set_num_threads(settings.threads)
    xtrain = adapters.adapter
    rows = []
    worlds = sorted({int(w) for w in args.worlds.split(",")}) if args.worlds else range(1, args.max_world + 1)
    for world in worlds:
        fixed = _fixed_cases(world)
        first = next(iter(fixed.values()))
        row = dict(world=world)
        # cold: new pools + one example (+ shutdown not counted); spawn vs forkserver start
        for method in args.cold:
            with using(settings.replace(pool_start=method)):
                t0 = time.perf_counter()
                pool = RankPool(world, args.backend)
                ref_pool = RankPool(1, args.backend) if world > 1 else None  # the reference runs beside it
                startup = time.perf_counter() - t0
                ex = _time_example(xtrain, first, pool, ref_pool)
                pool.close()
                if ref_pool is not None:
                    ref_pool.close()
            row[f"cold_{method}_s"] = startup + ex
            row[f"pool_start_{method}_s"] = startup
        warm = get_pool(world, args.backend)
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
        for impl, adapter in (("xtrain", adapters.adapter), ("torch", adapters.torch_ddp)):
            for n in (1, 4, 8):
                case = dataclasses.replace(base, accum_steps=n, steps=3)
                rep = check(Gate.DP_EQUIVALENCE, adapter, case).extra["comm"]  # the installed settings' backend
                steps = [_step_row(s) for s in rep.steps[(0, "torch.float32")]]
                init = rep.init[(0, "torch.float32")]
                counted.append(dict(impl=impl, N=n, grad_elements=rep.grad_elements,
                                    grad_bytes=4 * rep.grad_elements, steps=steps,
                                    init=[f"{c.backend}:{c.op} {c.kind} {c.numel} el" for c in init]))
                s = steps[-1]
                print(f"  {impl:6s} N={n}: per step {s['gradient_collectives']} gradient collective(s), "
                      f"{s['boundary_bytes']} B at the boundary (grads {4 * rep.grad_elements} B), micro-steps "
                      f"{f'0..{n - 2}: ' if n > 1 else ''}{s['micro_collectives'] or 'none'}; step 1 other: "
                      f"{steps[1]['other']}", flush=True)
    return dict(backend=args.backend, reps=args.reps, examples=rows, bytes_per_step=counted)


def _pool_row(r: dict) -> str:
    fx = [v for k, v in r.items() if k.startswith("warm ")]
    cold = " / ".join(f"{r[f'cold_{m}_s']:.2f} s ({m})" for m in ("spawn", "forkserver") if f"cold_{m}_s" in r)
    return (f"world {r['world']}: cold {cold}; warm medians " + ", ".join(f"{v['median_s'] * 1e3:.1f} ms" for v in fx)
            + " (no-op job; examples: test-size, tiny preset, ci-strategy draws)")


# -- step-time mode (under torchrun) ---------------------------------------------------------------

def steps_mode(args) -> dict | None:
    from verify import Windows
    from verify.study import Recorder, count_collectives

    count_collectives(nccl=args.device == "cuda")  # before the process group: the flight recorder counts collectives
    import torch
    import torch.distributed as dist

    from xtrain_core.config import PRESETS, OptimConfig
    from xtrain_core.data import TokenStream
    from xtrain_core.distributed import DistAccumTrainer, TorchDDPTrainer, shard
    from xtrain_core.model import build_model

    from . import plain_torch

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda"
    if cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        plain_torch.tf32_off()
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    lead = rank == 0
    cfg = PRESETS[args.model]
    N, B, S = args.n, args.b, args.seq or cfg.seq_len
    optim = OptimConfig(lr=1e-4, max_grad_norm=1.0)
    recorder = Recorder()

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

    class Plain:
        """plain_torch's GPT and loop under torch DDP with no_sync(), in the trainer shape used below."""

        def __init__(self):
            from torch.nn.parallel import DistributedDataParallel as DDP

            torch.manual_seed(0)  # the same initial weights as build_model(cfg, 0)
            gpt = plain_torch.GPT(vocab=cfg.vocab_size, d=cfg.d_model, layers=cfg.n_layer, heads=cfg.n_head,
                                  seq=cfg.seq_len)
            self.model = DDP(gpt.to(dev), device_ids=[dev] if cuda else None)
            self.opt = plain_torch.make_optimizer(self.model)

        def train_step(self, micro_batches):
            plain_torch.train_step(self.model, self.opt, micro_batches)

        def micro_step(self, x, y, m):
            plain_torch.micro_step(self.model, x, y, N, sync=m == N - 1)

        def optimizer_step(self):
            plain_torch.finish_step(self.model, self.opt)

    def fsdp2(sync_every_micro: bool):
        from planted.broken_dist import FSDP2SyncAlways
        from xtrain_core.fsdp import FSDP2Trainer

        cls = FSDP2SyncAlways if sync_every_micro else FSDP2Trainer  # the same trainer, the gate never shut
        return lambda: cls(build_model(cfg, 0, device=dev), optim, N)

    every = {"xtrain": lambda: DistAccumTrainer(build_model(cfg, 0, device=dev), optim, N),
             "torch": lambda: TorchDDPTrainer(build_model(cfg, 0, device=dev), optim, N),
             "plain": Plain, "fsdp2": fsdp2(False), "fsdp2-sync-every-micro": fsdp2(True)}
    makers = {k: every[k] for k in args.sides}
    trainers = {k: make() for k, make in makers.items()}
    for t in trainers.values():  # warm-up: Adam state, DDP's bucket rebuild (second step), allocator
        for micro in batches(2):
            t.train_step(micro)
    data = batches(args.steps)
    times = {k: [] for k in trainers}
    for rep in range(args.reps):
        names, r = list(trainers), rep % len(trainers)
        order = names[r:] + names[:r]  # interleaved, each side first in turn (two sides: alternating)
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
        win = Windows()
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
    del t
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
    dist.barrier()  # every rank done before teardown (gloo's teardown can abort otherwise)
    dist.destroy_process_group()
    if not lead:
        return None
    med = {k: statistics.median(v) for k, v in times.items()}
    optimizer = ("xtrain, torch: torch.optim.AdamW (fused on CUDA, foreach on CPU: make_optimizer), clip 1.0; "
                 "plain: torch.optim.AdamW(lr=1e-4, fused on CUDA), clip 1.0")
    res = dict(model=args.model, n_params=cfg.n_params, N=N, B_local=B, seq=S, world=world, device=args.device,
               dtype="float32", tf32=False, optimizer=optimizer, sides=list(times), reps=args.reps,
               steps_per_rep=args.steps, step_ms=times, median_step_ms=med,
               collectives_one_step=counted, peak_alloc_gib=peaks)
    for other in ("torch", "plain"):
        if "xtrain" in med and other in med:
            res[f"ratio_xtrain_over_{other}"] = med["xtrain"] / med[other]
    if "fsdp2" in med and "fsdp2-sync-every-micro" in med:  # what the skipped reduce-scatters save
        res["ratio_fsdp2_over_sync_every_micro"] = med["fsdp2"] / med["fsdp2-sync-every-micro"]
    print(f"{args.model} N={N} B={B}/rank S={S} world={world} {args.device}: median ms/step over {args.reps} "
          f"interleaved reps of {args.steps} steps")
    for k in med:
        c = counted[k]
        print(f"  {k:6s} {med[k]:8.1f} ms  (reps {', '.join(f'{x:.1f}' for x in times[k])})  "
              f"{c['gradient_collectives']} floating-point collectives/step (reductions; FSDP2's all-gathers too), "
              f"{c['gradient_bytes'] / 2**20:.1f} MiB "
              f"(params {c['param_bytes'] / 2**20:.1f} MiB)" + (f", peak {peaks[k]:.2f} GiB" if k in peaks else ""))
    for other in ("torch", "plain"):
        if f"ratio_xtrain_over_{other}" in res:
            print(f"  xtrain / {other} = {res[f'ratio_xtrain_over_{other}']:.4f}")
    if "ratio_fsdp2_over_sync_every_micro" in res:
        print(f"  fsdp2 / fsdp2-sync-every-micro = {res['ratio_fsdp2_over_sync_every_micro']:.4f} (the reduce-scatters "
              f"micro-steps 0..N-2 skip)")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.bench_dist", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="pool mode")
    p.add_argument("--max-world", type=int, default=4, help="pool mode: worlds 1..max")
    p.add_argument("--worlds", default=None, help="pool mode: a comma list instead, e.g. 1,2,8")
    p.add_argument("--reps", type=int, default=None, help="repetitions (pool mode 15, step mode 9)")
    p.add_argument("--drawn", type=int, default=30, help="pool mode: drawn ci-strategy cases per world")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda", help="step mode")
    p.add_argument("--model", default="gpt2-ish", help="step mode: model preset")
    p.add_argument("--n", "--accum-steps", dest="n", type=int, default=4,
                   help="step mode: micro-steps N (under torchrun spell it --accum-steps: torchrun reads --n as its own)")
    p.add_argument("--b", type=int, default=8, help="step mode: B per rank")
    p.add_argument("--seq", type=int, default=None, help="step mode: sequence length (default: the model's)")
    p.add_argument("--steps", type=int, default=5, help="step mode: optimizer steps per repetition")
    p.add_argument("--sides", default="xtrain,torch,plain", help="step mode: which trainers, comma list of "
                   "xtrain, torch (xtrain's model under DDP no_sync), plain (benchmarks/plain_torch.py under DDP no_sync), "
                   "fsdp2 (FSDP2, sync at the boundary), fsdp2-sync-every-micro (the same, reduce-scatter every micro-step)")
    p.add_argument("--cold", default=None, help="pool mode: start methods timed cold, comma list of spawn, "
                   "forkserver (default: both on gloo; NCCL: spawn only, CUDA and forks do not mix)")
    args = p.parse_args(argv)
    args.cold = args.cold.split(",") if args.cold else ["spawn", "forkserver"] if args.backend == "gloo" else ["spawn"]
    if set(args.cold) - {"spawn", "forkserver"} or (args.backend == "nccl" and "forkserver" in args.cold):
        p.error(f"--cold must name spawn and/or forkserver (NCCL: spawn only), got {','.join(args.cold)!r}")
    args.sides = [x for x in args.sides.split(",") if x]
    sides = {"xtrain", "torch", "plain", "fsdp2", "fsdp2-sync-every-micro"}
    if not args.sides or set(args.sides) - sides:
        p.error(f"--sides must name some of {', '.join(sorted(sides))}; got {','.join(args.sides)!r}")
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
    from verify.study import close_pools

    close_pools()
    return 0


if __name__ == "__main__":
    sys.exit(main())
