"""hypothesis strategies for the gates. Bounds are keyword-only; everything shrinks toward the smallest
case (N=1, B=1, K=1, world 1, the adapter's smallest options), so a failure is reported at its simplest.

    cases(adapter)                      (N, B, K, seeds, the adapter's drawn options), world 1
    dist_cases(adapter, max_world=4)    the same plus a world size W; B is then per rank
    xtrain_options()                    xtrain's adapter knobs: GPT size, sequence length, optimizer
"""
from __future__ import annotations

import os

from hypothesis import strategies as st

from xtrain_core.config import ModelConfig, OptimConfig

from .case import Case

__all__ = ["cases", "dist_cases", "model_configs", "optim_configs", "xtrain_options", "gate_device"]


def gate_device() -> str:
    """--verify-device / XTRAIN_TEST_DEVICE: cuda runs the gates on the GPU; default cpu."""
    return os.environ.get("XTRAIN_TEST_DEVICE", "cpu")


def _options_strategy(adapter):
    opts = adapter.options
    if opts is None:
        return st.none() if adapter.defaults is None else st.just(adapter.defaults)
    if isinstance(opts, st.SearchStrategy):
        return opts
    return opts()  # a zero-argument callable (keeps hypothesis out of the adapter's import)


@st.composite
def cases(draw, adapter, *, min_accum: int = 1, max_accum: int = 8, max_micro_batch: int = 4,
          min_steps: int = 1, max_steps: int = 3, device: str | None = None) -> Case:
    """(N, B, K, seeds, options) for `adapter` at world 1. N shrinks to min_accum, the rest to their minimum."""
    return Case(
        accum_steps=draw(st.integers(min_accum, max_accum)),
        micro_batch=draw(st.integers(1, max_micro_batch)),
        steps=draw(st.integers(min_steps, max_steps)),
        options=draw(_options_strategy(adapter)),
        seed=draw(st.integers(0, 2**16)),
        data_seed=draw(st.integers(0, 2**16)),
        device=device or gate_device(),
    )


@st.composite
def dist_cases(draw, adapter, *, min_world: int = 1, max_world: int = 4, **bounds) -> Case:
    """`cases(adapter, **bounds)` plus a world size W (shrinks toward min_world: a failure is reported at
    the smallest world that shows it); micro_batch is then B per rank."""
    world = draw(st.integers(min_world, max_world))
    return draw(cases(adapter, **bounds)).replace(world=world)


# -- xtrain's adapter ----------------------------------------------------------------------------------

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
def xtrain_options(draw, *, max_seq: int = 24, model=None, optim=None):
    """xtrain's knobs: a small GPT, a sequence length S ≤ max_seq, AdamW settings with clip and warm-up."""
    from .adapters.xtrain import XtrainOptions

    m = draw(model if model is not None else model_configs(seq_len=max_seq))
    return XtrainOptions(model=m, seq_len=draw(st.integers(1, min(max_seq, m.seq_len))),
                         optim=draw(optim if optim is not None else optim_configs()))
