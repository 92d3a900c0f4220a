"""The zoo's models, each a plain torch module a user could write: an MLP, a small CNN, a causal LM (biases or
none, one fused or three separate biased q/k/v projections, learned or rotary positions, tied or untied head,
LayerNorm or RMSNorm, an MLP or a top-2 mixture of experts) that also serves packed rows and policy gradients.

No BatchNorm, dropout or randomness in the forward: the gates compare N micro-batches with one big batch, and
BatchNorm's per-micro-batch statistics are a true non-equivalence (docs/verify-your-trainer.md, §5).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, OUTPUTS, CLASSES = 16, 24, 2, 6  # MLP / CNN tasks: 16 features (a 4 × 4 image for the CNN)
VOCAB, SEQ, DIM, HEADS = 16, 8, 16, 2
EXPERTS, TOP_K = 4, 2


class MLP(nn.Module):
    def __init__(self, outputs: int, depth: int = 2):
        super().__init__()
        layers, width = [], FEATURES
        for _ in range(depth):
            layers += [nn.Linear(width, HIDDEN), nn.Tanh()]
            width = HIDDEN
        self.net = nn.Sequential(*layers, nn.Linear(width, outputs))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    """The 16 features as one 4 × 4 channel: conv, GroupNorm (per sample: no batch statistics), conv, a head."""

    def __init__(self, outputs: int):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * 16, outputs)

    def forward(self, x):
        h = F.gelu(self.norm(self.conv1(x.view(-1, 1, 4, 4))))
        return self.head(F.gelu(self.conv2(h)).flatten(1))


@dataclass(frozen=True)
class Arch:
    """How the causal LM is built (each a choice of the zoo's draw)."""

    bias: str = "none"  # "none", "all" (every Linear and norm), "qkv" (three separate biased projections only)
    positions: str = "learned"  # "learned" (an embedding table) or "rotary"
    tied: bool = False  # the head shares the token embedding
    norm: str = "layer"  # "layer" or "rms"
    moe: bool = False  # a top-2 mixture of experts in place of the MLP
    seq: int = SEQ  # positions the learned table holds


def rotate(x, positions):
    """Rotary embedding of x (B, H, T, hd) at integer positions (T,) or (B, T)."""
    hd = x.shape[-1]
    freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float64) / hd))
    angle = positions.to(torch.float64)[..., None] * freq  # (T, hd/2) or (B, T, hd/2)
    if angle.dim() == 3:
        angle = angle[:, None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class MoE(nn.Module):
    """A router and EXPERTS small MLPs; each token goes to its TOP_K most probable experts (the chosen
    probabilities renormalised). Every expert runs on every token, weighted 0 where not chosen."""

    def __init__(self, bias: bool):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=bias), nn.GELU(),
                                                   nn.Linear(2 * DIM, DIM, bias=bias)) for _ in range(EXPERTS))

    def forward(self, h):
        logits = self.router(h)
        probs = logits.softmax(dim=-1)
        top_p, chosen = probs.topk(TOP_K, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, chosen, top_p / top_p.sum(dim=-1, keepdim=True))
        mixed = sum(gates[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return mixed, logits, chosen


class LM(nn.Module):
    """One pre-norm transformer block. forward(ids, positions, segments=None, gather=None) -> logits (B, T, V);
    `positions` (T,) or (B, T) the tokens' positions (packed rows restart them), `segments` (B, T) the document
    of each token (attention stays inside one), `gather` a function (k, v) -> every context-parallel rank's k, v
    with their positions (context parallel). After forward, `router_logits` and `chosen` hold the MoE's."""

    def __init__(self, arch: Arch, vocab: int = VOCAB):
        super().__init__()
        self.arch, b = arch, arch.bias == "all"
        self.tok = nn.Embedding(vocab, DIM)
        self.pos = nn.Embedding(arch.seq, DIM) if arch.positions == "learned" else None
        norm = (lambda: nn.LayerNorm(DIM, bias=b)) if arch.norm == "layer" else (lambda: nn.RMSNorm(DIM))
        self.norm1, self.norm2, self.norm_f = norm(), norm(), norm()
        if arch.bias == "qkv":  # OPT- / BERT-style: three projections, each with a bias
            self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=True) for _ in range(3))
        else:
            self.qkv = nn.Linear(DIM, 3 * DIM, bias=b)
        self.o = nn.Linear(DIM, DIM, bias=b)
        self.mlp = MoE(b) if arch.moe else nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=b), nn.GELU(),
                                                          nn.Linear(2 * DIM, DIM, bias=b))
        for emb in (self.tok, self.pos):  # GPT-2's init: N(0, 1) rows make a tied head's logits ~16
            if emb is not None:
                nn.init.normal_(emb.weight, std=0.02)
        self.head = nn.Linear(DIM, vocab, bias=False)
        if arch.tied:
            self.head.weight = self.tok.weight
        self.router_logits = self.chosen = None

    def heads(self, t):
        B, T, _ = t.shape
        return t.view(B, T, HEADS, DIM // HEADS).transpose(1, 2)

    def forward(self, ids, positions, segments=None, gather=None):
        h = self.tok(ids)
        if self.pos is not None:
            h = h + self.pos(positions)
        x = self.norm1(h)
        q, k, v = (self.q(x), self.k(x), self.v(x)) if self.arch.bias == "qkv" else self.qkv(x).chunk(3, dim=-1)
        q, k, v = self.heads(q), self.heads(k), self.heads(v)
        if self.arch.positions == "rotary":
            q, k = rotate(q, positions), rotate(k, positions)
        k_pos = positions
        if gather is not None:
            k, v, k_pos = gather(k, v)
        allowed = k_pos[..., None, :] <= positions[..., :, None]  # causal: (T, S) or (B, T, S)
        if segments is not None:
            allowed = allowed & (segments[:, :, None] == segments[:, None, :])
        if allowed.dim() == 3:
            allowed = allowed[:, None]
        att = (q @ k.transpose(-1, -2)) / math.sqrt(DIM // HEADS)
        att = att.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        h = h + self.o((att @ v).transpose(1, 2).flatten(2))
        if self.arch.moe:
            mixed, self.router_logits, self.chosen = self.mlp(self.norm2(h))
            h = h + mixed
        else:
            h = h + self.mlp(self.norm2(h))
        return self.head(self.norm_f(h))


def hidden_matrices(model: nn.Module) -> set:
    """The 2-D weights Muon orthogonalises: every Linear weight inside the network, not the embeddings, the
    head or the router (the usual split: those, biases, norms and convolutions go to AdamW)."""
    return {mod.weight for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and not name.endswith(("head", "router"))}
