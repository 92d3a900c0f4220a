"""A Llama-shaped causal LM at production sizes (RMSNorm, rotary positions, grouped-query attention, SwiGLU), trained
as people train one: bf16 autocast, AdamW with a warm-up, clipping, a token mean over padded windows (the SUM of
token losses per micro-step, ÷ the window's valid-token count at the boundary), activation checkpointing and a
chunked cross-entropy, metrics. Built on the device from the seed (no CPU copy of a billion weights), in float32
and then cast, so the float64 reference starts from the same weights.

    pytest --pyargs verify --verify-trainer examples.llama_scale:factory -n auto          # tiny, any CPU
    python -m verify.gpu_gate --scale --trainer examples.llama_scale:billion              # 1.1B, one H100 / H200
"""
import dataclasses

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import verify

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class Size:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int

    @property
    def parameters(self) -> int:
        head = self.dim // self.heads
        block = self.dim * head * (2 * self.heads + 2 * self.kv_heads) + 3 * self.dim * self.ffn + 2 * self.dim
        return 2 * self.vocab * self.dim + self.layers * block + self.dim


SIZES = {  # TinyLlama's shape at 1.1B; 134M: the measured size
    "tiny": Size(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, seq=16),
    "134m": Size(vocab=32000, dim=768, layers=12, heads=12, kv_heads=4, ffn=2048, seq=128),
    "500m": Size(vocab=32000, dim=1536, layers=16, heads=24, kv_heads=4, ffn=4096, seq=128),
    "1b": Size(vocab=32000, dim=2048, layers=22, heads=32, kv_heads=4, ffn=5632, seq=128),
}


@dataclasses.dataclass(frozen=True)
class Options:
    size: str = "tiny"
    lr: float = 3e-3
    max_norm: float = 1.0
    checkpointing: bool = False  # recompute each block in the backward: activations of one block at a time
    loss_chunk: int = 4096  # tokens per cross-entropy chunk: the (tokens, vocab) logits never exist whole


class Block(torch.nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.s, hd = s, s.dim // s.heads
        self.attn_norm, self.mlp_norm = torch.nn.RMSNorm(s.dim, eps=1e-5), torch.nn.RMSNorm(s.dim, eps=1e-5)
        self.q = torch.nn.Linear(s.dim, s.heads * hd, bias=False)
        self.kv = torch.nn.Linear(s.dim, 2 * s.kv_heads * hd, bias=False)
        self.o = torch.nn.Linear(s.heads * hd, s.dim, bias=False)
        self.gate_up = torch.nn.Linear(s.dim, 2 * s.ffn, bias=False)
        self.down = torch.nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, h, cos, sin):  # h: (rows, S, dim); cos, sin: (S, head_dim / 2)
        s, (B, S, _) = self.s, h.shape
        x = self.attn_norm(h)
        q = rope(self.q(x).view(B, S, s.heads, -1), cos, sin)
        k, v = self.kv(x).view(B, S, 2 * s.kv_heads, -1).chunk(2, dim=2)
        k = rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)  # (rows, heads, S, head_dim)
        h = h + self.o(a.transpose(1, 2).reshape(B, S, -1))
        g, u = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(g) * u)


