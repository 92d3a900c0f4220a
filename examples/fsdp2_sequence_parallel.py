"""FSDP2 over dp + sequence-parallel tensor parallel over tp, as torchtitan lays out a block: an RMSNorm on the
rank's slice of the sequence (SequenceParallel), a Colwise layer that gathers the sequence, a Rowwise one that
reduces it. The norm's weight is replicated over tp and its gradient a Partial sum: FSDP2 all-reduces it over tp
where it reduce-scatters over dp. bf16 runs under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).

    pytest --pyargs verify --verify-trainer examples.fsdp2_sequence_parallel:factory -n auto
    python -m benchmarks.fsdp2_reduce_dtype      # which dtype that tp all-reduce runs in, at N = 1 and N > 1

On torch ≤ 2.13 the tp all-reduce runs in bf16 at N = 1 and in fp32 at N > 1 (pytorch #190626): a precision
difference within the bf16 bound, which the gates pass; the benchmark reports it.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import verify

SEQ, WIDTH, HIDDEN = 4, 4, 24  # each row's 16 features are a sequence of 4 positions of width 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x):  # x: (B, S_local, WIDTH), this tp rank's positions -> (B, 1)
        h = self.down(torch.tanh(self.up(self.norm(x))))  # (B, SEQ, 1): up gathers the sequence
        return h.mean(dim=1)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the full model; TP, then FSDP2, keep their shards
        self.model = Block().to(spec.device, spec.dtype)
        self.n = spec.accum_steps
        self.dp = spec.mesh.dp
        self.tp = spec.mesh.tp
        self.autocast = spec.precision == "bf16" and spec.mesh.size == 1
        self.loss = 0.0
        self.logged = {}
        self.fsdp = spec.mesh.size > 1  # at Mesh() (the 1×1 reference) the plain model, autocast for bf16
        self.tp_rank = 0
        if self.fsdp:
            self.mesh = verify.device_mesh(spec)  # dims ("dp", "pp", "tp")
            plan = {
                "norm": SequenceParallel(),  # input: this rank's positions, Shard(1); the weight replicated
                "up": ColwiseParallel(input_layouts=Shard(1)),  # all-gathers the sequence in forward
                "down": RowwiseParallel(output_layouts=Replicate()),
            }
            parallelize_module(self.model, self.mesh["tp"], plan)
            policy = MixedPrecisionPolicy()
            if spec.precision == "bf16":
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            fully_shard(self.model, mesh=self.mesh["dp"], mp_policy=policy)
            self.tp_rank = self.mesh["tp"].get_local_rank()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def micro_step(self, x, y, micro):
        x = x.view(len(x), SEQ, WIDTH)  # (B, 16) -> (B, SEQ, WIDTH)
        if self.fsdp:
            x = x.chunk(self.tp, dim=1)[self.tp_rank]  # sequence parallel: this rank's positions
            self.model.set_requires_gradient_sync(micro == self.n - 1)  # FSDP2 reduces at the boundary only
        with torch.autocast(x.device.type, torch.bfloat16, enabled=self.autocast):
            out = self.model(x)
        loss = F.mse_loss(out.float(), y.float())
        (loss / self.n).backward()
        self.loss += loss.item() / (self.n * self.dp)

    def grads(self):
        return {name: p.grad for name, p in self.model.named_parameters()}  # DTensors: the harness gathers them

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss = torch.tensor(self.loss, dtype=torch.float64)
        if self.dp > 1:
            dist.all_reduce(loss, group=self.mesh["dp"].get_group())  # the global batch's mean loss
        self.logged = {"loss": loss.item()}
        self.loss = 0.0
        return loss

    def metrics(self):
        return self.logged

    def params(self):
        return dict(self.model.named_parameters())


def counts(case):
    """Each micro-step over tp: the sequence's all-gather into `up`, its reduce-scatter in the backward, `down`'s
    all-reduce; the boundary adds the norm weight's Partial gradient all-reduced. Over dp, FSDP2's one unit: its
    all-gather each micro-step; the boundary adds its reduce-scatter and the loss's all-reduce. One row for every
    backend: gloo runs a reduce-scatter as an all-reduce, and the counter reads the row so (docs/design/distributed.md,
    "Count tables")."""
    rows = {"tp": verify.CountRow("sequence parallel", before={}, boundary={})}  # a one-rank tp group: no c10d
    if case.mesh.tp > 1:
        step = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}
        rows["tp"] = verify.CountRow("sequence parallel", before=step, boundary={**step, "all_reduce": 2})
    if case.mesh.dp > 1:
        rows["dp"] = verify.CountRow("FSDP2, root unit", before={"all_gather": 1},
                                     boundary={"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1})
    return rows


factory = verify.adapter(data=verify.data.regression(features=SEQ * WIDTH), metrics=verify.Metrics(names=("loss",)),
                         distributed=verify.Distributed(mesh_axes=("dp", "tp"), mesh_sizes={"tp": (2, 4)}, counts=counts),
                         numerics=verify.Numerics(precisions=("fp32", "bf16")))(Trainer)
