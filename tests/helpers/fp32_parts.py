"""Held-out correct trainers with a float32 part inside their float64 runs, which the float64 checks must pass
UNDECLARED (issue 26: they are judged at what an fp32 run of the same case resolves, tolerance.twin_floor):

    constant    `loss * torch.tensor(1 / N)`: a float32 0-d constant; the product keeps float64 (no twin sees it)
    loss32      the loss computed in float32 (`F.mse_loss(...).float()`): the loss values carry fp32 rounding
    count32     token-weighted cross-entropy (ignore_index), divided at the boundary by the window's valid
                count through a float32 reciprocal (`torch.tensor(count, dtype=float32).reciprocal()`)
    mse32       one process, the loss on float32 outputs and targets (`F.mse_loss(out.float(), y.float())`),
                clip_grad_norm_, AdamW: where a gradient element cancels, AdamW's gain puts the float32
                rounding into the parameters (one twin is one draw of it: tolerance.md, "one draw")

All are data-parallel (the gradient all-reduced once at the boundary) and expose partial_grads(). Beside
them, the same float32 parts with a structural bug (off_by_one_n, count32_plus_one), which must still fail.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from planted.template import ModelState, TextbookSteps, window_loss

FEATURES, IGNORE, VOCAB = 6, -100, 9


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class MeanLoss(TextbookSteps):
    """N micro-steps of backward(scale(loss)), the gradient averaged over ranks at the boundary, then AdamW."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.n, self.losses, self.world = spec.accum_steps, [], _world()

    def loss(self, x, y):
        return F.mse_loss(self.model(x), y)

    def scale(self, loss):
        return loss / self.n

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.losses = window_loss(self.losses, self.world), []
        return loss


class Constant(MeanLoss):
    def scale(self, loss):
        return loss * torch.tensor(1 / self.n)  # float32 0-d: the product keeps the run's dtype


class Loss32(MeanLoss):
    def loss(self, x, y):
        return F.mse_loss(self.model(x), y).float()  # the loss in float32; its backward casts back


class Count32(ModelState):
    """Σ cross-entropy over valid targets per micro-step; at the boundary the summed gradients (and loss) of
    every rank, reduced once with the count riding along, times the count's float32 reciprocal."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Tanh(), torch.nn.Linear(8, VOCAB))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.n, self.count, self.num, self.world = spec.accum_steps, 0, 0.0, _world()

    def micro_step(self, x, y, micro):
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        loss.backward()
        self.num = self.num + loss.detach()
        self.count += int((y != IGNORE).sum())
        if micro == self.n - 1:
            ps = list(self.model.parameters())
            flat = torch.cat([p.grad.flatten() for p in ps] + [self.num.reshape(1), flat_count(self.count, ps[0])])
            if self.world > 1:
                dist.all_reduce(flat)
            count = int(flat[-1].item())
            flat = flat[:-1] * _inv32(count)
            torch.nn.utils.vector_to_parameters(flat[:-1], [p.grad for p in ps])
            self.num, self.count = (flat[-1] if count else torch.full_like(flat[-1], float("nan"))), count

    def partial_grads(self):  # one process: the window so far, by its count so far
        return {k: p.grad * _inv32(self.count) for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        if self.count:  # a window without a valid target is no step
            self.opt.step()
        self.opt.zero_grad()
        loss, self.count, self.num = self.num, 0, 0.0
        return loss


class Mse32(MeanLoss):
    """A user's MLP whose loss upcasts for safety (in a float64 run, a downcast), clipped, then AdamW."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.model = net.to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.n, self.losses, self.world = spec.accum_steps, [], 1

    def loss(self, x, y):
        return F.mse_loss(self.model(x).float(), y.float())

    def optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        return super().optimizer_step()


def flat_count(count: int, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([float(count)], dtype=like.dtype, device=like.device)


def _inv32(count: int) -> torch.Tensor:
    """1 / count rounded to float32 (0 for no count): a float32 0-d tensor, so products keep their dtype."""
    return torch.tensor(float(max(count, 1)), dtype=torch.float32).reciprocal() if count else torch.tensor(0.0)


_reg = verify.data.regression(features=FEATURES)
constant = verify.adapter(data=_reg, data_parallel=True)(Constant)
loss32 = verify.adapter(data=_reg, data_parallel=True)(Loss32)
count32 = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=5), data_parallel=True,
                         ignore_index=IGNORE)(Count32)
mse32 = verify.adapter(data=verify.data.regression(features=8))(Mse32)


# -- structural bugs beside the same float32 parts: still rejected ------------------------------------------

class OffByOneN(Constant):
    def scale(self, loss):
        return loss * torch.tensor(1 / (self.n + 1))  # a 1/N off by one: 1/(N+1) relative, not rounding


class Count32PlusOne(Count32):
    def micro_step(self, x, y, micro):
        self.count += micro == 0  # the window's count one too many: 1/n relative in every window
        super().micro_step(x, y, micro)


off_by_one_n = verify.adapter(data=_reg, data_parallel=True)(OffByOneN)
count32_plus_one = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=5), data_parallel=True,
                                  ignore_index=IGNORE)(Count32PlusOne)
