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

from .model import IGNORE


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


class DocStream:
    """Documents, one per non-empty line of a UTF-8 text file, each one sequence of byte tokens: inputs
    doc[:-1], targets doc[1:], truncated to S and right-padded (inputs 0, targets IGNORE = -100, so a
    one-byte document has no valid target at all). `next(n)` -> (idx, targets), each (n, S) int64, in a
    seeded shuffled order, epoch after epoch; like TokenStream, next(N·B) == N calls of next(B)."""

    def __init__(self, path: str | os.PathLike, seq_len: int, seed: int = 0):
        self.seq_len = seq_len
        text = open(path, "rb").read().decode("utf-8")  # UnicodeDecodeError / OSError: the caller's to word
        self.docs = [line.encode("utf-8") for line in text.splitlines() if line.strip()]
        if not self.docs:
            raise ValueError(f"{path} holds no non-empty line (one document per line)")
        self._rng = random.Random(seed)
        self._order: list[int] = []

    def _one(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._order:
            self._order = list(range(len(self.docs)))
            self._rng.shuffle(self._order)
            self._order.reverse()  # pop() from the end = the shuffled order from the start
        doc = torch.frombuffer(bytearray(self.docs[self._order.pop()]), dtype=torch.uint8).long()
        n = min(len(doc) - 1, self.seq_len)  # valid targets
        x = torch.zeros(self.seq_len, dtype=torch.long)
        y = torch.full((self.seq_len,), IGNORE, dtype=torch.long)
        if n > 0:
            x[:n], y[:n] = doc[:n], doc[1:n + 1]
        return x, y

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(self._one() for _ in range(n)))
        return torch.stack(xs), torch.stack(ys)


class Windows:
    """Micro-batches grouped into accumulation windows of exactly N. A window is never stepped short: a
    tail of fewer than N micro-batches (data that ends mid-window) is dropped — 1/N over fewer than N
    micro-steps would weigh them wrongly — and counted in `.dropped` once iteration ends."""

    def __init__(self, micro_batches, accum_steps: int):
        self.source, self.accum_steps, self.dropped = micro_batches, accum_steps, 0

    def __iter__(self):
        window = []
        for mb in self.source:
            window.append(mb)
            if len(window) == self.accum_steps:
                yield window
                window = []
        self.dropped = len(window)


def split_micro(idx: torch.Tensor, targets: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(N·B, S) -> N micro-batches of (B, S), in order."""
    if idx.shape[0] % n:
        raise ValueError(f"batch of {idx.shape[0]} sequences does not split into {n} equal micro-batches")
    return list(zip(idx.chunk(n), targets.chunk(n)))
