"""python -m xtrain_core.train --accum-steps N --micro-batch B --steps K [--seq-len S] [--data FILE | --docs FILE]
                             [--loss-norm mean|tokens] [--precision fp32|bf16|fp16]
                             [--device cpu|cuda] [--seed SEED] [--model tiny|small|gpt2-ish]
torchrun --nproc-per-node W -m xtrain_core.train ... [--ddp-impl xtrain|torch|fsdp2]

Trains the GPT with gradient accumulation: each optimizer step is N micro-steps of B sequences, an effective
batch of N×B sequences while memory holds one micro-batch. Under torchrun (W > 1) it trains data-parallel:
B is per rank, the effective batch N×B×W, gradients all-reduced once per optimizer step (gloo on CPU, NCCL on
CUDA with one GPU per rank, cuda:LOCAL_RANK). Design: docs/design/protocol.md, docs/design/distributed.md.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import time

from .cli import (SEED_MAX, Parser, Progress, UsageError, check_fits, fail, int_at_least, positive_float,
                  resolve_device, text_file, torchrun_env)
from .config import (IMPLS, DDPImpl, MAX_ACCUM_STEPS, MAX_EFFECTIVE_BATCH, MAX_MICRO_BATCH, MAX_STEPS, PRESETS, OptimConfig,
                     TrainConfig, effective_batch)


def parse_args(argv=None):
    p = Parser(prog="xtrain_core.train", description=__doc__.split("\n\n")[1])
    p.add_argument("--accum-steps", type=int_at_least(1, MAX_ACCUM_STEPS), default=1,
                   help=f"N: micro-steps per optimizer step (≤ {MAX_ACCUM_STEPS})")
    p.add_argument("--micro-batch", type=int_at_least(1, MAX_MICRO_BATCH), default=8,
                   help=f"B: sequences per micro-step (≤ {MAX_MICRO_BATCH}; N × B × W ≤ {MAX_EFFECTIVE_BATCH})")
    p.add_argument("--steps", type=int_at_least(1, MAX_STEPS), default=10, help="K: optimizer steps")
    p.add_argument("--seq-len", type=int_at_least(1), default=None, help="S: tokens per sequence (default: the model's limit)")
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--data", default=None, help="UTF-8 text file read as byte tokens (default: embedded synthetic stream)")
    p.add_argument("--docs", default=None, metavar="FILE",
                   help="UTF-8 text, one document per line, each one sequence truncated to --seq-len and "
                        "right-padded with ignored targets (default loss norm: tokens)")
    p.add_argument("--loss-norm", choices=("mean", "tokens"), default=None,
                   help="mean: CE mean per micro-batch × 1/N (fixed-length data; the default); tokens: Σ CE over "
                        "valid tokens / their count over the whole window and every rank (the default with --docs)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="fp32; bf16 autocast; fp16 autocast with a GradScaler (parameters and gradients fp32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:K")
    p.add_argument("--seed", type=int_at_least(0, SEED_MAX), default=0)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--warmup-steps", type=int_at_least(0, MAX_STEPS), default=0)
    p.add_argument("--threads", type=threads_arg, default="auto",
                   help="CPU intra-op threads: auto (one, unless OMP_NUM_THREADS is set: a CPU that other processes "
                        "share does not collapse; docs/performance.md) or a number")
    p.add_argument("--ddp-impl", choices=IMPLS, default="xtrain",
                   help="under torchrun: xtrain's boundary all-reduce (default), torch DDP with no_sync(), or FSDP2 "
                        "(fully_shard per block, set_requires_gradient_sync at the boundary)")
    return p.parse_args(argv)


def threads_arg(text: str):
    if text == "auto":
        return text
    return int_at_least(1, 1024)(text)


def set_threads(args) -> None:
    """Before torch loads its OpenMP runtime (which reads the environment once): auto is ONE intra-op thread
    unless OMP_NUM_THREADS says otherwise (torchrun's own default for each rank). Measured on a 2-core box
    (reports/cpu/cpu-threads.md): torch's default, one spinning thread per core, is
    fastest on an idle box and collapses 4-6x with two busy neighbours; sleeping idle threads
    (OMP_WAIT_POLICY=PASSIVE) do not collapse but are 2-3x slower when idle; one thread is within 10 % of
    the best on the default model idle and does not collapse. `--threads N` asks for N."""
    if args.threads == "auto":
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def apply_threads(args) -> None:
    import torch

    if args.threads != "auto":
        torch.set_num_threads(args.threads)


def build(args, dist_env=None):
    """Flags -> validated configs, or UsageError naming the flag. Nothing is run or written yet, and no
    process group exists: under torchrun every rank fails the same way, and nobody waits for it. Torch is
    imported only by the checks that need it (--docs, --device): a bad size or file fails in a blink."""
    model_cfg = PRESETS[args.model]
    world = dist_env[1] if dist_env is not None else 1
    E = effective_batch(args.accum_steps, args.micro_batch, world)
    if E > MAX_EFFECTIVE_BATCH:
        w = f" × {world}" if world > 1 else ""
        raise UsageError(f"effective batch {args.accum_steps} × {args.micro_batch}{w} = {E} sequences per step exceeds "
                         f"{MAX_EFFECTIVE_BATCH}; lower --accum-steps or --micro-batch")
    seq_len = args.seq_len or model_cfg.seq_len
    if seq_len > model_cfg.seq_len:
        raise UsageError(f"--seq-len {seq_len} exceeds --model {args.model}'s limit of {model_cfg.seq_len}; "
                         f"pass --seq-len ≤ {model_cfg.seq_len}")
    if args.data is not None and args.docs is not None:
        raise UsageError("--data and --docs: pass one (--data streams a text as byte windows, --docs reads one "
                         "document per line)")
    loss_norm = args.loss_norm or ("tokens" if args.docs is not None else "mean")
    if args.docs is not None:
        if loss_norm == "mean":
            raise UsageError("--docs pads sequences, and --loss-norm mean weighs every micro-batch alike whatever its "
                             "number of valid tokens (wrong on padded data); pass --loss-norm tokens")
        text_file("--docs", args.docs)
        from .data import DocStream

        try:
            DocStream(args.docs, 1)
        except (OSError, ValueError) as e:
            raise UsageError(f"--docs {args.docs}: {e}") from None
        model_cfg = dataclasses.replace(model_cfg, vocab_size=max(256, model_cfg.vocab_size))  # byte tokens
    if args.data is not None:
        text_file("--data", args.data)
        size = os.path.getsize(args.data)
        if size < seq_len + 2:
            raise UsageError(f"--data {args.data} has {size} bytes; --seq-len {seq_len} needs at least {seq_len + 2}")
        model_cfg = dataclasses.replace(model_cfg, vocab_size=max(256, model_cfg.vocab_size))  # byte tokens
    if args.ddp_impl == "fsdp2" and args.precision == "fp16":
        raise UsageError("--ddp-impl fsdp2 --precision fp16: not offered (a GradScaler would not agree on inf/NaN "
                         "across gradient shards); pass --precision bf16 or fp32")
    train = TrainConfig(accum_steps=args.accum_steps, micro_batch=args.micro_batch, steps=args.steps,
                        seq_len=seq_len, seed=args.seed, loss_norm=loss_norm, precision=args.precision)
    optim = OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps)
    if dist_env is not None and dist_env[1] > 1 and args.device.startswith("cuda"):
        if args.device != "cuda":
            raise UsageError(f"--device {args.device}: under torchrun each rank uses cuda:LOCAL_RANK; pass --device cuda")
        device = resolve_device(f"cuda:{dist_env[2]}")  # one GPU per rank
    else:
        device = resolve_device(args.device)
    check_fits(model_cfg.step_bytes_at_least(train.micro_batch, seq_len, train.precision), device,
               f"--micro-batch {train.micro_batch} of --model {args.model} (S={seq_len}, {train.precision})",
               "pass a smaller --micro-batch (and a larger --accum-steps: the same effective batch)", at_least=True)
    return model_cfg, train, optim, device


# --ddp-impl -> (module, class), imported when chosen: fsdp.py pulls in torch.distributed.fsdp
_TRAINERS = {DDPImpl.XTRAIN: ("distributed", "DistAccumTrainer"), DDPImpl.TORCH: ("distributed", "TorchDDPTrainer"),
             DDPImpl.FSDP2: ("fsdp", "FSDP2Trainer")}


def make_trainer(impl: str, model, optim: OptimConfig, accum_steps: int, *, group=None, **numerics):
    """--ddp-impl xtrain|torch|fsdp2 -> a trainer over `group` (None: the default group); numerics: loss_norm,
    precision. It lives here, where the CLI builds trainers: in distributed.py it closed an import cycle
    with fsdp.py, whose FSDP2Trainer builds on distributed.RankAveraged."""
    if impl not in _TRAINERS:
        raise ValueError(f"ddp impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    module, name = _TRAINERS[DDPImpl(impl)]
    trainer_class = getattr(importlib.import_module(f"xtrain_core.{module}"), name)
    return trainer_class(model, optim, accum_steps, group=group, **numerics)


def run(model_cfg, train: TrainConfig, optim: OptimConfig, device, data=None, out=sys.stdout, *,
        rank: int = 0, world: int = 1, impl: str = "xtrain", docs=None):
    """world == 1: the single-process trainer. world > 1: this rank of a data-parallel run (the
    process group must exist); rank 0 prints."""
    import torch

    from .data import DocStream, TokenStream, split_micro
    from .distributed import shard
    from .model import IGNORE, build_model
    from .trainer import AccumTrainer

    N, B, S = train.accum_steps, train.micro_batch, train.seq_len
    E = effective_batch(N, B, world)
    lead = rank == 0
    if lead:
        w = f" × {world}" if world > 1 else ""
        pad = f"up to {E * S} tokens, padded; loss over valid tokens" if docs is not None else f"{E * S} tokens"
        extra = "" if train.precision == "fp32" else f", {train.precision} autocast"
        print(f"effective batch = {N} × {B}{w} = {E} sequences ({pad}){extra}", file=out, flush=True)
        if device.type == "cpu":
            n = torch.get_num_threads()
            print(f"cpu: {n} intra-op thread{'s' if n > 1 else ''} per process (--threads N to change)",
                  file=sys.stderr, flush=True)
    try:
        stream = (DocStream(docs, S, seed=train.seed) if docs is not None
                  else TokenStream(model_cfg.vocab_size, S, seed=train.seed, data=data))
    except ValueError as e:
        raise UsageError(f"--{'docs' if docs is not None else 'data'}: {e}") from None
    model = build_model(model_cfg, train.seed, device=device)
    numerics = dict(loss_norm=train.loss_norm, precision=train.precision)
    trainer = (AccumTrainer(model, optim, N, **numerics) if world == 1
               else make_trainer(impl, model, optim, N, **numerics))
    bar = Progress(train.steps, label="train ") if lead else None
    tokens_seen, t0, losses, skipped = 0, time.perf_counter(), [], []
    for step in range(train.steps):
        # One draw of N·B·W sequences, the same on every rank: single process consumes it as N groups of
        # B; rank r takes its B rows of each of the N global micro-batches (the same union, same order).
        idx, tgt = stream.next(E)
        mine = split_micro(idx, tgt, N) if world == 1 else shard(idx, tgt, N, rank, world)
        micro = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in mine]
        loss = trainer.train_step(micro).item()  # world > 1: the global batch's mean loss
        tokens_seen += int((tgt != IGNORE).sum()) if docs is not None else E * S  # valid tokens
        dt = time.perf_counter() - t0
        if trainer.last_skipped:  # no valid token in the window (or an fp16 inf/NaN): no update at all
            why = "no valid token in the window" if loss != loss else "inf/NaN in the fp16 window"
            skipped.append(step)
            if lead:
                print(f"step {step}: skipped ({why}): no update, schedule not advanced", file=out, flush=True)
        else:
            losses.append(loss)
        logged = trainer.metrics()  # every rank: under FSDP2 the norm's value is a collective
        if bar:
            shown = "skipped" if trainer.last_skipped else (
                f"loss {loss:.4f}  grad_norm {logged['grad_norm']:.3g}  lr {logged['lr']:.3g}")
            bar.update(step + 1, f"{shown}  {tokens_seen / dt:,.0f} tok/s")
    dt = time.perf_counter() - t0
    if lead:
        trail = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no step taken"
        skip = f" ({len(skipped)} skipped)" if skipped else ""
        print(f"done: {train.steps} steps{skip}, {tokens_seen:,} tokens in {dt:.2f}s ({tokens_seen / dt:,.0f} tok/s), "
              f"{trail}", file=out, flush=True)
    return losses


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args)
    env = torchrun_env()  # (rank, world, local_rank) under torchrun
    rank, world, _ = env or (0, 1, 0)
    # Bad input: EVERY rank prints its one line and exits 2 (torchrun stops the others as soon as one
    # exits, so "rank 0 alone prints" could print nothing).
    try:
        model_cfg, train, optim, device = build(args, env)
    except (UsageError, ValueError) as e:  # config __post_init__ errors name the field
        fail(str(e))
    apply_threads(args)
    if world > 1:
        import torch
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # env:// rendezvous from torchrun
    try:
        run(model_cfg, train, optim, device, data=args.data, rank=rank, world=world, impl=args.ddp_impl,
            docs=args.docs)
    except UsageError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    if world > 1:
        # gloo sometimes aborts at teardown ("terminate called without an active exception": 4 of 65 runs
        # without this, 0 of 60 with it) unless every rank is done first and the interpreter does not
        # tear the group down again.
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
