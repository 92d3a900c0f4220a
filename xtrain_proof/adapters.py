"""xtrain's trainers as adapters: the default `--verify-trainer` (xtrain_proof.adapters:adapter).

    adapter     AccumTrainer in one process, DistAccumTrainer (boundary all-reduce of a flat buffer)
                when a process group of world > 1 exists; plain step declared (bit-exact gate runs)
    torch_ddp   xtrain's model and AdamW under torch DistributedDataParallel with no_sync()

Options (XtrainOptions, drawn per case through the `options` hook by xtrain_strategies.xtrain_options): the
GPT's size, the sequence length and the optimizer settings (lr, weight decay, clipping, warm-up). Data:
xtrain's own TokenStream.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from xtrain_core.config import OptimConfig
from xtrain_core.data import TokenStream
from xtrain_core.model import IGNORE, build_model

from verify import DDP_EXPECTED, Adapter, CountRow, Metrics, Parity, Spec
from xtrain_proof.memory import predicted_peak as peak
from xtrain_proof.memory_preset import PRESET
from xtrain_proof.options import XtrainOptions, checkpointed, unclipped

__all__ = ["XtrainOptions", "overflow_grad", "adapter", "tokens_adapter", "torch_ddp", "torch_ddp_tokens", "fsdp2", "fsdp2_keep",
           "fsdp2_tokens", "single", "data_parallel"]


def options_of(spec: Spec) -> XtrainOptions:
    return spec.options if spec.options is not None else XtrainOptions()


def model_for(spec: Spec):
    return build_model(options_of(spec).model, spec.seed, dtype=spec.dtype, device=spec.device)


def tokens(rows: int, seed: int, options) -> tuple[torch.Tensor, torch.Tensor]:
    o = options if options is not None else XtrainOptions()
    return TokenStream(o.model.vocab_size, o.seq_len, seed=seed).next(rows)


def _strategy():  # the `options` hook: a zero-argument callable keeps hypothesis out of this import
    from xtrain_proof.strategies import xtrain_options

    return xtrain_options()


def _token_strategy():
    from xtrain_proof.strategies import xtrain_options

    return xtrain_options(loss_norm="tokens")


# fp16 under the gates: the GradScaler starts at 2^10, not torch's 2^16. Drawn micro-batches can be one token,
# whose logit gradient (up to 1, times W on a rank before DP's /W) would overflow fp16 at 2^16 where the big
# batch's does not: a skipped first step in one run and not the other, which is loss scaling, not accumulation.
INIT_SCALE = 2.0**10


def overflow_grad(trainer, inputs, targets, rows):
    """xtrain's overflow hook (token ids cannot be scaled into an fp16 overflow): arms a one-shot gradient
    hook on the model's first parameter that turns one element of the NEXT backward's gradient into inf,
    inside autograd, as an fp16 overflow in the backward would (before anything the trainer does after
    backward: accumulation, the bucket all-reduce, its own finiteness check). The batch is unchanged."""
    while not hasattr(trainer, "model") and hasattr(trainer, "inner"):
        trainer = trainer.inner  # the self-test's wrappers
    p = next(trainer.model.parameters())

    def fire(g):
        handle.remove()
        g = g.clone()
        g.view(-1)[0] = float("inf")
        return g

    handle = p.register_hook(fire)
    return inputs, targets


def numerics(spec: Spec) -> dict:
    return dict(loss_norm=options_of(spec).loss_norm, precision=spec.precision, init_scale=INIT_SCALE)


def _grouped(spec: Spec) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(spec.group) > 1


# -- factories -------------------------------------------------------------------------------------------

def single_factory(spec: Spec):
    from xtrain_core.trainer import AccumTrainer

    return AccumTrainer(model_for(spec), options_of(spec).optim, spec.accum_steps, **numerics(spec))


def dist_factory(spec: Spec):
    from xtrain_core.distributed import DistAccumTrainer

    return DistAccumTrainer(model_for(spec), options_of(spec).optim, spec.accum_steps, group=spec.group,
                            **numerics(spec))


def factory(spec: Spec):
    """AccumTrainer alone; DistAccumTrainer in a process group of world > 1 (spec.group's, or the default's)."""
    return dist_factory(spec) if _grouped(spec) else single_factory(spec)


def torch_ddp_factory(spec: Spec):
    from xtrain_core.distributed import TorchDDPTrainer

    return TorchDDPTrainer(model_for(spec), options_of(spec).optim, spec.accum_steps, group=spec.group,
                           **numerics(spec))


def fsdp2_factory(spec: Spec, reshard_after_forward: bool = True):
    from xtrain_core.fsdp import FSDP2Trainer

    return FSDP2Trainer(model_for(spec), options_of(spec).optim, spec.accum_steps,
                        reshard_after_forward=reshard_after_forward, **numerics(spec))


def fsdp2_keep_factory(spec: Spec):
    return fsdp2_factory(spec, reshard_after_forward=False)


def fsdp2_row(case, reshard_after_forward: bool = True):
    """FSDP2's count table row for this case: U units (the blocks + the root); per micro-step each unit
    all-gathers its parameters for the forward and, resharded after it, again for the backward; at the
    boundary each unit reduces its gradient once (reduce_scatter: on gloo torch runs it as an all-reduce, which the
    counter reads the row's reduce_scatter as) and clipping all-reduces the per-parameter norms. Reductions carry the padded gradient once (FSDP2
    pads each parameter's dim 0 to a multiple of W) plus those norms."""
    import math

    o = options_of(case.spec())
    U, W = o.model.n_layer + 1, case.world
    gathers = U * (2 if reshard_after_forward else 1)
    model = build_model(o.model, 0)
    shapes = [p.shape for p in model.parameters()]
    P = sum(math.prod(s) for s in shapes)
    padded = sum(math.ceil(s[0] / W) * W * math.prod(s[1:]) for s in shapes)
    clip = len(shapes) if o.optim.max_grad_norm is not None else 0
    boundary = {"all_gather": gathers, "reduce_scatter": U, **({"all_reduce": 1} if clip else {})}
    mode = f"FSDP2, {'reshard' if reshard_after_forward else 'keep'} after forward, {U} units"
    # a step without a valid token (loss_norm="tokens") is skipped whole: no clipping, so no norm all-reduce
    return CountRow(mode=mode, before={"all_gather": gathers}, boundary=boundary, elements=(P, padded + clip),
                    skipped={"all_reduce": 1} if clip else {})


def fsdp2_keep_row(case):
    return fsdp2_row(case, reshard_after_forward=False)


class PlainTrainer:
    """The textbook no-accumulation step, written here apart from xtrain's trainer: loss.backward();
    clip; AdamW; LR schedule; zero_grad. What accum_steps=1 must be, bit for bit. Under bf16 the forward
    runs in autocast; under fp16 also with a GradScaler (scaled backward, unscale, clip, scaler.step,
    update; a step the scaler skips does not advance the schedule). With loss_norm="tokens" a batch
    without a valid target is no step at all."""

    def __init__(self, spec: Spec):
        self.model, o = model_for(spec), options_of(spec).optim
        self.cfg, self.tokens = o, options_of(spec).loss_norm == "tokens"
        fused = o.fused if o.fused is not None else spec.device.startswith("cuda")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                     weight_decay=o.weight_decay, fused=fused or None)
        w = o.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / w) if w else 1.0)
        dev = torch.device(spec.device).type
        self.amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision)
        self.autocast = (lambda: torch.autocast(dev, dtype=self.amp)) if self.amp else None
        self.scaler = torch.amp.GradScaler(dev, init_scale=INIT_SCALE) if spec.precision == "fp16" else None
        self._loss, self._empty = None, False

    def micro_step(self, idx, targets, micro):
        if micro != 0:
            raise RuntimeError(f"the plain step runs one micro-step per optimizer step, got micro={micro}")
        if self.autocast is not None:
            with self.autocast():
                loss = self.model.loss_batched(idx, targets)
        else:
            loss = self.model.loss_batched(idx, targets)
        self._empty = self.tokens and int((targets != IGNORE).sum()) == 0
        self._loss = loss.detach()
        if not self._empty:
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        if self._empty:
            return torch.full_like(self._loss, float("nan"))
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            if self.scaler.get_scale() >= scale:
                self.sched.step()
        else:
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return self._loss

    def params(self):
        return {k: p.detach() for k, p in self.model.named_parameters()}


