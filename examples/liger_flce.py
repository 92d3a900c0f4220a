"""Liger's fused linear cross-entropy (LigerFusedLinearCrossEntropyLoss, reduction="none") under gradient
accumulation: the head's matmul and the loss in one Triton kernel, per-token losses weighted by the trainer itself —
each sequence's own token mean, then the mean over the window's sequences (an SFT "sequence mean"). Its kernel has no
float64 path, so it declares a native reference (verify.Numerics(native="fp32")).

Liger before 0.8.2 scaled every token's gradient by the FIRST token's upstream weight in this mode (PR #1298): with
sequences of different lengths each micro-batch is then scaled by its own first sequence's 1/length, the big batch by
its first one's. On a CPU (no Triton) the same trainer runs torch's cross-entropy instead of the kernel.

    pip install liger-kernel     # on a CUDA GPU
    pytest --pyargs verify --verify-trainer examples.liger_flce:factory -n auto --verify-device cuda
"""
import torch
import torch.nn.functional as F

import verify

IGNORE = -100
VOCAB, SEQ_LEN, DIM = 96, 12, 32
MAX_NORM = 1.0


def sequences(rows: int, seed: int):
    """Token ids (rows, SEQ_LEN) and next-token targets, each row a sequence of 2..SEQ_LEN targets then padding
    (IGNORE): the trainer's own data, not the harness's padding, so every row holds a target."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (rows, SEQ_LEN + 1), generator=g)
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()  # clones: one row's slices would share storage
    lengths = torch.randint(2, SEQ_LEN + 1, (rows,), generator=g)
    y[torch.arange(SEQ_LEN) >= lengths[:, None]] = IGNORE
    return x, y


def token_losses(hidden, head: torch.nn.Linear, targets):
    """Per-token cross-entropy (0 at IGNORE), (rows·S,): Liger's fused kernel where it runs, else torch's."""
    if hidden.is_cuda:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="none")(head.weight, hidden, targets,
                                                                                      head.bias)
    return F.cross_entropy(head(hidden), targets, ignore_index=IGNORE, reduction="none")


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.mix = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def hidden(self, ids):
        h = self.tok(ids)
        return (h + self.mix(h)).flatten(0, 1)  # (rows·S, DIM)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = LM().to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.n, self.loss_sum = spec.accum_steps, 0.0

    def micro_step(self, x, y, micro):
        per_token = token_losses(self.model.hidden(x), self.model.head, y.flatten())
        valid = (y != IGNORE).to(per_token.dtype)  # (rows, S)
        # each sequence's token mean, ÷ the window's sequences (N micro-batches of x.shape[0] rows): one weight a token
        weights = (valid / valid.sum(1, keepdim=True) / (self.n * x.shape[0])).flatten()
        loss = (per_token * weights).sum()
        loss.backward()
        self.loss_sum += loss.item()

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}

    def optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=MAX_NORM)
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss_sum = self.loss_sum, 0.0
        return loss

    def params(self):
        return dict(self.model.named_parameters())


factory = verify.adapter(data=sequences, numerics=verify.Numerics(native="fp32"))(Trainer)
