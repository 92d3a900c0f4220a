"""At which N does the gate find a gradient accumulated in low precision? One table per precision.

    python -m benchmarks.lowprec_detection [--out reports/cpu] [--max-n 1024] [--seeds 3]

A benchmark of numerics, not of speed, and not a test. For each precision (bf16, fp16 autocast), each
(init, data) seed pair and N on a grid up to --max-n (B = 1, the long-window gate's shape), the worst
error / bound over the equivalence gate's step-0 checks (verify/gates/tolerance.py: C·max(err(big),
err(big, all parameters)) + F·κ, κ only where the gate computes it, exactly as check_equivalence judges)
for three trainers on the same rows:

    xtrain        verify.adapters.xtrain.single: autocast over fp32 parameters, fp32 `.grad` (must stay < 1)
    buffer        broken_lowprec.low_precision_grad: `.grad` rounded to bf16 / fp16 after every micro-step
    low params    broken_lowprec.bf16_params (bf16) / half_model (fp16): the model itself in bf16 / fp16;
                  its ratio here is the numbers alone (the gate rejects it at any N ≥ 2 by the gradient's
                  dtype, tolerance.Judge.accumulator: its big batch reduces in the same bits)

The detection N of a trainer is the smallest grid N whose ratio is > 1 (none: "> max"). The float64
reference and κ (per-row float64 runs) are the same for every precision and trainer (the planted ones are
xtrain's trainer in float64), so each is computed once per (seed pair, N).

Writes OUT/lowprec-detection.json (verify._meta header).
"""
from __future__ import annotations

import json
import os
import time

import torch

from xtrain_core.cli import Parser, positive_int
from xtrain_core.config import ModelConfig

from verify._meta import atomic_write, header
from verify.adapters import broken_lowprec, xtrain
from verify.case import Case, block_grads, drive
from verify.gates.tolerance import bound, condition, needs_kappa, step0_checks

KIND = "lowprec-detection"
MODEL = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)  # bf16_accumulation's "mini"
GRID = (16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512, 768, 1024)
TRAINERS = {"bf16": {"xtrain": xtrain.single, "buffer": broken_lowprec.low_precision_grad,
                     "low params": broken_lowprec.bf16_params},
            "fp16": {"xtrain": xtrain.single, "buffer": broken_lowprec.low_precision_grad,
                     "low params": broken_lowprec.half_model}}


def worst_ratio(acc, big, ref, kappa: dict, precision: str, N: int = 1) -> tuple[float, str]:
    """The gate's worst error / bound (lazy κ as the gate: tolerance.needs_kappa) and its check."""
    out = [(a / bound(b, k if needs_kappa(a, b, o) else 1.0, o, precision, N), what)
           for what, _, a, b, k, o in step0_checks(acc, big, ref, kappa, precision)]
    return max(out)


def measure(opts, N: int, seed: int, data_seed: int) -> dict:
    """Every precision × trainer at one N: {precision: {trainer: (ratio, check)}}."""
    case = Case(accum_steps=N, micro_batch=1, steps=1, options=opts, seed=seed, data_seed=data_seed)
    batches = case.batches(xtrain.single)

    def run(adapter, c, n, dtype):
        return drive(adapter(c.spec(accum_steps=n, dtype=dtype)), batches, n, dtype=dtype, gate=KIND)

    ref = run(xtrain.single, case, 1, torch.float64)
    kappa = condition(block_grads(xtrain.single, case, "cpu"), ref.grads0)
    out = {}
    for p, trainers in TRAINERS.items():
        c = case.replace(precision=p)
        out[p] = {name: worst_ratio(run(a, c, N, torch.float32), run(a, c, 1, torch.float32), ref, kappa, p, N)
                  for name, a in trainers.items()}
    return out


def detection(rows: list[dict], p: str, name: str):
    """The smallest N whose ratio is > 1, or None."""
    return next((r["N"] for r in rows if r["ratios"][p][name][0] > 1.0), None)


def main(argv=None):
    ap = Parser(prog="benchmarks.lowprec_detection", description="the N at which the gate finds low-precision accumulation")
    ap.add_argument("--out", default=os.path.join("reports", "cpu"))
    ap.add_argument("--max-n", type=positive_int, default=1024)
    ap.add_argument("--seeds", type=positive_int, default=3, help="(init, data) seed pairs: (0, 0), (1, 1), ...")
    ap.add_argument("--threads", type=positive_int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    opts = xtrain.XtrainOptions(model=MODEL, seq_len=16)
    ns = [n for n in GRID if n <= a.max_n]
    print(f"{KIND}: {opts.describe()}, B=1, {a.seeds} seed pair(s), N in {ns}; worst error/bound of the "
          f"equivalence gate's checks (> 1: rejected)", flush=True)
    seeds, t0 = [], time.perf_counter()
    for s in range(a.seeds):
        rows = []
        print(f"\nseed pair ({s}, {s})\n{'N':>5} " + " ".join(f"{p + ' ' + n:>16}" for p in TRAINERS for n in TRAINERS[p]))
        for N in ns:
            t = time.perf_counter()
            rows.append(dict(N=N, ratios=measure(opts, N, s, s), seconds=time.perf_counter() - t))
            print(f"{N:>5} " + " ".join(f"{rows[-1]['ratios'][p][n][0]:>16.3f}" for p in TRAINERS for n in TRAINERS[p])
                  + f"   {rows[-1]['seconds']:.1f} s", flush=True)
        seeds.append(dict(seed=s, data_seed=s, rows=rows,
                          detection_n={p: {n: detection(rows, p, n) for n in TRAINERS[p]} for p in TRAINERS}))
    summary = {p: {n: [sd["detection_n"][p][n] for sd in seeds] for n in TRAINERS[p]} for p in TRAINERS}
    worst_xtrain = {p: max(r["ratios"][p]["xtrain"][0] for sd in seeds for r in sd["rows"]) for p in TRAINERS}
    print("\ndetection N (smallest grid N with error/bound > 1) per seed pair:")
    for p in TRAINERS:
        for n in TRAINERS[p]:
            print(f"  {p} {n:<11} {['> %d' % ns[-1] if d is None else d for d in summary[p][n]]}")
        print(f"  {p} xtrain worst error/bound at any N: {worst_xtrain[p]:.3f}")
    doc = dict(header(KIND), settings=dict(model=vars(MODEL), seq_len=16, micro_batch=1, grid=ns, seeds=a.seeds,
                                           threads=torch.get_num_threads()),
               detection_n=summary, worst_xtrain=worst_xtrain, seeds=seeds, seconds=time.perf_counter() - t0)
    path = os.path.join(a.out, f"{KIND}.json")
    atomic_write(path, json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {path} ({doc['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