def variant(cls, base: Adapter) -> Adapter:
    """`base` with its trainer replaced by `cls(model, optim, accum_steps, **numerics)` (xtrain's trainer
    signature): how the planted bugs of broken*.py become adapters. The factory claims `cls`'s module,
    where the adapter must be a module-level name (pools import it from there). A base that declares subgroups
    hands spec.group on (only data-parallel runs in a launched sub-world get one: xtrain's group= there)."""

    def make(spec: Spec):
        group = {} if spec.group is None else dict(group=spec.group)
        return cls(model_for(spec), options_of(spec).optim, spec.accum_steps, **group, **numerics(spec))

    make.__module__, make.__name__ = cls.__module__, f"make_{cls.__name__}"
    make.__qualname__ = make.__name__
    return base.replace(factory=make, name=f"broken: {cls.__name__}")


def max_norm(options) -> float | None:
    """The clip threshold of a case (Metrics.max_norm): xtrain clips at optim.max_grad_norm (None: never)."""
    return (options if options is not None else XtrainOptions()).optim.max_grad_norm


# what xtrain's trainers log per step (AccumTrainer.metrics): the window's rows (mean) or valid tokens (tokens)
METRICS = Metrics(names=("loss", "grad_norm", "clip_coef", "lr", "rows"), max_norm=max_norm)
TOKEN_METRICS = Metrics(names=("loss", "grad_norm", "clip_coef", "lr", "tokens"), max_norm=max_norm)

