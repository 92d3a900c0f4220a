"""Configs: one frozen dataclass per concern, validated on construction.

Every error names the field and the offending value, so a CLI can print it as one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be ≥ 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT: token + position embedding, pre-LN causal self-attention blocks, MLP, LM head."""

    vocab_size: int = 256
    """Number of token ids; byte-level data needs 256."""
    seq_len: int = 64
    """Longest sequence the position embedding covers (the model's limit)."""
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    """Residual width; must be divisible by n_head."""
    checkpoint: bool = False
    """Recompute each block's activations in the backward (torch.utils.checkpoint): the memory of one block's
    input per layer instead of all its activations, for one more forward. The same numbers, bit for bit."""

    def __post_init__(self):
        for f in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            _positive_int("model", f, getattr(self, f))
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model must be divisible by model.n_head, got {self.d_model} and {self.n_head}"
            )

    @property
    def n_params(self) -> int:
        d, v, s, L = self.d_model, self.vocab_size, self.seq_len, self.n_layer
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return v * d + s * d + L * block + 2 * d + d * v


    def step_bytes_at_least(self, micro_batch: int, seq_len: int, precision: str = "fp32") -> int:
        """A LOWER bound on the bytes one micro-step of `micro_batch` sequences holds (a refusal on it is
        never a false one): the fp32 parameters, their gradients and AdamW's two moments (16 bytes an
        element), plus what the backward must keep: each block's input hidden state and the logits, in the
        autocast element size (the attention, MLP and softmax activations come on top)."""
        elem = 4 if precision == "fp32" else 2
        return 16 * self.n_params + elem * micro_batch * seq_len * (self.n_layer * self.d_model + self.vocab_size)


# Named sizes, from tests to the benchmark model (GPT-2-small-like: 12 layers, d 768, vocab 8192, seq 512),
# the model the plain-PyTorch reference numbers in reports/anchors were measured on.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64),
    "small": ModelConfig(vocab_size=256, seq_len=256, n_layer=4, n_head=4, d_model=256),
    "gpt2-ish": ModelConfig(vocab_size=8192, seq_len=512, n_layer=12, n_head=12, d_model=768),
}


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """torch.optim.AdamW, clip_grad_norm_ at the boundary, linear LR warm-up then constant."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    """Clip the boundary (mean) gradient to this global L2 norm; None disables clipping."""
    warmup_steps: int = 0
    """LR ramps linearly over this many *optimizer* steps (never micro-steps)."""
    fused: bool | None = None
    """AdamW's fused kernel; None: fused when the parameters are on CUDA (fastest there), else torch's default."""

    def __post_init__(self):
        if not (self.lr > 0 and self.lr != float("inf")):
            raise ValueError(f"optim.lr must be a finite number > 0, got {self.lr}")
        if not (0 <= self.betas[0] < 1 and 0 <= self.betas[1] < 1):
            raise ValueError(f"optim.betas must lie in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"optim.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be ≥ 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"optim.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be an integer ≥ 0, got {self.warmup_steps!r}")


# Sizes a run can ever meet (bigger ones could only run out of memory or time): checked before anything
# allocates, so an absurd flag is one line, not an OOM minutes later.
MAX_ACCUM_STEPS = 2**20
MAX_MICRO_BATCH = 2**16
MAX_STEPS = 10**9
MAX_EFFECTIVE_BATCH = 2**24  # sequences per optimizer step, over all ranks

class DDPImpl(StrEnum):
    """Data-parallel trainers under torchrun (--ddp-impl): xtrain's flat buffer, torch DDP no_sync, FSDP2."""
    XTRAIN = "xtrain"
    TORCH = "torch"
    FSDP2 = "fsdp2"


class LossNorm(StrEnum):
    """mean: CE mean per micro-batch × 1/N (exact for fixed-length data). tokens: Σ CE over valid tokens / the
    window's valid-token count, across micro-steps and ranks (exact for padded / variable-length data)."""
    MEAN = "mean"
    TOKENS = "tokens"


class Precision(StrEnum):
    """fp32; bf16 autocast; fp16 autocast with a GradScaler (parameters and gradients stay fp32)."""
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


# the values, for argparse choices and messages (a StrEnum member equals its value)
IMPLS = tuple(e.value for e in DDPImpl)
LOSS_NORMS = tuple(e.value for e in LossNorm)
PRECISIONS = tuple(e.value for e in Precision)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The accumulation schedule: one optimizer step = accum_steps micro-steps of micro_batch sequences."""

    accum_steps: int = 1
    """N: micro-steps per optimizer step. 1 is the plain, unscaled path."""
    micro_batch: int = 8
    """B: sequences per micro-step (per rank under data parallel)."""
    steps: int = 10
    """K: optimizer steps."""
    seq_len: int = 64
    """S: tokens per sequence; at most model.seq_len."""
    seed: int = 0
    loss_norm: LossNorm = LossNorm.MEAN
    """How the step's loss and gradient are normalized: see LossNorm (a plain string is taken)."""
    precision: Precision = Precision.FP32
    """See Precision (a plain string is taken)."""

    def __post_init__(self):
        for f in ("accum_steps", "micro_batch", "steps", "seq_len"):
            _positive_int("train", f, getattr(self, f))
        for f, hi in (("accum_steps", MAX_ACCUM_STEPS), ("micro_batch", MAX_MICRO_BATCH), ("steps", MAX_STEPS)):
            if getattr(self, f) > hi:
                raise ValueError(f"train.{f} must be ≤ {hi}, got {getattr(self, f)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"train.seed must be an integer in [0, 2^63), got {self.seed!r}")
        if self.loss_norm not in LOSS_NORMS:
            raise ValueError(f"train.loss_norm must be one of {', '.join(LOSS_NORMS)}, got {self.loss_norm!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        object.__setattr__(self, "loss_norm", LossNorm(self.loss_norm))
        object.__setattr__(self, "precision", Precision(self.precision))



def effective_batch(accum_steps: int, micro_batch: int, world: int = 1) -> int:
    """Sequences per optimizer step over all ranks: N × B × W (B is per rank). The one meaning of
    "effective batch" here; verify's Case.effective_batch is the same product."""
    return accum_steps * micro_batch * world
