"""Built-in batch makers for adapters: `data(rows, seed) -> (inputs, targets)`, CPU tensors, rows first.

The harness calls one once per optimizer step for the whole (global) batch and splits the rows itself,
so a maker only has to be a pure function of (rows, seed). Floating tensors are made in float64 and
cast by the harness to each run's dtype (the float64 reference sees the same numbers, unrounded).
"""
from __future__ import annotations

import torch

__all__ = ["tokens", "causal_lm", "shifted_labels", "regression", "classification", "overflow_rows"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def tokens(*, vocab: int, seq_len: int):
    """Language modelling: inputs (rows, seq_len) int64 token ids in [0, vocab), targets = the next token."""
    if vocab < 2 or seq_len < 1:
        raise ValueError(f"tokens needs vocab ≥ 2 and seq_len ≥ 1, got {vocab} and {seq_len}")

    def make(rows: int, seed: int):
        seq = torch.randint(0, vocab, (rows, seq_len + 1), generator=_gen(seed))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    return make


def causal_lm(*, vocab: int, seq_len: int):
    """For models that shift their labels internally (Hugging Face causal LMs): inputs (rows, seq_len + 1)
    token ids, targets (rows, seq_len) = inputs[:, 1:], every entry a real prediction target. The harness
    pads and counts valid targets on these; hand the model `shifted_labels(targets)` as its labels."""
    make_tokens = tokens(vocab=vocab, seq_len=seq_len)

    def make(rows: int, seed: int):
        x, y = make_tokens(rows, seed)
        return torch.cat([x, y[:, -1:]], dim=1), y

    return make


def shifted_labels(targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF-style labels from `causal_lm` targets: position 0 (which nothing predicts) is `ignore_index`, so
    the model's internal shift (logits[:, :-1] against labels[:, 1:]) sees exactly `targets`, and the
    number of valid labels it counts (HF's num_items_in_batch) is the harness's count of valid targets."""
    return torch.nn.functional.pad(targets, (1, 0), value=ignore_index)


def regression(*, features: int, outputs: int = 1, noise: float = 0.1):
    """inputs (rows, features) ~ N(0, 1), targets (rows, outputs) = a fixed random linear map of a
    tanh of the inputs plus noise: learnable by an MLP, float64."""

    def make(rows: int, seed: int):
        g = _gen(seed)
        w = torch.randn(features, outputs, generator=_gen(12345), dtype=torch.float64)  # the task: fixed
        x = torch.randn(rows, features, generator=g, dtype=torch.float64)
        y = torch.tanh(x) @ w + noise * torch.randn(rows, outputs, generator=g, dtype=torch.float64)
        return x, y

    return make


def classification(*, features: int, classes: int):
    """inputs (rows, features) float64, targets (rows,) int64 class ids in [0, classes)."""

    def make(rows: int, seed: int):
        g = _gen(seed)
        x = torch.randn(rows, features, generator=g, dtype=torch.float64)
        return x, torch.randint(0, classes, (rows,), generator=g)

    return make


OVERFLOW_FACTOR = 2.0**20  # a power of two: N(0, 1) inputs become ~1e6 > fp16's 65504 (inf once autocast casts them)


def overflow_rows(trainer, inputs: torch.Tensor, targets: torch.Tensor, rows: slice):
    """An overflow hook for floating inputs (Adapter(overflow=verify.data.overflow_rows)): `rows` of the
    micro-batch scaled by 2^20, so the fp16 forward of those rows holds an inf (the trainer is not touched).
    New tensors. Not the default: a normalising first layer undoes the scale, the harness's injection into
    the backward (verify._internal.gates.overflow.BackwardInf) cannot be undone."""
    if not inputs.is_floating_point():
        raise ValueError("overflow_rows scales floating inputs; leave Adapter(overflow=None) for token data: the "
                         "harness then injects the overflow into the backward")
    x = inputs.clone()
    x[rows] *= OVERFLOW_FACTOR
    return x, targets
