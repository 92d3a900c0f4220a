"""Small token-mean LMs a new user writes, each with one bug whose hint must name it (issue 42, item 9): the
diagnosis under the verdict (verify/_internal/gates/rerun.py) is tested on them in tests/harness/test_hints_evidence.py.

    token_mean             the correct trainer (the control): passes every gate it meets
    per_micro_token_mean   each micro-batch ÷ its own valid-token count, then ÷ N (the most common LM bug)
    per_micro_token_mean_dp  the same on every rank, DDP-style ÷ W at the boundary
    over_n_twice           the window's token mean ÷ N once more: wrong padded or not (its hint stays "1/N twice")
    shifted                the correct trainer with a logit shift (a parameter whose gradient is 0 in exact arithmetic)
    wrong_dtype            `shifted` built in float32 whatever Spec.dtype: the float64 reference is not float64, and
                           AdamW turns the shift's float32 rounding noise into ±lr updates
    unseeded               the model's init drawn from the global RNG, not from Spec.seed

The correct trainer (TokenMean) backwards each micro-batch's SUM of cross-entropy and divides the window's
gradient by the window's valid-target count at the boundary (one all-reduce of gradients, count and loss).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify

IGNORE, VOCAB = -100, 11


class LM(torch.nn.Module):
    """Embedding, tanh, logits; `shifted`: plus one scalar added to every logit, which softmax ignores: its
    gradient is 0 in exact arithmetic, rounding noise in practice (AdamW turns noise into ±lr updates)."""

    def __init__(self, shifted: bool):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))
        self.shift = torch.nn.Parameter(torch.zeros(())) if shifted else None

    def forward(self, x):
        out = self.body(x)
        return out if self.shift is None else out + self.shift


class TokenMean:
    shifted = False

    def __init__(self, spec):
        self.seed(spec)
        self.model = LM(self.shifted).to(spec.device, self.dtype(spec))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.n, self.count, self.num = spec.accum_steps, 0, 0.0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def seed(self, spec):
        torch.manual_seed(spec.seed)

    def dtype(self, spec):
        return spec.dtype

    def micro_step(self, x, y, micro):
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        count = int((y != IGNORE).sum())
        part = self.part(loss, count)
        part.backward()
        self.num, self.count = self.num + part.detach().double(), self.count + count
        if micro == self.n - 1:
            self.boundary()

    def part(self, loss, count):
        """What one micro-batch backwards: its summed loss (÷ the window's count at the boundary)."""
        return loss

    def boundary(self):
        """Σ gradients, count and loss of every rank, one all-reduce; then the gradient ÷ the window's count."""
        ps = list(self.model.parameters())
        tail = torch.tensor([float(self.count), float(self.num)], dtype=ps[0].dtype)
        flat = torch.cat([p.grad.flatten() for p in ps] + [tail])
        if self.world > 1:
            dist.all_reduce(flat)
        self.count, self.num = int(flat[-2]), float(flat[-1])
        torch.nn.utils.vector_to_parameters(flat[:-2] / self.divisor(), [p.grad for p in ps])

    def divisor(self):
        return max(self.count, 1)

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        if self.count:
            self.opt.step()
        self.opt.zero_grad()
        loss, self.count, self.num = self.num / self.divisor(), 0, 0.0
        return torch.tensor(loss)

    def params(self):
        return dict(self.model.named_parameters())


class PerMicroTokenMean(TokenMean):
    """F.cross_entropy's default mean over each micro-batch's own valid targets, ÷ N: exact while every
    micro-batch holds as many valid targets as the others (transformers #24725)."""

    def part(self, loss, count):
        return loss / max(count, 1) / self.n

    def divisor(self):
        return self.world  # DDP's mean over the ranks: each rank's gradient is already its micro-batches' means


class OverNTwice(TokenMean):
    def divisor(self):
        return max(self.count, 1) * self.n


class Shifted(TokenMean):
    shifted = True


class WrongDtype(Shifted):
    def dtype(self, spec):
        return torch.float32  # token ids in, so nothing fails: the float64 run is a float32 one


class Unseeded(TokenMean):
    def seed(self, spec):
        pass  # init from wherever the global RNG stands


_common = dict(data=verify.data.tokens(vocab=VOCAB, seq_len=5), ignore_index=IGNORE, empty_windows=False)
token_mean = verify.adapter(**_common)(TokenMean)
per_micro_token_mean = verify.adapter(**_common)(PerMicroTokenMean)
per_micro_token_mean_dp = verify.adapter(**_common, data_parallel=True)(PerMicroTokenMean)
over_n_twice = verify.adapter(**_common)(OverNTwice)
shifted = verify.adapter(**_common)(Shifted)
wrong_dtype = verify.adapter(**_common)(WrongDtype)
unseeded = verify.adapter(**_common)(Unseeded)

