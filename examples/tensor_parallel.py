"""DTensor tensor parallel (ColwiseParallel / RowwiseParallel, loss parallel) with data-parallel replicas
on a dp × tp mesh: tp's collectives run on every micro-step, the dp reduction once, at the boundary; the
gradient clipped by its norm over the whole model, which metrics() logs.

    pytest --pyargs verify --verify-trainer examples.tensor_parallel:factory -n auto
    python -m verify.selftest --verify-trainer examples.tensor_parallel:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

import verify

MAX_NORM = 1.0  # the clip threshold; the drawn cases' norms straddle it, so clipped and unclipped steps are checked


def warmup(step):
    """The LR factor of a 3-step linear warm-up (the LR moves, so logging the wrong step's would show)."""
    return min(1.0, (step + 1) / 3)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the full model; parallelize_module keeps its shards
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 24), torch.nn.Tanh(),
            torch.nn.Linear(24, 24), torch.nn.Tanh(),
            torch.nn.Linear(24, 12),
        )
        self.model = model.to(spec.device, spec.dtype)
        self.n = spec.accum_steps
        self.dp = spec.mesh.dp
        self.loss = torch.zeros((), dtype=torch.float64)
        self.rows = 0
        self.logged = {}
        if spec.mesh.size > 1:  # at Mesh() (the 1×1×1 reference) the plain model: no process group needed
            self.mesh = verify.device_mesh(spec)  # dims ("dp", "pp", "tp"); the harness gives each dp replica its rows
            # the head's logits stay a DTensor sharded over the classes: loss_parallel's cross entropy reads them so
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(use_local_output=False)}
            parallelize_module(self.model, self.mesh["tp"], plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup)

    def micro_step(self, x, y, micro):
        # loss_parallel() covers the backward too: the loss's gradient flows into the sharded logits
        with loss_parallel():
            loss = F.cross_entropy(self.model(x), y)  # the replica's mean, on every tp rank
            (loss / self.n).backward()
        self.loss += loss.item() / (self.n * self.dp)
        self.rows += len(y)
        if micro == self.n - 1 and self.dp > 1:
            self.average_over_dp()

    def average_over_dp(self):
        """The boundary: the replicas' means, one all-reduce over dp per gradient, and the global batch's loss."""
        group = self.mesh["dp"].get_group()
        for p in self.model.parameters():
            # a DTensor's local shard: each tp rank reduces its own
            dist.all_reduce(p.grad.to_local(), group=group)
            p.grad.div_(self.dp)
        dist.all_reduce(self.loss, group=group)

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}  # DTensors: the harness gathers them

    def optimizer_step(self):
        params = list(self.model.parameters())
        # The norm of the whole gradient: over DTensors get_total_norm sums each shard's Σg² over tp and counts
        # a replicated one (Rowwise's bias) once. Its result is a DTensor still to be reduced: full_tensor()
        # makes it one number on every tp rank. The replicas hold the same (dp-averaged) gradient already.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
        lr = self.opt.param_groups[0]["lr"]  # read before the step: the LR this step applies
        self.opt.step()
        self.sched.step()  # once per optimizer step, after it
        self.opt.zero_grad()
        loss = self.loss
        # every replica holds the same number of rows: the window's over every rank
        self.logged = {"loss": loss.item(), "grad_norm": norm.item(), "lr": lr, "rows": self.rows * self.dp}
        self.loss = torch.zeros((), dtype=torch.float64)
        self.rows = 0
        return loss

    def metrics(self):
        """What the last step logs: the global loss, the pre-clip norm, the LR, the window's rows over every rank."""
        return self.logged

    def params(self):
        return dict(self.model.named_parameters())


def counts(case):
    """tp's all-reduces on every micro-step: Rowwise's output, the head's input gradient and loss_parallel's
    three (max, sum of exponentials, target logit); at the boundary also the norm's. On a one-rank tp group
    only loss_parallel's reach c10d. dp keeps the default row: nothing before the boundary."""
    if case.mesh.tp > 1:
        before = {"all_reduce": 5}
        # the boundary adds the gradient norm's reduction (full_tensor() of get_total_norm's partial sum)
        boundary = {"all_reduce": 6}
    else:
        before = boundary = {"all_reduce": 3}
    return {"tp": verify.CountRow("Colwise/Rowwise + loss parallel", before=before, boundary=boundary)}


# mesh_sizes: tp shards the widths 24 and 12 evenly.
# metrics: what metrics() logs, and the threshold it clips at (the harness checks the scale the optimizer saw).
metrics = verify.Metrics(names=("loss", "grad_norm", "lr", "rows"), max_norm=MAX_NORM)
factory = verify.adapter(data=verify.data.classification(features=8, classes=12), metrics=metrics,
                         distributed=verify.Distributed(mesh_axes=("dp", "tp"), mesh_sizes={"tp": (2, 3, 4, 6)},
                                                        counts=counts))(Trainer)
