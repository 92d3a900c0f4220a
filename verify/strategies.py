"""hypothesis strategies for the gates. Bounds are keyword-only; everything shrinks toward the
smallest case (N=1, B=1, S=1, one layer, one head, K=1), so a failure is reported at its simplest.
"""
from __future__ import annotations

import os

from hypothesis import strategies as st

from xtrain_core.config import ModelConfig, OptimConfig

from .interface import Case


@st.composite
def model_configs(draw, *, max_layers: int = 2, max_heads: int = 2, head_dims=(4, 8, 16),
                  min_vocab: int = 8, max_vocab: int = 96, seq_len: int = 32) -> ModelConfig:
    h = draw(st.integers(1, max_heads))
    return ModelConfig(
        vocab_size=draw(st.integers(min_vocab, max_vocab)),
        seq_len=seq_len,
        n_layer=draw(st.integers(1, max_layers)),
        n_head=h,
        d_model=h * draw(st.sampled_from(head_dims)),
    )


@st.composite
def optim_configs(draw, *, max_warmup: int = 3) -> OptimConfig:
    return OptimConfig(
        lr=draw(st.sampled_from([1e-3, 3e-4, 1e-2])),
        weight_decay=draw(st.sampled_from([0.0, 0.1])),
        max_grad_norm=draw(st.sampled_from([1.0, None, 0.05])),
        warmup_steps=draw(st.integers(0, max_warmup)),
    )


@st.composite
def cases(draw, *, min_accum: int = 1, max_accum: int = 8, max_micro_batch: int = 4,
          max_seq: int = 24, max_steps: int = 3, model=None, device: str | None = None) -> Case:
    """(N, B, S, K, model, optimizer, seeds). N shrinks to min_accum, the rest to 1 / the first choice."""
    m = draw(model if model is not None else model_configs(seq_len=max_seq))
    return Case(
        accum_steps=draw(st.integers(min_accum, max_accum)),
        micro_batch=draw(st.integers(1, max_micro_batch)),
        seq_len=draw(st.integers(1, min(max_seq, m.seq_len))),
        steps=draw(st.integers(1, max_steps)),
        model=m,
        optim=draw(optim_configs()),
        seed=draw(st.integers(0, 2**16)),
        data_seed=draw(st.integers(0, 2**16)),
        device=device or gate_device(),
    )


def gate_device() -> str:
    """XTRAIN_TEST_DEVICE=cuda runs the gates on the GPU (the gpu profile's CI gate); default cpu."""
    return os.environ.get("XTRAIN_TEST_DEVICE", "cpu")


@st.composite
def dist_cases(draw, *, min_world: int = 1, max_world: int = 4, min_accum: int = 1, max_accum: int = 8,
               max_micro_batch: int = 4, max_seq: int = 24, max_steps: int = 3, model=None) -> Case:
    """A data-parallel case: `cases(...)` plus a world size W; micro_batch is then B_local (per rank).
    W shrinks toward min_world, so a failure is reported at the smallest world that shows it."""
    import dataclasses

    world = draw(st.integers(min_world, max_world))
    case = draw(cases(min_accum=min_accum, max_accum=max_accum, max_micro_batch=max_micro_batch,
                      max_seq=max_seq, max_steps=max_steps, model=model))
    return dataclasses.replace(case, world=world)
