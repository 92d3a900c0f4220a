"""xtrain's adapter options: what a case draws for xtrain's trainers (the GPT's size, the sequence length, the
optimizer settings, the loss normalisation). Apart from xtrain_proof/adapters.py so that its strategies
(xtrain_strategies.py, hypothesis) build these without importing the adapter, which offers them lazily."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from xtrain_core.config import PRESETS, ModelConfig, OptimConfig

__all__ = ["XtrainOptions"]


@dataclass(frozen=True, kw_only=True)
class XtrainOptions:
    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    seq_len: int = 16
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss_norm: str = "mean"

    def __post_init__(self):
        if not 1 <= self.seq_len <= self.model.seq_len:
            raise ValueError(f"seq_len must lie in [1, model.seq_len={self.model.seq_len}], got {self.seq_len}")

    def describe(self) -> str:
        m, o = self.model, self.optim
        norm = "" if self.loss_norm == "mean" else f" loss_norm={self.loss_norm}"
        return (f"S={self.seq_len} model(L={m.n_layer} h={m.n_head} d={m.d_model} V={m.vocab_size}) "
                f"optim(lr={o.lr:g} wd={o.weight_decay:g} clip={o.max_grad_norm} warmup={o.warmup_steps}){norm}")


def checkpointed(options, on: bool):
    """The same options with activation checkpointing on or off (Adapter.parity: the two must agree bit for bit)."""
    options = options if options is not None else XtrainOptions()
    return dataclasses.replace(options, model=dataclasses.replace(options.model, checkpoint=on))


def unclipped(options):
    """The same options with gradient clipping off (Adapter.unclipped: a failure's diagnosis re-runs it so)."""
    if options is None:
        return None
    return dataclasses.replace(options, optim=dataclasses.replace(options.optim, max_grad_norm=None))
