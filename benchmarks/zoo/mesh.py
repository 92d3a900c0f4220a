"""The zoo's mesh trainers, on the patterns of the recipes (examples/tensor_parallel.py, pipeline_schedule.py,
pipeline_dp.py, context_parallel.py) with the Recipe's optimizer, schedule, clipping and metrics:

    tp      DTensor Colwise / Rowwise over tp and loss_parallel (an MLP classifier), dp replicas averaged at the boundary
    pp      torch.distributed.pipelining (GPipe, 1F1B or Interleaved1F1B) over an MLP regressor; dp_pp: + dp replicas
    cp      the causal LM with each row's tokens split over cp (K and V all-gathered), the token mean over dp × cp

Each builds the plain model at Mesh() (the harness's 1 × 1 × 1 reference). The DeviceMesh comes from
verify.device_mesh(spec), as the guide says ("Meshes").
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import verify
from benchmarks.zoo import losses
from benchmarks.zoo.models import CLASSES, FEATURES, LM, OUTPUTS
from benchmarks.zoo.optim import optimizers, schedulers

TP_WIDTH, PP_LAYERS = 24, 8


class MeshTrainer:
    """What the three share: optimizers and schedules of the owned parameters, clipping by a global norm the
    subclass computes, the logged metrics."""

    recipe = None

    def setup(self, spec, params):
        r = self.recipe
        self.n, self.dp = spec.accum_steps, spec.mesh.dp
        self.opts = optimizers(r.optimizer, self.model, params)
        self.scheds = schedulers(r.schedule, self.opts)
        self.loss, self.rows, self.logged = 0.0, 0, {}

    def norm(self, params) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def step(self, params, loss, counts: dict):
        """Clip by the global norm, step, schedule, log; `counts` the window's rows / tokens over every rank."""
        r = self.recipe
        norm = self.norm(params)
        if r.clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, r.clip, norm)
        lr = self.opts[0].param_groups[0]["lr"]
        for opt in self.opts:
            opt.step()
        for s in self.scheds:
            s.step()
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        self.logged = {"grad_norm": float(norm), "lr": lr, **counts}
        if loss is not None:
            self.logged["loss"] = float(loss)
        if r.clip is not None:
            self.logged["clip_coef"] = min(1.0, r.clip / (float(norm) + 1e-6))

    def metrics(self):
        return {k: v for k, v in self.logged.items() if k in self.recipe.metrics}


class TPTrainer(MeshTrainer):
    def __init__(self, spec):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        torch.manual_seed(spec.seed)
        self.model = nn.Sequential(nn.Linear(FEATURES, TP_WIDTH), nn.Tanh(), nn.Linear(TP_WIDTH, TP_WIDTH), nn.Tanh(),
                                   nn.Linear(TP_WIDTH, CLASSES)).to(spec.device, spec.dtype)
        self.mesh = None
        if spec.mesh.size > 1:
            self.mesh = verify.device_mesh(spec)
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(use_local_output=False)}
            parallelize_module(self.model, self.mesh["tp"], plan)
        self.setup(spec, self.model.parameters())

    def micro_step(self, x, y, micro):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(self.model(x), y)
            (loss / self.n if self.n > 1 else loss).backward()
        self.loss += loss.item() / (self.n * self.dp)
        self.rows += len(y)
        if micro == self.n - 1 and self.dp > 1:
            group = self.mesh["dp"].get_group()
            for p in self.model.parameters():
                dist.all_reduce(p.grad.to_local(), group=group)
                p.grad.div_(self.dp)
            total = torch.tensor(self.loss, dtype=torch.float64)
            dist.all_reduce(total, group=group)
            self.loss = total.item()

    def norm(self, params):
        from torch.distributed.tensor import DTensor

        norm = super().norm(params)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        loss = self.loss
        self.step(list(self.model.parameters()), loss, {"rows": self.rows * self.dp})
        self.loss, self.rows = 0.0, 0
        return loss

    def params(self):
        return dict(self.model.named_parameters())


def tp_counts(case):
    """tp's all-reduces per micro-step (Rowwise's output, the head's input gradient, loss_parallel's three) and
    at the boundary the norm's; a one-rank tp group: loss_parallel's only (examples/tensor_parallel.py)."""
    if case.mesh.tp > 1:
        return {"tp": verify.CountRow("Colwise/Rowwise + loss parallel", before={"all_reduce": 5},
                                      boundary={"all_reduce": 6})}
    return {"tp": verify.CountRow("loss parallel, one rank", before={"all_reduce": 3}, boundary={"all_reduce": 3})}


