"""A deterministic token source.

One RNG stream draws sequences one at a time, in order. `next(n)` returns the next n sequences, so the
accumulation run (N calls of B, or one call of N·B split into N groups) and the big-batch run (one call
of N·B) see identical sequences in identical order: the union of the micro-batches IS the big batch.
The stream uses Python's `random.Random` per sequence, whose output does not depend on how many
sequences a call asks for (a vectorised torch.randint draw of (N·B, S) carries no such promise).
"""
from __future__ import annotations

import codecs
import mmap
import os
import random
from array import array

import torch

from .model import IGNORE


class TokenStream:
    """Sequences of S+1 tokens; `next(n)` -> (idx, targets), each (n, S) int64 on CPU.

    data=None: the embedded synthetic stream (no download). Sequence k is an arithmetic progression
    a, a+d, a+2d, ... (mod vocab) with a, d drawn from the seeded stream: learnable (the model must
    infer d from context), so loss falls visibly in a short run.
    data=PATH: a UTF-8 text file read as byte tokens (vocab 256); each sequence is a window at an
    offset drawn from the seeded stream. The file is memory-mapped, never read whole: a step touches the
    pages of its windows only, so a file of any size trains in the memory of its batches.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, data: str | os.PathLike | None = None):
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self._rng = random.Random(seed)
        self._corpus = None
        if data is not None:
            if vocab_size < 256:
                raise ValueError(f"byte-level data needs model.vocab_size ≥ 256, got {vocab_size}")
            size = os.path.getsize(data)  # FileNotFoundError is the caller's to word
            if size < seq_len + 2:
                raise ValueError(f"data file {data} has {size} bytes; seq_len {seq_len} needs at least {seq_len + 2}")
            self._corpus = _mapped(data)
        self._ramp = torch.arange(seq_len + 1)

    def _one(self) -> torch.Tensor:
        if self._corpus is None:
            a = self._rng.randrange(self.vocab_size)
            d = self._rng.randrange(1, max(2, min(8, self.vocab_size)))
            return (a + d * self._ramp) % self.vocab_size
        off = self._rng.randrange(len(self._corpus) - self.seq_len - 1)
        return _tokens(self._corpus[off: off + self.seq_len + 1])

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = torch.stack([self._one() for _ in range(n)])  # (n, S+1)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


class DocStream:
    """Documents, one per non-empty line of a UTF-8 text file, each one sequence of byte tokens: inputs
    doc[:-1], targets doc[1:], truncated to S and right-padded (inputs 0, targets IGNORE = -100, so a
    one-byte document has no valid target at all). `next(n)` -> (idx, targets), each (n, S) int64, in a
    seeded shuffled order, epoch after epoch; like TokenStream, next(N·B) == N calls of next(B).
    Lines are those of str.splitlines() on the decoded text; the file is indexed in chunks (each document's
    byte offset and length) and memory-mapped, so it is never held whole."""

    def __init__(self, path: str | os.PathLike, seq_len: int, seed: int = 0):
        self.seq_len = seq_len
        self._starts, self._lengths = _index_lines(path)  # UnicodeDecodeError / OSError: the caller's to word
        if not self._starts:
            raise ValueError(f"{path} holds no non-empty line (one document per line)")
        self._map = _mapped(path)
        self._rng = random.Random(seed)
        self._order: list[int] = []

    @property
    def docs(self) -> list[bytes]:
        """Every document's bytes (reads them all: for tests and small files)."""
        return [self._map[s: s + n] for s, n in zip(self._starts, self._lengths)]

    def _one(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._order:
            self._order = list(range(len(self._starts)))
            self._rng.shuffle(self._order)
            self._order.reverse()  # pop() from the end = the shuffled order from the start
        i = self._order.pop()
        start, length = self._starts[i], min(self._lengths[i], self.seq_len + 1)  # only the bytes a row can use
        doc = _tokens(self._map[start: start + length])
        n = min(len(doc) - 1, self.seq_len)  # valid targets
        x = torch.zeros(self.seq_len, dtype=torch.long)
        y = torch.full((self.seq_len,), IGNORE, dtype=torch.long)
        if n > 0:
            x[:n], y[:n] = doc[:n], doc[1:n + 1]
        return x, y

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(self._one() for _ in range(n)))
        return torch.stack(xs), torch.stack(ys)


def _mapped(path) -> mmap.mmap:
    """The file, read-only and memory-mapped (pages are read as windows touch them; the OS may drop them)."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _tokens(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def _index_lines(path, chunk: int = 1 << 20) -> tuple[array, array]:
    """(byte offset, byte length) of every line of the UTF-8 file that holds more than whitespace, the lines
    being those of text.splitlines() (\\n, \\r\\n, \\r, \\x0b, \\x85, \\u2028, ...). Read `chunk` bytes at a
    time, so memory is the index (16 bytes a document), not the text. A line may span chunks: its start,
    length and whether it has seen a non-space character carry over; a "\\r\\n" split between two chunks
    reads as a line end then an empty line, which holds no document either way."""
    starts, lengths = array("q"), array("q")
    decoder = codecs.getincrementaldecoder("utf-8")()
    start = pos = 0  # byte offsets: the current line's start, and where the next piece begins
    content = False
    with open(path, "rb") as f:
        while True:
            raw = f.read(chunk)
            text = decoder.decode(raw, final=not raw)
            for piece in text.splitlines(keepends=True):
                body = piece.splitlines()[0]  # without its line end, if it has one
                size = len(piece.encode("utf-8"))
                content = content or bool(body.strip())
                if body != piece:  # the piece ends its line
                    if content:
                        starts.append(start)
                        lengths.append(pos - start + len(body.encode("utf-8")))
                    start, content = pos + size, False
                pos += size
            if not raw:
                break
    if content:  # the last line, without a line end
        starts.append(start)
        lengths.append(pos - start)
    return starts, lengths


class FullWindows:
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
