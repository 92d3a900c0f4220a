"""hypothesis strategies of xtrain's adapter options, offered to the harness through the adapter's `options`
hook (xtrain_proof/adapters.py), as any adapter offers its own. Each shrinks toward the smallest GPT and
the first optimizer settings, so a failure is reported at its simplest.

    model_configs()     a small GPT: layers, heads, head width, vocabulary
    optim_configs()     AdamW settings with clipping and warm-up
    xtrain_options()    both, and a sequence length S ≤ max_seq: an XtrainOptions
"""
from __future__ import annotations

from hypothesis import strategies as st

from xtrain_core.config import ModelConfig, OptimConfig

from xtrain_proof.options import XtrainOptions

__all__ = ["model_configs", "optim_configs", "xtrain_options"]


@st.composite
def model_configs(draw, *, max_layers: int = 2, max_heads: int = 2, head_dims=(4, 8, 16),
                  min_vocab: int = 8, max_vocab: int = 96, seq_len: int = 32) -> ModelConfig:
    h = draw(st.integers(1, max_heads))
    return ModelConfig(vocab_size=draw(st.integers(min_vocab, max_vocab)), seq_len=seq_len,
                       n_layer=draw(st.integers(1, max_layers)), n_head=h, d_model=h * draw(st.sampled_from(head_dims)))


@st.composite
def optim_configs(draw, *, max_warmup: int = 3) -> OptimConfig:
    return OptimConfig(
        lr=draw(st.sampled_from([1e-3, 3e-4, 1e-2])),
        weight_decay=draw(st.sampled_from([0.0, 0.1])),
        max_grad_norm=draw(st.sampled_from([1.0, None, 0.05])),
        warmup_steps=draw(st.integers(0, max_warmup)),
    )


@st.composite
def xtrain_options(draw, *, max_seq: int = 24, model=None, optim=None, loss_norm: str = "mean"):
    """xtrain's knobs: a small GPT, a sequence length S ≤ max_seq, AdamW settings with clip and warm-up."""
    m = draw(model if model is not None else model_configs(seq_len=max_seq))
    return XtrainOptions(model=m, seq_len=draw(st.integers(1, min(max_seq, m.seq_len))),
                         optim=draw(optim if optim is not None else optim_configs()), loss_norm=loss_norm)