class PPTrainer(MeshTrainer):
    """An MLP regressor in pipeline stages; the schedule's micro-batches are the accumulation, several
    schedule.step calls the outer one; scale_grads=False and each micro-loss ÷ N."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        blocks = [nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh()) for _ in range(PP_LAYERS - 1)]
        self.model = nn.Sequential(*blocks, nn.Linear(FEATURES, OUTPUTS)).to(spec.device, spec.dtype)
        self.chunks, self.buffered = spec.pipeline_chunks, []
        self.schedule, self.first, self.last, self.pp_group, self.dp_group = None, True, True, None, None
        self.stages = [self.model]
        if spec.mesh.size > 1:
            self.build(spec)
        self.own = {k: p for stage in self.stages for k, p in stage.named_parameters()}
        self.setup(spec, self.own.values())

    def build(self, spec):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        mesh = verify.device_mesh(spec)
        pp, kind = spec.mesh.pp, self.recipe.pipeline
        looped = kind == "interleaved"
        n_stages = 2 * pp if looped else pp
        own = range(mesh.get_local_rank("pp"), n_stages, pp)
        self.stages = [self.model[PP_LAYERS * s // n_stages:PP_LAYERS * (s + 1) // n_stages] for s in own]
        stages = [PipelineStage(m, s, n_stages, spec.device, group=mesh.get_group("pp")) for m, s in zip(self.stages, own)]
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[kind]
        if schedule is Schedule1F1B and self.chunks < pp:
            schedule = ScheduleGPipe  # torch refuses 1F1B with fewer micro-batches than stages
        self.schedule = schedule(stages if looped else stages[0], self.chunks, loss_fn=self.loss_fn, scale_grads=False)
        self.first, self.last, self.pp_group = own[0] == 0, stages[-1].is_last, mesh.get_group("pp")
        if spec.mesh.dp > 1:
            self.dp_group = mesh["dp"].get_group()

    def loss_fn(self, output, target):
        return F.mse_loss(output, target) / self.n

    def micro_step(self, x, y, micro):
        self.buffered.append((x, y))
        self.rows += len(y)
        if (micro + 1) % self.chunks:
            return
        xs, ys = torch.cat([a for a, _ in self.buffered]), torch.cat([b for _, b in self.buffered])
        self.buffered, out = [], []
        if self.schedule is None:
            out.append(self.loss_fn(self.model(xs), ys) if self.n > 1 else F.mse_loss(self.model(xs), ys))
            out[0].backward()
        elif self.last:
            self.schedule.step(*([xs] if self.first else []), target=ys, losses=out)
        else:
            self.schedule.step(*([xs] if self.first else []))
        for loss in out:
            self.loss = self.loss + loss.detach()
        if micro == self.n - 1 and self.dp_group is not None:  # the boundary: this stage's mean over replicas
            for t in [*self.grads().values(), *([self.loss] if torch.is_tensor(self.loss) else [])]:
                t.div_(self.dp)
                dist.all_reduce(t, group=self.dp_group)

    def norm(self, params):
        sumsq = sum(p.grad.pow(2).sum() for p in params)  # the stages own disjoint parameters
        if self.pp_group is not None:
            dist.all_reduce(sumsq, group=self.pp_group)
        return sumsq.sqrt()

    def grads(self):
        return {k: p.grad for k, p in self.own.items()}

    def optimizer_step(self):
        loss = self.loss if self.last else None
        self.step(list(self.own.values()), loss, {"rows": self.rows * self.dp})
        self.loss, self.rows = 0.0, 0
        return loss

    def params(self):
        return dict(self.own)


class GatherTokens(torch.autograd.Function):
    """(B, H, T, hd) on each cp rank -> (B, H, T·cp, hd) in position order; the backward all-reduces the whole
    gradient (gloo has no reduce-scatter) and keeps this rank's T tokens."""

    @staticmethod
    def forward(ctx, t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.T = group, dist.get_rank(group), t.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.T:(ctx.rank + 1) * ctx.T], None


class CPTrainer(MeshTrainer):
    """Σ cross-entropy of this rank's tokens; at micro-step N-1 the gradients, loss sum and valid count are
    all-reduced over cp, then dp, in one flat tensor, and divided once by the window's count."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = LM(self.recipe.arch).to(spec.device, spec.dtype)
        self.cp_rank, self.cp_group, self.dp_group = 0, None, None
        if spec.mesh.size > 1:
            mesh = verify.device_mesh(spec)
            if spec.mesh.cp > 1:
                self.cp_group, self.cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
            if spec.mesh.dp > 1:
                self.dp_group = mesh["dp"].get_group()
        self.setup(spec, self.model.parameters())
        self.total, self.count, self.window = 0.0, 0, (float("nan"), 0, 0)

    def gather(self, k, v):
        k, v = GatherTokens.apply(k, self.cp_group), GatherTokens.apply(v, self.cp_group)
        return k, v, torch.arange(k.shape[2], device=k.device)

    def micro_step(self, x, y, micro):
        T = x.shape[1]
        positions = torch.arange(self.cp_rank * T, (self.cp_rank + 1) * T, device=x.device)
        logits = self.model(x, positions, gather=self.gather if self.cp_group is not None else None)
        ce = losses.ce_sum(logits, y)
        ce.backward()
        self.total += ce.item()
        self.count += int((y != losses.IGNORE).sum())
        self.rows += len(y)
        if micro == self.n - 1:
            self.reduce()

    def reduce(self):
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        extra = torch.tensor([self.total, float(self.count), float(self.rows)], dtype=params[0].dtype,
                             device=params[0].device)
        flat = torch.cat([p.grad.flatten() for p in params] + [extra])
        for group in (self.cp_group, self.dp_group):
            if group is not None:
                dist.all_reduce(flat, group=group)
        total, count, rows = flat[-3].item(), flat[-2].item(), flat[-1].item()
        torch.nn.utils.vector_to_parameters(flat[:-3] / (count or 1.0), [p.grad for p in params])
        self.window = (total / count if count else float("nan"), int(count), int(rows))

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        loss, count, rows = self.window
        cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        self.logged = {}  # a window without a valid target is no step, and logs nothing
        if count:
            self.step([p for p in self.model.parameters() if p.grad is not None], loss,
                      {"tokens": count, "rows": rows // cp})
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        self.total, self.count, self.rows, self.window = 0.0, 0, 0, (float("nan"), 0, 0)
        return loss

    def params(self):
        return dict(self.model.named_parameters())


def cp_counts(case):
    """Per micro-step over cp: K and V all-gathered, their gradients all-reduced; the boundary one all-reduce
    more (the window's sums). dp: the boundary-only rule (examples/context_parallel.py)."""
    if case.mesh.cp == 1:
        return {}
    return {"cp": verify.CountRow("cp: K/V gathered, the sums reduced once", before={"all_gather": 2, "all_reduce": 2},
                                  boundary={"all_gather": 2, "all_reduce": 3})}
