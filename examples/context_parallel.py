"""Context parallel: each sequence's tokens split over the cp ranks (the harness's split: cp rank c holds tokens
[c·S/cp, (c+1)·S/cp) of every row of its dp replica), one causal attention layer that all-gathers K and V over cp
(its backward all-reduces their gradients, each rank keeping its own tokens'), and the token mean over dp × cp:
the window's loss sum, valid-target count and gradient reduced over cp, then dp, once, at the boundary.

    XTRAIN_DIST_MAX_WORLD=4 pytest --pyargs verify --verify-trainer examples.context_parallel:factory
    python -m verify.selftest --verify-trainer examples.context_parallel:factory
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify

VOCAB, SEQ, D = 16, 8, 16
IGNORE = -100


class GatherTokens(torch.autograd.Function):
    """(B, T, D) on each cp rank -> (B, T·cp, D), the ranks' tokens in order. The backward all-reduces the whole
    gradient (gloo has no reduce-scatter) and returns this rank's T tokens of it."""

    @staticmethod
    def forward(ctx, t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.T = group, dist.get_rank(group), t.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.T:(ctx.rank + 1) * ctx.T], None


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, D)
        self.pos = torch.nn.Embedding(SEQ, D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, x, offset, group):
        """x (B, T): tokens [offset, offset + T) of each row -> logits (B, T, V). group: cp's (None: whole rows)."""
        T = x.shape[1]
        positions = torch.arange(offset, offset + T, device=x.device)
        h = self.tok(x) + self.pos(positions)
        q, k, v = self.qkv(h).split(D, dim=-1)
        if group is not None:  # every cp rank's keys and values, in position order: (B, T·cp, D)
            k = GatherTokens.apply(k, group)
            v = GatherTokens.apply(v, group)
        future = torch.arange(k.shape[1], device=x.device)[None, :] > positions[:, None]  # (T, S)
        att = (q @ k.transpose(1, 2) / math.sqrt(D)).masked_fill(future, float("-inf")).softmax(-1)
        return self.head(h + att @ v)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = Model().to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.n = spec.accum_steps
        self.cp, self.cp_rank, self.cp_group, self.dp_group = spec.mesh.cp, 0, None, None
        if spec.mesh.size > 1:
            mesh = verify.device_mesh(spec)  # dims ("dp", "pp", "cp", "tp"); the harness gives each cp rank its tokens
            if spec.mesh.cp > 1:
                self.cp_group, self.cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
            if spec.mesh.dp > 1:
                self.dp_group = mesh["dp"].get_group()
        self.total, self.count, self.loss, self.window_count = 0.0, 0, float("nan"), 0.0

    def micro_step(self, x, y, micro):
        logits = self.model(x, self.cp_rank * x.shape[1], self.cp_group)
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        ce.backward()
        self.total += ce.item()
        self.count += self.counted(y)
        sync = micro == self.n - 1
        if sync:
            self.reduce()

    def counted(self, y) -> int:
        return int((y != IGNORE).sum())  # this rank's valid targets: its tokens of its rows

    def reduce(self):
        """The boundary: gradient, loss sum and count summed over cp, then dp, in one flat tensor; then ÷ count."""
        params = list(self.model.parameters())
        extra = torch.tensor([self.total, float(self.count)], dtype=params[0].dtype, device=params[0].device)
        flat = torch.cat([p.grad.flatten() for p in params] + [extra])
        for group in (self.cp_group, self.dp_group):
            if group is not None:
                dist.all_reduce(flat, group=group)
        self.scale(flat)
        total, count = flat[-2].item(), flat[-1].item()
        self.loss, self.window_count = (total / count if count else float("nan")), count
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / (count or 1.0))
            offset += p.numel()

    def scale(self, flat):
        """Where a trainer rescales the reduced sums (nothing here)."""

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}

    def optimizer_step(self):
        if self.window_count:  # the window's count over every rank: a cp rank whose tokens are padding steps too
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss, self.loss, self.total, self.count, self.window_count = self.loss, float("nan"), 0.0, 0, 0.0
        return loss

    def params(self):
        return dict(self.model.named_parameters())


def counts(case):
    """Per micro-step over cp: K and V all-gathered in the forward, their gradients all-reduced in the backward; at
    the boundary one all-reduce more over cp (the window's sums) and one over dp (dp's: the boundary-only rule)."""
    if case.mesh.cp == 1:
        return {}
    per_micro = {"all_gather": 2, "all_reduce": 2}
    return {"cp": verify.CountRow("cp: K/V gathered, the sums reduced once", before=per_micro,
                                  boundary={"all_gather": 2, "all_reduce": 3})}


def data(rows, seed):
    return verify.data.tokens(vocab=VOCAB, seq_len=SEQ)(rows, seed)


# mesh_axes: data parallel × context parallel; cp must divide the 8 tokens of a row
factory = verify.adapter(data=data, batches=verify.Batches(ignore_index=IGNORE),
                         distributed=verify.Distributed(mesh_axes=("dp", "cp"), mesh_sizes={"cp": (2, 4, 8)}, counts=counts))(
    Trainer)
