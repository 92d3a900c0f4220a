"""A small GPT. Same architecture as the plain-PyTorch reference (benchmarks/plain_torch.py) so speed
and memory compare like for like: explicit (non-flash) attention, so activations scale like a textbook trainer, and no
registered buffers, so DistributedDataParallel has nothing to broadcast at forward.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig

IGNORE = -100  # target id of padding: not a token, no loss, not counted


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """x (B, T, C); masked (T, T) bool, True above the diagonal (future positions)."""
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.h)  # (B, nh, T, T)
        att = att.masked_fill(masked, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.tok, self.pos = nn.Embedding(cfg.vocab_size, d), nn.Embedding(cfg.seq_len, d)
        self.blocks = nn.ModuleList(Block(d, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab)."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len {self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, d)
        # The causal mask is built once per forward, not once per layer: launch-bound small micro-batches
        # (B=1) pay per kernel. Not a registered buffer, so DDP has nothing to broadcast.
        masked = torch.ones(T, T, device=idx.device, dtype=torch.bool).triu(1)
        for b in self.blocks:
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x = checkpoint(b, x, masked, use_reentrant=False)  # forward again in the backward: same ops, same bits
            else:
                x = b(x, masked)
        return self.head(self.ln(x))

    def loss_batched(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return ce_mean(self(idx), targets)

    def loss_sum(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ce_sum(self(idx), targets)


def ce_mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V), targets (B, T) -> cross-entropy MEAN over the B*T rows whose target is not IGNORE
    (all of them for fixed-length data): the quantity whose gradient accumulation must scale by 1/N."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)


def ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ cross-entropy over valid targets, number of valid targets): the token-weighted pieces. Summing
    both over micro-steps and ranks and dividing once is the global batch's token mean (0 / 0 never
    happens here: an empty micro-batch is (0, 0))."""
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                            reduction="sum")
    return total, (targets != IGNORE).sum()


def build_model(cfg: ModelConfig, seed: int, *, dtype=torch.float32, device="cpu") -> GPT:
    """Deterministic init from `seed` without disturbing the caller's global RNG. The init runs on the CPU, so only
    the CPU generator is seeded (and restored): torch.manual_seed would also seed CUDA's, which fork_rng(devices=[])
    leaves changed, and queue that seed with a formatted stack per device type (~3 ms a call on CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        model = GPT(cfg)
    return model.to(device=device, dtype=dtype)
