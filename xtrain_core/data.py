"""A deterministic token source.

One RNG stream draws sequences one at a time, in order. `next(n)` returns the next n sequences, so the
accumulation run (N calls of B, or one call of N·B split into N groups) and the big-batch run (one call
of N·B) see identical sequences in identical order: the union of the micro-batches IS the big batch.
The stream uses Python's `random.Random` per sequence, whose output does not depend on how many
sequences a call asks for (a vectorised torch.randint draw of (N·B, S) carries no such promise).
"""
from __future__ import annotations

import os
import random

import torch


class TokenStream:
    """Sequences of S+1 tokens; `next(n)` -> (idx, targets), each (n, S) int64 on CPU.

    data=None: the embedded synthetic stream (no download). Sequence k is an arithmetic progression
    a, a+d, a+2d, ... (mod vocab) with a, d drawn from the seeded stream: learnable (the model must
    infer d from context), so loss falls visibly in a short run.
    data=PATH: a UTF-8 text file read as byte tokens (vocab 256); each sequence is a window at an
    offset drawn from the seeded stream.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, data: str | os.PathLike | None = None):
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self._rng = random.Random(seed)
        self._corpus = None
        if data is not None:
            raw = open(data, "rb").read()  # FileNotFoundError is the caller's to word
            if vocab_size < 256:
                raise ValueError(f"byte-level data needs model.vocab_size ≥ 256, got {vocab_size}")
            if len(raw) < seq_len + 2:
                raise ValueError(f"data file {data} has {len(raw)} bytes; seq_len {seq_len} needs at least {seq_len + 2}")
            self._corpus = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self._ramp = torch.arange(seq_len + 1)

    def _one(self) -> torch.Tensor:
        if self._corpus is None:
            a = self._rng.randrange(self.vocab_size)
            d = self._rng.randrange(1, max(2, min(8, self.vocab_size)))
            return (a + d * self._ramp) % self.vocab_size
        off = self._rng.randrange(len(self._corpus) - self.seq_len - 1)
        return self._corpus[off: off + self.seq_len + 1]

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = torch.stack([self._one() for _ in range(n)])  # (n, S+1)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def split_micro(idx: torch.Tensor, targets: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(N·B, S) -> N micro-batches of (B, S), in order."""
    if idx.shape[0] % n:
        raise ValueError(f"batch of {idx.shape[0]} sequences does not split into {n} equal micro-batches")
    return list(zip(idx.chunk(n), targets.chunk(n)))
