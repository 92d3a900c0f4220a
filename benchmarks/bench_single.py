"""Single-GPU step time: xtrain's AccumTrainer vs the plain-torch loop, side by side in one run.

    python -m benchmarks.bench_single --device cuda [--model gpt2-ish] [--rounds 5] [--out reports/h200]
    python -m benchmarks.bench_single --device cpu --model tiny --rounds 2 --configs 1x2,2x1   # smoke test

The "anchor" side is benchmarks/plain_torch.py: a plain-PyTorch GPT and accumulation loop with the
protocol of the recorded plain-torch runs (reports/anchors/). Both sides train the same architecture
from the same initial weights on the same token tensors; rounds alternate (anchor step, xtrain step,
anchor step, ...) so drift in clocks or temperature hits both alike. Each timed step ends in a device
synchronize. Reports the median step time per side and their ratio (bench-single.json in --out).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from xtrain_core.cli import Parser, UsageError, fail, positive_int, resolve_device
from xtrain_core.config import PRESETS, OptimConfig
from xtrain_core.model import build_model
from xtrain_core.trainer import AccumTrainer

from verify import atomic_write, report_header

from . import plain_torch


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # CPU steps are synchronous already


def bench(cfg, dev, N, B, S, rounds):
    # anchor: plain_torch's own GPT and loop, AdamW(lr=1e-4; fused on CUDA), clip 1.0. Seed 0 gives it the
    # weights build_model(cfg, 0) gives xtrain.
    torch.manual_seed(0)
    a_model = plain_torch.GPT(vocab=cfg.vocab_size, d=cfg.d_model, layers=cfg.n_layer, heads=cfg.n_head,
                              seq=cfg.seq_len).to(dev)
    a_opt = plain_torch.make_optimizer(a_model)
    x_model = build_model(cfg, 0, device=dev)
    # torch's AdamW defaults (betas 0.999, weight decay 0.01), as the anchor uses them
    x_tr = AccumTrainer(x_model, OptimConfig(lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, max_grad_norm=1.0), N)
    gen = torch.Generator().manual_seed(1)
    data = plain_torch.random_tokens(gen, N, B, S, cfg.vocab_size, dev)  # N pairs of (B, S)

    def a_step():
        plain_torch.train_step(a_model, a_opt, data)

    def x_step():
        x_tr.train_step(data)

    times = {"anchor": [], "xtrain": []}
    for f in (a_step, x_step):  # warm-up: allocates AdamW state, autotunes kernels
        f()
    _sync(dev)
    for _ in range(rounds):
        for name, f in (("anchor", a_step), ("xtrain", x_step)):
            _sync(dev)
            t0 = time.perf_counter()
            f()
            _sync(dev)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return dict(N=N, B=B, S=S, anchor_ms=med["anchor"], xtrain_ms=med["xtrain"],
                ratio=med["xtrain"] / med["anchor"], tok_s=N * B * S / (med["xtrain"] / 1e3),
                anchor_all_ms=[t * 1e3 for t in times["anchor"]], xtrain_all_ms=[t * 1e3 for t in times["xtrain"]])


def main(argv=None):
    p = Parser(prog="benchmarks.bench_single", description="xtrain vs plain-torch step time, side by side")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=sorted(PRESETS), default="gpt2-ish")
    p.add_argument("--seq-len", type=positive_int, default=None)
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--configs", default="1x32,4x8,8x4,32x1", help="comma-separated NxB")
    p.add_argument("--out", default="reports")
    a = p.parse_args(argv)
    try:
        dev = resolve_device(a.device)
        cfg = PRESETS[a.model]
        S = a.seq_len or cfg.seq_len
        if S > cfg.seq_len:
            raise UsageError(f"--seq-len {S} exceeds --model {a.model}'s limit of {cfg.seq_len}")
        try:
            configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",")]
        except ValueError:
            configs = []
        if not configs or any(len(c) != 2 or min(c) < 1 for c in configs):
            raise UsageError(f"--configs must look like 1x32,4x8 (N x B, each ≥ 1), got {a.configs!r}")
    except UsageError as e:
        fail(str(e))
    plain_torch.tf32_off()
    rows = []
    print(f"{'N':>3} {'B':>3} {'anchor ms':>10} {'xtrain ms':>10} {'ratio':>6} {'tok/s':>9}", flush=True)
    for N, B in configs:
        r = bench(cfg, dev, N, B, S, a.rounds)
        rows.append(r)
        print(f"{N:>3} {B:>3} {r['anchor_ms']:>10.2f} {r['xtrain_ms']:>10.2f} {r['ratio']:>6.3f} {r['tok_s']:>9,.0f}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    doc = dict(**report_header("bench_single", dev), model=a.model,
               seq_len=S, rounds=a.rounds, rows=rows)
    os.makedirs(a.out, exist_ok=True)
    atomic_write(os.path.join(a.out, "bench-single.json"), json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
