"""Copied verbatim from ../shared/anchors/torch_baseline.py (the plain-torch reference) so benchmarks can
run it side by side with xtrain on machines that only receive this repository.

Reference figures for plain PyTorch gradient accumulation (single GPU; DDP + no_sync on 2 GPUs).
xtrain's performance goals are set against these, measured side by side on the same model:
GPT, 12 layers, d=768, 12 heads, vocab 8192, seq 512, fp32 (TF32 off), explicit attention, fused AdamW.

single GPU:  python torch_baseline.py single --out DIR [--effective-batch 32]
two GPUs:    torchrun --nproc-per-node 2 torch_baseline.py ddp --out DIR [--n 4 --b 8]
Results from one H200 / two H200s (torch 2.11, CUDA 13): h200_torch_single_E32.json, h200x2_torch_ddp_N4B8.json
"""
import argparse, json, math, os, threading, time
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        # explicit attention (no flash) so activations scale like a textbook trainer
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.h)
        mask = torch.ones(T, T, device=x.device, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=8192, d=768, layers=12, h=12, seq=512):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class NvmlPeak:
    """Samples device memory used (what nvidia-smi shows) in a thread; keeps the max."""
    def __init__(self, index=0, period=0.002):
        import pynvml
        pynvml.nvmlInit()
        self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        self.period, self.peak, self._stop = period, 0, threading.Event()

    def used(self):
        return self.nv.nvmlDeviceGetMemoryInfo(self.h).used

    def __enter__(self):
        self.peak = self.used()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(self.period)

    def __exit__(self, *a):
        self._stop.set(); self.t.join()
        self.peak = max(self.peak, self.used())


def batches(gen, n, b, seq, vocab, dev):
    x = torch.randint(0, vocab, (n * b, seq + 1), generator=gen)
    x = x.to(dev)
    return [(x[i * b:(i + 1) * b, :-1], x[i * b:(i + 1) * b, 1:]) for i in range(n)]


def train_steps(model, opt, data_per_step, n, sync_ctx=None, boundary_allreduce=None):
    for micro in data_per_step:
        for i, (x, y) in enumerate(micro):
            last = i == n - 1
            ctx = sync_ctx() if (sync_ctx and not last) else _null()
            with ctx:
                loss = model(x, y)
                (loss if n == 1 else loss * (1.0 / n)).backward()
        if boundary_allreduce:
            boundary_allreduce()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)


class _null:
    def __enter__(self): return self
    def __exit__(self, *a): return False


def single(args):
    dev = torch.device("cuda:0")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    E = args.effective_batch
    cfgs = [(n, E // n) for n in (1, 2, 4, 8, 16, 32) if E % n == 0]
    cfgs += [(n, 1) for n in (1, 2, 8, 32) if (n, 1) not in cfgs]  # flatness at fixed B
    for n, b in cfgs:
        torch.manual_seed(0)
        model = GPT(seq=args.seq).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        gen = torch.Generator().manual_seed(1)
        steps = [batches(gen, n, b, args.seq, 8192, dev) for _ in range(args.steps + 1)]
        train_steps(model, opt, steps[:1], n)  # warm-up, allocates Adam state
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        with NvmlPeak() as nv:
            t0 = time.perf_counter()
            train_steps(model, opt, steps[1:], n)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / args.steps
        static = sum(p.numel() * p.element_size() * 4 for p in model.parameters())
        rows.append(dict(N=n, B=b, eff=n * b, step_ms=dt * 1e3,
                         tok_s=n * b * args.seq / dt,
                         peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                         peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                         nvml_peak_gib=nv.peak / 2**30, static_gib=static / 2**30))
        print(json.dumps(rows[-1]), flush=True)
        del model, opt, steps
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(args.out, "single.json"), "w"), indent=1)


def ddp(args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import profile, ProfilerActivity
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    n, b = args.n, args.b
    out = {}
    for mode in ("ddp_no_sync", "ddp_every_step", "manual_boundary", "manual_flat_boundary"):
        torch.manual_seed(0)
        base = GPT(seq=args.seq).to(dev)
        model = DDP(base, device_ids=[rank], gradient_as_bucket_view=True) if mode.startswith("ddp") else base
        if not mode.startswith("ddp"):
            for p in base.parameters():
                dist.broadcast(p.data, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        gen = torch.Generator().manual_seed(1 + rank)
        steps = [batches(gen, n, b, args.seq, 8192, dev) for _ in range(args.steps + 1)]
        sync_ctx = model.no_sync if mode == "ddp_no_sync" else None
        params = [p for p in base.parameters()]

        def per_param():
            for p in params:
                dist.all_reduce(p.grad); p.grad.div_(world)

        def flat():
            g = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(g); g.div_(world)
            o = 0
            for p in params:
                k = p.numel(); p.grad.copy_(g[o:o + k].view_as(p)); o += k

        ar = per_param if mode == "manual_boundary" else flat if mode == "manual_flat_boundary" else None
        train_steps(model, opt, steps[:1], n, sync_ctx, ar)
        torch.cuda.synchronize(); dist.barrier()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        train_steps(model, opt, steps[1:], n, sync_ctx, ar)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train_steps(model, opt, steps[1:2], n, sync_ctx, ar)
            torch.cuda.synchronize()
        names = {}
        for e in prof.events():
            nm = e.name
            if "nccl" in nm.lower() or "allreduce" in nm.lower() or "all_reduce" in nm.lower():
                names[nm] = names.get(nm, 0) + 1
        out[mode] = dict(step_ms=dt * 1e3, peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                         collective_events_one_step=names)
        if rank == 0:
            print(mode, json.dumps(out[mode]), flush=True)
        del model, base, opt, steps
        torch.cuda.empty_cache()
    if rank == 0:
        json.dump(out, open(os.path.join(args.out, "ddp.json"), "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["single", "ddp"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--effective-batch", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--b", type=int, default=8)
    a = ap.parse_args()
    single(a) if a.what == "single" else ddp(a)
