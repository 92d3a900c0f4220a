"""Plain PyTorch: the yardstick the benchmarks hold xtrain against.

Nothing here is imported from xtrain_core. It is a GPT and an accumulation loop written the way a
textbook trainer writes them, so "xtrain vs plain torch" compares xtrain with the obvious code, not
with itself. The benchmarks run both in one process, on the same GPU, clocks and token tensors.

What it keeps fixed, so that new numbers compare with the recorded plain-torch runs in reports/anchors/:
  * model: token + position embeddings, `layers` pre-LayerNorm blocks, final LayerNorm, LM head without
    bias. A block: LN -> one Linear(d, 3d) for q, k, v -> causal softmax attention computed explicitly
    (a T×T boolean mask, no fused/flash kernel) -> Linear(d, d); LN -> Linear(d, 4d) -> GELU ->
    Linear(4d, d); both with residuals. Defaults: d 768, 12 heads, 12 layers, vocab 8192, seq 512.
  * fp32 with TF32 off; loss: cross-entropy averaged over every (sequence, position) row.
  * torch.optim.AdamW(lr=1e-4), fused on CUDA, torch's defaults otherwise.
  * one optimizer step: N micro-steps, each a backward of loss·(1/N) (no multiply at all when N == 1),
    then clip_grad_norm_(1.0), step, zero_grad(set_to_none=True). Under DDP, micro-steps 0..N-2 run
    forward AND backward inside no_sync().
  * data: uniformly random token ids.

As a library: `GPT`, `make_optimizer`, `random_tokens`, `micro_step` / `finish_step` / `train_step`.
As a CLI, the recorded runs' measurements (JSON with the common report header):

    python -m benchmarks.plain_torch single --device cuda --out DIR [--configs 1x32,4x8,...] [--steps 3]
    torchrun --nproc-per-node 2 -m benchmarks.plain_torch ddp --device cuda --out DIR \
        [--accum-steps 4 --micro-batch 8]

Smaller models for a CPU smoke run: --seq-len, --vocab-size, --d-model, --n-layer, --n-head.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

GiB = 2**30


# -- the model ----------------------------------------------------------------------------------------

class Block(nn.Module):
    """One pre-LayerNorm transformer layer."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.norm_mlp = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.norm_attn(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))  # (b, heads, t, hd)
        # Spelled out instead of F.scaled_dot_product_attention: the (b, heads, t, t) scores exist in
        # memory, as in the recorded runs, so activation memory grows with t² the same way.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        # Each block makes its own T×T mask, as a self-contained textbook block does. Not a buffer (DDP
        # would broadcast it before every forward); the few small kernels per layer are part of what
        # the recorded runs timed, and they show when micro-batches are small (B=1 is launch-bound).
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        x = x + self.attn_out((weights @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    """idx (b, t) int64 -> logits (b, t, vocab).

    Modules that draw random numbers are created in the same order as xtrain_core's GPT, so under the
    same torch.manual_seed both start from the same weights (bench_single relies on it)."""

    def __init__(self, vocab: int = 8192, d: int = 768, layers: int = 12, heads: int = 12, seq: int = 512):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over all b·t rows."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)


def random_tokens(gen: torch.Generator, n: int, b: int, seq: int, vocab: int, device) -> list:
    """n micro-batches of (inputs, targets), each (b, seq) int64 on `device`; targets are the inputs
    shifted by one. Drawn on the CPU from `gen` (reproducible whatever the device), moved once."""
    out = []
    for _ in range(n):
        tokens = torch.randint(vocab, (b, seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


# -- the loop -----------------------------------------------------------------------------------------

def micro_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, sync: bool = True) -> torch.Tensor:
    """Forward and backward of one of n micro-batches; .grad sums over the step's micro-steps.
    sync=False on a DDP model: no_sync() must cover the forward too, since DDP decides in forward
    whether the coming backward all-reduces."""
    quiet = not sync and hasattr(model, "no_sync")
    with model.no_sync() if quiet else contextlib.nullcontext():
        loss = lm_loss(model, x, y)
        (loss if n == 1 else loss * (1.0 / n)).backward()  # N == 1: the plain, unscaled backward
    return loss.detach()


def finish_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The boundary: clip the summed (= mean over the N·b batch) gradient, step, drop the gradients."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, micro_batches: list) -> list:
    """One optimizer step over the given micro-batches; returns their (detached) losses."""
    n = len(micro_batches)
    losses = [micro_step(model, x, y, n, sync=i == n - 1) for i, (x, y) in enumerate(micro_batches)]
    finish_step(model, opt)
    return losses


# -- measuring (the CLI) ------------------------------------------------------------------------------

class NvmlPeak:
    """Highest device memory in use (what nvidia-smi shows: CUDA context and caches included), polled
    by a background thread. peak_gib stays None where NVML is missing or fails."""

    def __init__(self, device: torch.device, period: float = 0.002):
        self.device, self.period, self.peak_gib = device, period, None
        self._stop, self._thread = threading.Event(), None

    def __enter__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            try:  # by UUID: NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES, torch does not
                uuid = str(torch.cuda.get_device_properties(self.device).uuid)
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
            except Exception:  # noqa: BLE001
                handle = pynvml.nvmlDeviceGetHandleByIndex(self.device.index or 0)
            used = [pynvml.nvmlDeviceGetMemoryInfo(handle).used]
        except Exception:  # noqa: BLE001  (no NVML: the other numbers still count)
            return self

        def poll():
            while not self._stop.is_set():
                used[0] = max(used[0], pynvml.nvmlDeviceGetMemoryInfo(handle).used)
                time.sleep(self.period)

        self._used = used
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_gib = self._used[0] / GiB


def tf32_off() -> None:
    """True fp32 on the GPU: TF32 off for matmuls and convolutions, as every fp32 measurement here is taken
    (newer torch prefers fp32_precision and may warn; the effect is the same)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def measure_single(device: torch.device, n: int, b: int, steps: int, model_kw: dict) -> dict:
    """A fresh model per configuration; one warm-up step, then `steps` timed ones."""
    seq, vocab = model_kw["seq"], model_kw["vocab"]
    torch.manual_seed(0)
    model = GPT(**model_kw).to(device)
    opt = make_optimizer(model)
    gen = torch.Generator().manual_seed(1)
    data = [random_tokens(gen, n, b, seq, vocab, device) for _ in range(steps + 1)]  # no RNG or copies while timed
    train_step(model, opt, data[0])  # warm-up: AdamW allocates its state, kernels get picked
    params = _tensor_bytes(model.parameters())
    # what any step holds before activations: weights, one gradient per weight, AdamW's two moments
    static = 2 * params + _tensor_bytes(v for s in opt.state.values() for v in s.values())
    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with NvmlPeak(device) if cuda else contextlib.nullcontext() as nvml:
        t0 = time.perf_counter()
        for micro_batches in data[1:]:
            train_step(model, opt, micro_batches)
        _sync(device)
        step_s = (time.perf_counter() - t0) / steps
    row = dict(N=n, B=b, eff=n * b, step_ms=step_s * 1e3, tok_s=n * b * seq / step_s,
               peak_alloc_gib=torch.cuda.max_memory_allocated(device) / GiB if cuda else None,
               peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GiB if cuda else None,
               nvml_peak_gib=nvml.peak_gib if cuda else None, static_gib=static / GiB)
    del model, opt, data
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # the next configuration starts from an empty cache
    return row


def measure_ddp(device: torch.device, n: int, b: int, steps: int, model_kw: dict) -> dict:
    """This rank's share of a DDP run with no_sync(); the step time is the slowest rank's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights at construction anyway
    model = DDP(GPT(**model_kw).to(device), device_ids=[device] if device.type == "cuda" else None)
    opt = make_optimizer(model)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data
    data = [random_tokens(gen, n, b, model_kw["seq"], model_kw["vocab"], device) for _ in range(steps + 1)]
    # One warm-up step, as in the recorded run; DDP's one-time bucket rebuild then falls in the first
    # timed step (bench_dist, which compares trainers rather than reproducing that run, warms up twice).
    train_step(model, opt, data[0])
    _sync(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for micro_batches in data[1:]:
        train_step(model, opt, micro_batches)
    _sync(device)
    slowest = torch.tensor([(time.perf_counter() - t0) / steps], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peak = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None
    return dict(world=dist.get_world_size(), N=n, B=b,
                ddp_no_sync=dict(step_ms=slowest.item() * 1e3, peak_alloc_gib=peak))


def main(argv=None) -> int:
    from verify import atomic_write, report_header

    p = argparse.ArgumentParser(prog="benchmarks.plain_torch", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["single", "ddp"])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--out", default=".")
    p.add_argument("--configs", default="1x32,2x16,4x8,8x4,16x2,32x1,1x1,2x1,8x1", help="single: comma-separated NxB")
    # long names only: torchrun would take a prefix such as --n or --d for one of its own options
    p.add_argument("--accum-steps", type=int, default=4, help="ddp: micro-steps N per optimizer step")
    p.add_argument("--micro-batch", type=int, default=8, help="ddp: micro-batch B per rank")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    a = p.parse_args(argv)
    model_kw = dict(vocab=a.vocab_size, d=a.d_model, layers=a.n_layer, heads=a.n_head, seq=a.seq_len)
    tf32_off()
    if a.what == "single":
        device = torch.device(a.device)
        configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",")]
        rows = []
        for n, b in configs:
            rows.append(measure_single(device, n, b, a.steps, model_kw))
            print(json.dumps(rows[-1]), flush=True)
        path = os.path.join(a.out, "plain_torch_single.json")
        atomic_write(path, json.dumps({**report_header("plain_torch_single", device), "model": model_kw,
                                       "steps": a.steps, "rows": rows}, indent=1))
        print("wrote", path)
        return 0
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    res = measure_ddp(device, a.accum_steps, a.micro_batch, a.steps, model_kw)
    if dist.get_rank() == 0:
        path = os.path.join(a.out, f"plain_torch_ddp_w{res['world']}.json")
        atomic_write(path, json.dumps({**report_header("plain_torch_ddp", device), "model": model_kw,
                                       "steps": a.steps, "results": res}, indent=1))
        print(json.dumps(res), "\nwrote", path, flush=True)
    dist.barrier()  # every rank finished before the group goes away
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
