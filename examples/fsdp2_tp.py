"""FSDP2 over dp (fully_shard) + DTensor tensor parallel over tp on a 2-D mesh: FSDP2's gradient sync is
off on micro-steps 0..N-2 (set_requires_gradient_sync), so its reduce-scatter over dp runs at the boundary only.
The gradient is clipped by its norm over every shard, which metrics() logs.

    pytest --pyargs verify --verify-trainer examples.fsdp2_tp:factory -n auto
    python -m verify.selftest --verify-trainer examples.fsdp2_tp:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import verify

MAX_NORM = 10.0  # the clip threshold; the drawn cases' norms straddle it, so clipped and unclipped steps are checked


def warmup(step):
    """The LR factor of a 3-step linear warm-up (the LR moves, so logging the wrong step's would show)."""
    return min(1.0, (step + 1) / 3)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the full model; TP, then FSDP2, keep their shards
        net = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))
        self.model = net.to(spec.device, spec.dtype)
        self.n = spec.accum_steps
        self.dp = spec.mesh.dp
        self.loss = 0.0
        self.rows = 0
        self.logged = {}
        # at Mesh() (the 1×1×1 reference) the plain model: no process group needed
        self.fsdp = spec.mesh.size > 1
        if self.fsdp:
            self.mesh = verify.device_mesh(spec)  # dims ("dp", "pp", "tp"): TP within a replica, FSDP2 across replicas
            parallelize_module(self.model, self.mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(self.model, mesh=self.mesh["dp"])  # one unit, the root; its reduce-scatter averages over dp
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup)

    def micro_step(self, x, y, micro):
        if self.fsdp:
            # set before the forward, read in the backward: sync only on the window's last micro-step
            self.model.set_requires_gradient_sync(micro == self.n - 1)
        loss = F.mse_loss(self.model(x), y)
        (loss / self.n).backward()
        self.loss += loss.item() / (self.n * self.dp)
        self.rows += len(y)

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}  # 2-D DTensors: the harness gathers them

    def optimizer_step(self):
        params = list(self.model.parameters())
        # The norm of the whole gradient: each gradient is a DTensor sharded over dp (FSDP2) and tp, so
        # get_total_norm's result is a partial sum still to be reduced over both; full_tensor() makes it one
        # number on every rank, each element counted once (a tp-replicated bias too).
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
        lr = self.opt.param_groups[0]["lr"]  # read before the step: the LR this step applies
        self.opt.step()
        self.sched.step()  # once per optimizer step, after it
        self.opt.zero_grad()
        loss = torch.tensor(self.loss, dtype=torch.float64)
        if self.dp > 1:
            dist.all_reduce(loss, group=self.mesh["dp"].get_group())  # the global batch's mean loss
        # every replica holds the same number of rows: the window's over every rank
        self.logged = {"loss": loss.item(), "grad_norm": norm.item(), "lr": lr, "rows": self.rows * self.dp}
        self.loss = 0.0
        self.rows = 0
        return loss

    def metrics(self):
        """What the last step logs: the global loss, the pre-clip norm, the LR, the window's rows over every rank."""
        return self.logged

    def params(self):
        return dict(self.model.named_parameters())


def counts(case):
    """Each micro-step: FSDP2's all-gather of its one unit over dp, Rowwise's all-reduce over tp. The boundary
    adds FSDP2's reduce-scatter over dp, the loss's all-reduce, and the gradient norm's partial sum reduced over
    each axis of more than one rank. One row for every backend: on gloo the reduce-scatter runs as an all-reduce,
    and the counter reads the row's reduce_scatter so (docs/design/distributed.md, "Count tables")."""
    rows = {"tp": verify.CountRow("Rowwise", before={}, boundary={})}  # a one-rank tp group reaches no c10d
    if case.mesh.tp > 1:
        rows["tp"] = verify.CountRow("Rowwise", before={"all_reduce": 1}, boundary={"all_reduce": 2})
    if case.mesh.dp > 1:
        rows["dp"] = verify.CountRow("FSDP2, root unit", before={"all_gather": 1},
                                     boundary={"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2})
    return rows


# metrics: what metrics() logs, and the threshold it clips at (the harness checks the scale the optimizer saw)
metrics = verify.Metrics(names=("loss", "grad_norm", "lr", "rows"), max_norm=MAX_NORM)
factory = verify.adapter(data=verify.data.regression(features=8), metrics=metrics,
                         distributed=verify.Distributed(mesh_axes=("dp", "tp"), counts=counts))(Trainer)