def rope(x, cos, sin):  # x: (rows, S, heads, head_dim), rotated in pairs (first half, second half)
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class Llama(torch.nn.Module):
    def __init__(self, s: Size, o: Options):
        super().__init__()
        self.s, self.o = s, o
        self.embed = torch.nn.Embedding(s.vocab, s.dim)
        self.blocks = torch.nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = torch.nn.RMSNorm(s.dim, eps=1e-5)
        self.head = torch.nn.Linear(s.dim, s.vocab, bias=False)
        for p in self.parameters():  # Llama's init: N(0, 0.02), norms at 1
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def loss_sum(self, ids, targets):
        """Σ of the token cross-entropies over valid targets (rows, S) -> a 0-d tensor."""
        h, y = self.hidden(ids), targets.flatten()
        total = h.new_zeros((), dtype=torch.float32 if h.dtype == torch.bfloat16 else h.dtype)
        for i in range(0, h.shape[0], self.o.loss_chunk):  # each chunk's logits recomputed in the backward
            total = total + checkpoint(_chunk_ce, self.head, h[i:i + self.o.loss_chunk], y[i:i + self.o.loss_chunk],
                                       use_reentrant=False)
        return total

    def hidden(self, ids):
        """The final normed hidden states, (rows·S, dim)."""
        S = ids.shape[1]
        inv = 1.0 / 10000 ** (torch.arange(0, self.s.dim // self.s.heads, 2, device=ids.device, dtype=torch.float64)
                              / (self.s.dim // self.s.heads))
        angles = torch.outer(torch.arange(S, device=ids.device, dtype=torch.float64), inv)
        cos, sin = angles.cos(), angles.sin()
        h = self.embed(ids)
        for block in self.blocks:
            h = checkpoint(block, h, cos, sin, use_reentrant=False) if self.o.checkpointing else block(h, cos, sin)
        return self.norm(h).flatten(0, 1)


def _chunk_ce(head, h, y):
    return F.cross_entropy(head(h).float() if h.dtype == torch.bfloat16 else head(h), y, ignore_index=IGNORE,
                           reduction="sum")


def build(spec, model_class=Llama) -> Llama:
    """On spec.device, from spec.seed, in float32, then cast to spec.dtype: one set of weights for every dtype."""
    o = spec.options or Options()
    torch.manual_seed(spec.seed)
    with torch.device(spec.device):
        model = model_class(SIZES[o.size], o)
    return model.to(spec.dtype)


def warmup(step: int) -> float:
    """A linear warm-up over 3 steps: the LR moves within the gates' first steps."""
    return min(1.0, (step + 1) / 3)


def max_norm(options: Options) -> float:
    return options.max_norm


class Trainer:
    model_class = Llama

    def __init__(self, spec):
        o = self.o = spec.options or Options()
        self.model = build(spec, self.model_class)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup)
        self.n, self.bf16 = spec.accum_steps, spec.precision == "bf16"
        self.device_type = torch.device(spec.device).type
        self.tokens = torch.zeros((), dtype=torch.int64, device=spec.device)
        self.loss_sum = torch.zeros((), dtype=spec.dtype, device=spec.device)
        self.loss, self.logged = float("nan"), {}

    def forward_sum(self, x, y):
        """The micro-batch's summed token loss, under bf16 autocast when the run's precision is bf16."""
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.model.loss_sum(x, y)

    def divide(self, count: int, loss_sum) -> None:
        """The boundary: every gradient and the loss ÷ the count (a window without a valid target: no step)."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad /= max(count, 1)
        self.loss = float(loss_sum) / count if count else float("nan")
        self.logged = {"loss": self.loss, "tokens": count}

    def micro_step(self, x, y, micro):
        loss_sum = self.forward_sum(x, y)
        loss_sum.backward()  # the SUM: the window's count is known only at the boundary
        self.loss_sum += loss_sum.detach()
        self.tokens += (y != IGNORE).sum()
        if micro == self.n - 1:
            self.divide(int(self.tokens), self.loss_sum)
            self.tokens.zero_(), self.loss_sum.zero_()

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}

    def optimizer_step(self):
        if self.loss == self.loss:  # NaN: a window without a valid target takes no step and moves no state
            self.logged["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.o.max_norm))
            self.logged["lr"] = self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        loss, self.loss = self.loss, float("nan")
        return loss

    def metrics(self):
        return self.logged

    def params(self):
        return dict(self.model.named_parameters())


class Plain(Trainer):
    """The textbook step on the whole batch, no accumulation: one forward, the summed loss, one backward, ÷ the
    batch's count; then the same clip and step."""

    def micro_step(self, x, y, micro):
        loss_sum = self.forward_sum(x, y)
        loss_sum.backward()
        self.divide(int((y != IGNORE).sum()), loss_sum.detach())


def loss_chunk_side(options: Options | None, above: bool) -> Options:
    """The loss chunk's threshold: past it a micro-batch's tokens span several chunks (5 tokens: rows split too)."""
    return dataclasses.replace(options or Options(), loss_chunk=5 if above else 1 << 20)


def options(size: str):
    """The drawn options: the model at `size`, its LR and clip threshold around the drawn windows' norms."""
    big = size != "tiny"
    return st.builds(Options, size=st.just(size), lr=st.sampled_from([3e-3, 1e-3]) if not big else st.just(3e-4),
                     max_norm=st.sampled_from([0.5, 1.0]) if not big else st.just(1.0), checkpointing=st.just(big))


def _adapter(size: str, name: str):
    s = SIZES[size]
    return verify.adapter(
        data=verify.data.tokens(vocab=s.vocab, seq_len=s.seq), plain=Plain, options=options(size),
        defaults=Options(size=size, checkpointing=size != "tiny", lr=3e-4 if size != "tiny" else 3e-3),
        batches=verify.Batches(ignore_index=IGNORE), numerics=verify.Numerics(precisions=("fp32", "bf16")),
        metrics=verify.Metrics(names=("loss", "grad_norm", "lr", "tokens"), max_norm=max_norm),
        thresholds=(verify.Threshold(name="loss chunk", apply=loss_chunk_side),), name=name)(Trainer)


factory = _adapter("tiny", "Llama-shaped LM, tiny")
m134 = _adapter("134m", f"Llama-shaped LM, {SIZES['134m'].parameters / 1e6:.0f}M")
half = _adapter("500m", f"Llama-shaped LM, {SIZES['500m'].parameters / 1e9:.2f}B")
billion = _adapter("1b", f"Llama-shaped LM, {SIZES['1b'].parameters / 1e9:.2f}B")