# the self-test's and the corners' options: a 2-step warm-up, so the LR moves between the steps of a case
DEFAULTS = XtrainOptions(optim=OptimConfig(warmup_steps=2))

_COMMON = dict(data=tokens, options=_strategy, defaults=DEFAULTS, precisions=("fp32", "bf16", "fp16"),
               overflow=overflow_grad, unclipped=unclipped, metrics=METRICS)
_TOKENS = dict(options=_token_strategy, defaults=XtrainOptions(optim=OptimConfig(warmup_steps=2), loss_norm="tokens"),
               metrics=TOKEN_METRICS)

# subgroups: DistAccumTrainer and TorchDDPTrainer take group=; FSDP2Trainer shards over the default group only
# parity: ModelConfig.checkpoint recomputes each block in the backward, the same numbers bit for bit
CHECKPOINTING = Parity(name="activation checkpointing", apply=checkpointed)
adapter = Adapter(factory=factory, plain=PlainTrainer, data_parallel=True, name="xtrain", predicted_peak=peak(None),
                  subgroups=True, memory_preset=PRESET, parity=CHECKPOINTING, **_COMMON)
tokens_adapter = Adapter(factory=factory, plain=PlainTrainer, data_parallel=True, ignore_index=IGNORE, subgroups=True,
                         name="xtrain, loss_norm=tokens", predicted_peak=peak(None), parity=CHECKPOINTING,
                         **{**_COMMON, **_TOKENS})
torch_ddp = Adapter(factory=torch_ddp_factory, process_group=True, expected=DDP_EXPECTED, subgroups=True,
                    name="xtrain model under torch DDP no_sync()", predicted_peak=peak("torch_ddp"), **_COMMON)
torch_ddp_tokens = Adapter(factory=torch_ddp_factory, process_group=True, expected=DDP_EXPECTED, ignore_index=IGNORE,
                           subgroups=True,
                           name="xtrain model under torch DDP no_sync(), loss_norm=tokens", predicted_peak=peak("torch_ddp"),
                           **{**_COMMON, **_TOKENS})
fsdp2 = Adapter(factory=fsdp2_factory, process_group=True, counts=fsdp2_row, name="xtrain model under FSDP2",
                predicted_peak=peak("fsdp2"),
                **{**_COMMON, "precisions": ("fp32", "bf16")})
fsdp2_keep = Adapter(factory=fsdp2_keep_factory, process_group=True, counts=fsdp2_keep_row,
                     name="xtrain model under FSDP2, no reshard after forward", predicted_peak=peak("fsdp2_keep"),
                     **{**_COMMON, "precisions": ("fp32", "bf16")})
fsdp2_tokens = Adapter(factory=fsdp2_factory, process_group=True, counts=fsdp2_row, ignore_index=IGNORE,
                       name="xtrain model under FSDP2, loss_norm=tokens", predicted_peak=peak("fsdp2"),
                       **{**_COMMON, **_TOKENS, "precisions": ("fp32", "bf16")})
single = Adapter(factory=single_factory, plain=PlainTrainer, name="xtrain AccumTrainer", predicted_peak=peak("single"),
                 **_COMMON)
data_parallel = Adapter(factory=dist_factory, data_parallel=True, subgroups=True, name="xtrain DistAccumTrainer",
                        predicted_peak=peak("xtrain"), **_COMMON)

