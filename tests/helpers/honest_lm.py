"""Honest token-weighted trainers that the gates must pass UNDECLARED beyond what they need (issue 42, item 2):

    lm      a causal LM (learned absolute positions, LayerNorm, attention with separate q/k/v/o Linear projections
            WITH bias: OPT / BERT style), the window's token mean over every micro-step and rank. Its key bias's
            gradient is zero in exact arithmetic (softmax ignores a shift shared by every score of a query), so in
            float64 it is rounding noise (~1e-18): a check judging it relative to itself fails any case.
    dapo    a DAPO-style policy-gradient trainer (token-level clipped surrogate, the window's completion tokens over
            every rank) whose policy reads `verify.data.unpack_rollouts`' prompt and completion ids: the normaliser
            gate's halves check masks a completion's head, which must change only which targets count.

Both: per micro-step backward(Σ over its valid targets), nothing communicated; at the boundary ONE all-reduce of
the flat gradient with the window's (loss sum, valid count) appended, then the gradient ÷ the global count (the
one way a window-level token mean is exact under accumulation). A window without a valid target is no step.
The zoo (issue 42, item 1) may reuse `Causal` and `TokenMean`.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify

IGNORE, VOCAB, SEQ, D, HEADS = -100, 11, 6, 8, 2


class Causal(torch.nn.Module):
    """tok + learned positions → LayerNorm → causal attention (q, k, v, o: Linear with bias) → LayerNorm → head."""

    def __init__(self, vocab: int, seq: int, d: int = D, heads: int = HEADS):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=True) for _ in range(4))
        self.head = torch.nn.Linear(d, vocab)
        self.heads = heads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows, s = ids.shape
        h = self.tok(ids) + self.pos(torch.arange(s, device=ids.device))
        a = self.ln1(h)
        split = lambda t: t.view(rows, s, self.heads, -1).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(a)), split(self.k(a)), split(self.v(a))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        h = h + self.o(att.transpose(1, 2).reshape(rows, s, -1))
        return self.head(self.ln2(h))


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class TokenMean:
    """The window's token mean: Σ over valid targets, micro-steps and ranks / their global count."""

    LR = 1e-2

    def __init__(self, spec: verify.Spec):
        torch.manual_seed(spec.seed)
        self.model = self.build().to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.LR, weight_decay=0.01)
        self.n, self.world = spec.accum_steps, _world()
        self.autocast = {"bf16": torch.bfloat16}.get(spec.precision)  # parameters and .grad stay in spec.dtype
        self.total = torch.zeros(2, dtype=torch.float64, device=spec.device)  # (Σ loss, valid count) of this rank
        self.loss = float("nan")

    def build(self) -> torch.nn.Module:
        return Causal(VOCAB, SEQ)

    def token_losses(self, x, y):
        """(per-target loss (rows, S), valid mask (rows, S) bool) of one micro-batch."""
        mask = y != IGNORE
        with torch.autocast(x.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            logits = self.model(x)
        logits = logits.to(self.model.head.weight.dtype)  # the loss in the parameters' dtype (fp32 under autocast)
        ce = F.cross_entropy(logits.flatten(0, 1), y.clamp(min=0).flatten(), reduction="none").view_as(y)
        return ce, mask

    def micro_step(self, x, y, micro):
        per, mask = self.token_losses(x, y)
        s = (per * mask).sum()
        s.backward()  # the count is known only when the window ends: divided there
        self.total += torch.stack([s.detach().double(), mask.sum().double()])
        if micro == self.n - 1:
            self._boundary()

    def _boundary(self):
        params = [p for p in self.model.parameters()]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [self.total.to(grads[0].dtype)])
        if self.world > 1:
            dist.all_reduce(flat)  # every gradient element once, with the window's loss sum and count
        loss_sum, count = float(flat[-2]), float(flat[-1])
        self.count, self.loss = count, loss_sum / count if count else float("nan")
        if count:
            flat = flat[:-2] / count
            for p, chunk in zip(params, flat.split([p.numel() for p in params])):
                p.grad = chunk.view_as(p).clone()

    def partial_grads(self):  # this rank's gradient had the window ended now: Σ so far / the count so far
        count = float(self.total[1])
        return {k: p.grad / count if count else p.grad.clone() for k, p in self.model.named_parameters()}

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        if self.count:  # a window without a valid target is no step
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.total.zero_()
        return self.loss

    def params(self):
        return dict(self.model.named_parameters())


# -- the DAPO-style policy ---------------------------------------------------------------------------------

PROMPT, COMPLETION = 3, 5
EPS_LOW, EPS_HIGH = 0.2, 0.28  # DAPO's clip-higher


class Dapo(TokenMean):
    """DAPO's token-level loss: −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) per completion token, r = π/π_old, summed
    over the window's completion tokens and every rank / their count. The policy reads unpack_rollouts' ids."""

    def build(self):
        return Causal(VOCAB, PROMPT + COMPLETION)

    def token_losses(self, x, y):
        r = verify.data.unpack_rollouts(x, y, IGNORE)
        ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
        logits = self.model(ids[:, :-1])[:, PROMPT - 1:]  # the positions that predict the completion
        logp = logits.log_softmax(-1).gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)
        ratio = (logp - r.old_logps).exp()
        adv = r.advantages.unsqueeze(-1)
        per = -torch.minimum(ratio * adv, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
        return per, r.completion_mask.bool()


lm = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ), ignore_index=IGNORE, data_parallel=True,
                    precisions=("fp32", "bf16"), name="honest causal LM (q/k/v bias, learned positions, token mean)")(TokenMean)
dapo = verify.adapter(data=verify.data.rollouts(vocab=VOCAB, prompt_len=PROMPT, completion_len=COMPLETION),
                      ignore_index=IGNORE, data_parallel=True,
                      name="honest DAPO policy (token-level, unpack_rollouts' ids)")(Dapo)
