"""Packed rows: several documents per row, a tiny causal LM whose attention stays inside each document (a
block-diagonal mask from the restarting position_ids), trained on the per-document mean: each document's token
mean, averaged over the window's documents. Each micro-step sums its documents' means; the boundary all-reduces
the gradients with the sum and the document count riding along, then divides once by the window's count.

    pytest --pyargs verify --verify-trainer examples.packed_documents:factory
    XTRAIN_DIST_MIN_WORLD=2 XTRAIN_DIST_MAX_WORLD=2 pytest --pyargs verify -k data_parallel \
        --verify-trainer examples.packed_documents:factory
    python -m verify.selftest --verify-trainer examples.packed_documents:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from examples.token_mean_lm import TinyLM

IGNORE = -100
VOCAB, SEQ_LEN, MAX_DOCS, DIM = 16, 12, 3, 16


class PackedLM(TinyLM):
    """token_mean_lm's tiny LM whose causal self-attention never looks across a document."""

    def __init__(self):
        super().__init__(VOCAB, SEQ_LEN, DIM)

    def forward(self, ids, position_ids):
        h = self.tok(ids) + self.pos(position_ids)  # (rows, S, DIM)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        doc = verify.data.documents(torch.stack([ids, position_ids], dim=1))  # (rows, S) segment ids
        same_doc = doc[:, :, None] == doc[:, None, :]  # (rows, S, S)
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=same_doc & causal)
        return self.head(torch.tanh(h + attn))  # (rows, S, VOCAB)


def document_means(logits, targets, doc):
    """(rows,) Σ over each row's documents of that document's token mean (a document without a valid target: 0)."""
    valid = targets != IGNORE
    ce = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none")
    ce = ce.view_as(targets) * valid
    per_doc = torch.zeros(targets.shape, dtype=ce.dtype, device=ce.device).scatter_add(1, doc, ce)
    tokens = torch.zeros(targets.shape, dtype=ce.dtype, device=ce.device).scatter_add(1, doc, valid.to(ce.dtype))
    return (per_doc / tokens.clamp(min=1)).sum(dim=1)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = PackedLM().to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.n, self.group = spec.accum_steps, spec.group
        self.distributed = dist.is_available() and dist.is_initialized()
        # the window's Σ document means, documents, valid targets (3,)
        self.window = torch.zeros(3, dtype=spec.dtype, device=spec.device)
        self.loss = float("nan")

    def micro_step(self, x, y, micro):
        ids, position_ids = x[:, 0], x[:, 1]
        doc = verify.data.documents(x)
        means = document_means(self.model(ids, position_ids), y, doc)
        means.sum().backward()  # the window's document count is known only at the boundary: divide there
        counts = [means.sum().detach(), verify.data.count_documents(x, y).sum(), (y != IGNORE).sum()]
        self.window += torch.stack([c.to(self.window.dtype) for c in counts])
        if micro == self.n - 1:
            self.boundary()

    def boundary(self):
        """Σ gradients and the window's sums over every rank, in one all-reduce; then ÷ the window's documents."""
        params = list(self.model.parameters())
        flat = torch.cat([p.grad.flatten() for p in params] + [self.window])
        if self.distributed:
            dist.all_reduce(flat, group=self.group)
        total, documents, valid = flat[-3:].tolist()
        flat /= max(documents, 1.0)
        torch.nn.utils.vector_to_parameters(flat[:-3], [p.grad for p in params])
        self.loss = total / documents if valid else float("nan")
        self.window.zero_()

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}

    def optimizer_step(self):
        if self.loss == self.loss:  # a window without a valid target is no step (its loss is NaN)
            self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = self.loss, float("nan")
        return loss

    def params(self):
        return dict(self.model.named_parameters())


# objective: each document's token mean, averaged over the window's documents (count_documents: from the restarts)
objective = verify.Objective(terms={"loss": "seq_mean"}, sequences=verify.data.count_documents)
factory = verify.adapter(data=verify.data.packed(vocab=VOCAB, seq_len=SEQ_LEN, max_docs=MAX_DOCS, ignore_index=IGNORE),
                         batches=verify.Batches(ignore_index=IGNORE), objective=objective,
                         distributed=verify.Distributed(data_parallel=True))(Trainer)
