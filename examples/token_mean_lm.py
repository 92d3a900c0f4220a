"""A token-mean causal LM whose micro-step sees one micro-batch: it cannot know the window's valid-token count
before the last micro-step, so each micro-step backpropagates the SUM of its token losses and counts its valid
targets; the boundary all-reduces the count once (an int64 scalar, allowed there undeclared) with the gradients,
then divides by the WINDOW's count over every rank, never by one micro-batch's.

    pytest --pyargs verify --verify-trainer examples.token_mean_lm:factory -n auto
    python -m verify.selftest --verify-trainer examples.token_mean_lm:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify

IGNORE = -100  # the harness pads targets with it (right padding, empty rows and micro-batches too)
VOCAB, SEQ_LEN, DIM = 32, 8, 16
MAX_NORM = 0.5  # the drawn windows' norms straddle it (0.3-1.2): clipped and unclipped steps are both checked


class TinyLM(torch.nn.Module):
    """Token + position embeddings, one causal self-attention head, a linear head."""

    def __init__(self, vocab=VOCAB, seq_len=SEQ_LEN, dim=DIM):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq_len, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.hidden(ids))  # (rows, S, VOCAB)

    def hidden(self, ids):
        """The states the head projects, (rows, S, DIM)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.tok(ids) + self.pos(positions)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.tanh(h + attn)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = TinyLM().to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.n, self.group = spec.accum_steps, spec.group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.tokens = torch.zeros((), dtype=torch.int64, device=spec.device)  # this rank's valid targets so far
        self.loss_sum = torch.zeros((), dtype=spec.dtype, device=spec.device)
        self.loss, self.window_tokens, self.logged = float("nan"), 0, {}

    def micro_step(self, x, y, micro):
        logits = self.model(x)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        # NOT reduction="mean" (÷ this micro-batch's count) nor ÷ N: the window's count is known at the boundary
        loss_sum.backward()
        self.loss_sum += loss_sum.detach()
        self.tokens += (y != IGNORE).sum()
        if micro == self.n - 1:
            self.boundary()

    def boundary(self):
        """The window's last micro-step: Σ over every rank of the count, the loss and the gradients, then ÷ the
        count. Before the boundary nothing is reduced (a count reduced there would need verify.Expected)."""
        count, loss_sum = self.tokens.clone(), self.loss_sum.clone()
        if self.distributed:
            dist.all_reduce(count, group=self.group)  # the window's count: one integer all-reduce
            dist.all_reduce(loss_sum, group=self.group)  # one scalar beside the gradients
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=self.group)  # Σ, not the mean over ranks: the count is global
        tokens = int(count)
        for p in self.model.parameters():
            p.grad /= max(tokens, 1)  # a window without a valid target has zero gradients, and takes no step
        self.loss = float(loss_sum) / tokens if tokens else float("nan")
        self.window_tokens = tokens
        self.tokens.zero_()
        self.loss_sum.zero_()

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.logged = {"loss": self.loss, "tokens": self.window_tokens}  # what this step logs: metrics()
        if self.loss == self.loss:  # NaN: a window without a valid target is no step (AdamW's state unmoved)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=MAX_NORM)
            self.logged["grad_norm"] = float(norm)
            self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = self.loss, float("nan")
        return loss

    def metrics(self):
        return self.logged

    def params(self):
        return dict(self.model.named_parameters())


# uneven=True: the count is global, so ranks may hold different rows and micro-steps per window (token budgets)
METRICS = verify.Metrics(names=("loss", "grad_norm", "tokens"), max_norm=MAX_NORM)
factory = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ_LEN), metrics=METRICS,
                         batches=verify.Batches(ignore_index=IGNORE),
                         distributed=verify.Distributed(data_parallel=True, uneven=True))(Trainer)
