"""Built-in batch makers for adapters: `data(rows, seed) -> (inputs, targets)`, CPU tensors, rows first.

The harness calls one once per optimizer step for the whole (global) batch and splits the rows itself,
so a maker only has to be a pure function of (rows, seed). Floating tensors are made in float64 and
cast by the harness to each run's dtype (the float64 reference sees the same numbers, unrounded).
"""
from __future__ import annotations

import torch

__all__ = ["tokens", "regression", "classification"]


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
