"""A hand-written ZeRO-1 trainer whose count row names what it calls, written once for every backend (issue 42
item 8): gloo has no reduce-scatter, so torch runs reduce_scatter_tensor there as one all-reduce and the counter
reads the row's reduce_scatter as that all-reduce (verify/_internal/gates/counts.py, as_recorded).

    zero              each micro-step backwards its mean loss ÷ N; the boundary reduce-scatters the flat gradient
                      (each rank keeps its shard of the mean), each rank steps its shard (SGD with momentum), all-
                      gathers the parameters and all-reduces the step loss: the row {reduce_scatter: 1,
                      all_gather: 1, all_reduce: 1} at the boundary, nothing before: correct
    zero_miscounted   the same trainer, its row claiming two reduce-scatters: a wrong row fails on every backend
    zero_eager        reduce-scatters on every micro-step (ZeRO-2 style), under the same row: the numbers are
                      right, the traffic before the boundary is not in the row
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify

FEATURES, HIDDEN, LR, MOMENTUM = 8, 16, 0.05, 0.9


class Zero:
    eager = False  # the planted bug: the reduce-scatter on every micro-step

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                                         torch.nn.Linear(HIDDEN, 1)).to(spec.device, spec.dtype)
        self.ps = list(self.model.parameters())
        self.group = spec.group
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(self.group) if on else 1
        self.rank = dist.get_rank(self.group) if on else 0
        P = sum(p.numel() for p in self.ps)
        self.shard = -(-P // self.world)  # each rank's slice of the flat vector, padded to world × shard
        flat = self._flat([p.detach() for p in self.ps])
        self.master = flat[self.rank * self.shard:(self.rank + 1) * self.shard].clone()
        self.buf = torch.zeros_like(self.master)
        self.g = torch.zeros_like(self.master)  # this rank's shard of the window's mean gradient
        self.n, self.loss = spec.accum_steps, 0.0

    def _flat(self, ts):
        flat = torch.cat([t.reshape(-1) for t in ts])
        return F.pad(flat, (0, self.world * self.shard - flat.numel()))

    def _scatter(self):
        """This rank's shard of the summed gradient ÷ world, added to self.g; .grad cleared for the next part."""
        flat = self._flat([p.grad for p in self.ps])
        part = torch.empty_like(self.master)
        if self.world > 1:
            dist.reduce_scatter_tensor(part, flat, group=self.group)
        else:
            part = flat
        self.g += part / self.world
        for p in self.ps:
            p.grad = None

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x), y)
        (loss if self.n == 1 else loss / self.n).backward()
        self.loss += loss.item()
        if self.eager or micro == self.n - 1:
            self._scatter()

    def _full(self, shard):
        if self.world == 1:
            return shard
        full = torch.empty(self.world * self.shard, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group)
        return full

    def _named(self, full):
        out, at = {}, 0
        for name, p in self.model.named_parameters():
            out[name] = full[at:at + p.numel()].view_as(p)
            at += p.numel()
        return out

    def grads(self):  # the harness reads the whole gradient: gathered in its grads() window (reported, not judged)
        return self._named(self._full(self.g))

    def optimizer_step(self):
        self.buf.mul_(MOMENTUM).add_(self.g)
        self.master.sub_(LR * self.buf)
        full = self._full(self.master)
        with torch.no_grad():
            for p, v in zip(self.ps, self._named(full).values()):
                p.copy_(v)
        self.g.zero_()
        loss = torch.tensor([self.loss / self.n], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(loss, group=self.group)
        self.loss = 0.0
        return float(loss) / self.world

    def params(self):
        return dict(self.model.named_parameters())


class ZeroEager(Zero):
    eager = True


def counts(case):
    """Written once: what the trainer calls (on gloo the counter reads the reduce_scatter as its all-reduce)."""
    return verify.CountRow("hand-written ZeRO-1", before={},
                           boundary={"reduce_scatter": 1, "all_gather": 1, "all_reduce": 1})


def miscounted(case):
    return verify.CountRow("hand-written ZeRO-1, two reduce-scatters claimed", before={},
                           boundary={"reduce_scatter": 2, "all_gather": 1, "all_reduce": 1})


DATA = verify.data.regression(features=FEATURES)
zero = verify.adapter(data=DATA, data_parallel=True, counts=counts, name="zero")(Zero)  # correct: must pass
zero_miscounted = verify.adapter(data=DATA, data_parallel=True, counts=miscounted, name="zero_miscounted")(Zero)
zero_eager = verify.adapter(data=DATA, data_parallel=True, counts=counts, name="broken zero_eager")(ZeroEager)
