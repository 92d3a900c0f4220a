"""A tiny pipelined MLP and its planted bugs, for the mesh gate (torch.distributed.pipelining, gloo / CPU).
Registered in planted/registry.py; plain torch, no xtrain_core: the mesh gate's own proof.

    pipe            Mesh(dp, pp, 1): stages of an 8-layer MLP, ScheduleGPipe with scale_grads=False and each
                    micro-batch's mean loss divided by N, the dp all-reduce at micro-step N-1: correct
    pipe_ema        the same with the schedule's default scale_grads=True and the loss divided by the OUTER
                    steps: every schedule.step divides ALL .grad by its chunks, so a window of ≥ 2 outer steps
                    weighs its earlier steps by 1/chunks again (torchtitan #1733's moving average)
    pipe_owned_twice  stage 0 also reports one of its layers under the name of stage 1's first: "owned twice"
    pipe_no_loss    the last stage returns None from optimizer_step()
    pipe_pp_chatter   every schedule step also all-reduces its micro losses over the pp group: a collective
                    the pp row does not name
    pipe_world_barrier  a barrier on the default (world) group every micro-step: on no mesh axis
    pipe_rescales_received  every stage but the last divides the gradient its output receives by N again, on
                    top of the loss's 1/N: stage s of pp gets 1/N^(pp-s) (DeepSpeed #8152 / #8154)
    pipe_grads_wiped  the stages drop their gradients (param.grad = None) before every schedule step, as a
                    stage re-initialisation does: only the window's last schedule step trains, and the loss
                    looks right (NeMo Automodel #3530)
    pipe_divides_again  the last stage's loss divides by N; every earlier stage divides its boundary
                    gradient by N once more
    tp              Mesh(dp, 1, tp): Colwise / Rowwise parallel MLP (DTensor), the dp all-reduce of the local
                    shards at micro-step N-1: correct
    tp_extra_reduce   the micro loss all-reduced over tp as well ("for logging"): one reduction over tp
                    more than the tp row's
    tp_eager_dp     the dp all-reduce on every micro-step: right numbers, but dp is not boundary-only

At Mesh() (the reference) every trainer is the plain model: no process group needed.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from verify import CountRow, device_mesh

FEATURES, HIDDEN, BLOCKS = 4, 8, 8  # blocks: Linear+Tanh ×7, then Linear(HIDDEN, 1): every pp ≤ 8 has a block per stage
TP_HIDDEN = 840  # lcm(1..8): Colwise / Rowwise shard it evenly at every tp a world of up to 8 ranks can draw


def _full(spec) -> torch.nn.Sequential:
    torch.manual_seed(spec.seed)
    dims = [FEATURES] + [HIDDEN] * (BLOCKS - 1) + [1]
    layers = []
    for i in range(BLOCKS):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < BLOCKS - 1:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).to(spec.device, spec.dtype)


class Pipe:
    ema = False  # the planted bug: scale_grads=True with the loss over outer steps only
    steal = False  # the planted bug: stage 0 claims stage 1's first layer too
    lose_loss = False  # the planted bug: no loss from the last stage
    chatter = False  # the planted bug: an all-reduce over pp after every schedule step
    barrier = False  # the planted bug: a barrier on the world group every micro-step

    def __init__(self, spec):
        full = _full(spec)
        self.N, self.chunks = spec.accum_steps, spec.pipeline_chunks
        m = spec.mesh
        self.pp = m.pp
        self.buf, self.loss = [], 0.0
        if m.size == 1:
            self.own = dict(full.named_parameters())
            self.model, self.stage_i, self.dp_group = full, 0, None
        else:
            mesh = device_mesh(spec)
            self.stage_i = mesh.get_local_rank("pp")
            self.dp_group = mesh["dp"].get_group() if m.dp > 1 else None
            self.dp = m.dp
            per = [len(c) for c in torch.arange(BLOCKS).tensor_split(m.pp)]
            first = sum(per[:self.stage_i])  # the first block of this stage; module index = 2·block
            lo, hi = 2 * first, min(2 * (first + per[self.stage_i]), len(full))
            sub = torch.nn.Sequential(*[full[i] for i in range(lo, hi)])
            self.own = {f"{lo + int(n.split('.')[0])}.{n.split('.', 1)[1]}": p for n, p in sub.named_parameters()}
            if self.steal and self.stage_i == 0 and m.pp > 1:
                self.own.update({f"{hi}.{n}": p for n, p in full[lo + 2].named_parameters()})  # its own layer, misnamed
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            self.pp_group = mesh["pp"].get_group()
            stage = PipelineStage(sub, self.stage_i, m.pp, torch.device(spec.device), group=self.pp_group)
            div = self.N // self.chunks if self.ema else self.N  # ema: leaves the 1/chunks to scale_grads
            self.schedule = ScheduleGPipe(stage, n_microbatches=self.chunks, scale_grads=self.ema,
                                          loss_fn=lambda out, y: F.mse_loss(out, y) / div)
            self.model = sub
        self.opt = torch.optim.SGD([p for p in self.model.parameters()], lr=0.1, momentum=0.9)

    def micro_step(self, x, y, micro):
        if not hasattr(self, "schedule"):  # one rank: the plain model
            loss = F.mse_loss(self.model(x), y) / self.N
            loss.backward()
            self.loss += loss.item()
        else:
            self.buf.append((x, y))
            if (micro + 1) % self.chunks == 0:  # a schedule step over the buffered micro-batches
                xs, ys = torch.cat([b[0] for b in self.buf]), torch.cat([b[1] for b in self.buf])
                self.buf, losses, last = [], [], self.stage_i == self.pp - 1
                self.schedule.step(*((xs,) if self.stage_i == 0 else ()),
                                   **(dict(target=ys, losses=losses) if last else {}))
                # the step loss is right in both: the bug is in the gradients alone
                self.loss += sum(v.item() for v in losses) / (self.chunks if self.ema else 1) if last else 0.0
                if self.chatter:
                    dist.all_reduce(torch.zeros(1), group=self.pp_group)
            if self.barrier:
                dist.barrier()
        if micro == self.N - 1 and self.dp_group is not None:  # the boundary: the replicas' mean gradient
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad /= self.dp

    def grads(self):
        return {n: p.grad for n, p in self.own.items()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss, self.loss = self.loss, 0.0
        if self.stage_i != self.pp - 1 or self.lose_loss:
            return None
        return _dp_mean(loss, self.dp_group)

    def params(self):
        return {n: p.detach() for n, p in self.own.items()}


def _dp_mean(loss: float, group) -> float:
    """The step loss averaged over the dp replicas (one all-reduce at the boundary; alone: as is)."""
    if group is None:
        return loss
    t = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


class PipeEma(Pipe):
    ema = True


class PipeOwnedTwice(Pipe):
    steal = True


class PipeNoLoss(Pipe):
    lose_loss = True


class PipeChatter(Pipe):
    chatter = True


class PipeBarrier(Pipe):
    barrier = True


class PipeRescalesReceived(Pipe):
    def __init__(self, spec):
        super().__init__(spec)
        if self.stage_i < self.pp - 1:  # DeepSpeed's per-stage output hook: the received gradient ÷ N again
            self.model.register_forward_hook(lambda module, args, out: out.register_hook(lambda g: g / self.N) and None)


class PipeGradsWiped(Pipe):
    def micro_step(self, x, y, micro):
        if (micro + 1) % self.chunks == 0:  # the stage re-initialised before its schedule step: param.grad = None
            for p in self.model.parameters():
                p.grad = None
        super().micro_step(x, y, micro)


class PipeDividesAgain(Pipe):
    def micro_step(self, x, y, micro):
        super().micro_step(x, y, micro)
        if micro == self.N - 1 and self.stage_i < self.pp - 1:  # the boundary: ÷ N on an already ÷ N gradient
            for p in self.model.parameters():
                p.grad /= self.N


# torch 2.13's PipelineStage infers shapes in its first schedule step: 3 more sends and 3 more receives per
# neighbouring stage (seen on gloo, every mesh and chunk count tried); then each micro-batch sends its
# activation forward and its gradient back: per neighbour, one send and one receive per micro-batch.
SHAPE_INFERENCE = 3


def pipe_counts(case):
    """The GPipe schedule's p2p per outer step, by stage; dp keeps the default (boundary-only) row."""
    pp, c = case.mesh.pp, case.pipeline_chunks

    def row(dp_i, pp_i, tp_i):
        links = (pp_i > 0) + (pp_i < pp - 1)
        each = {"send": c * links, "recv": c * links} if links else {}
        return CountRow(f"GPipe stage {pp_i} of {pp}", before=each, boundary=each,
                        first_micro={k: SHAPE_INFERENCE * links for k in each})

    return {"pp": row}


class Tp:
    """Colwise / Rowwise tensor parallel MLP on the tp axis, plain data parallel over dp."""

    hidden = TP_HIDDEN
    extra = False  # the planted bug: the micro loss all-reduced over tp too
    eager_dp = False  # the planted bug: the dp all-reduce on every micro-step (right numbers, N× the traffic)

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, self.hidden), torch.nn.Tanh(),
                                         torch.nn.Linear(self.hidden, 1)).to(spec.device, spec.dtype)
        self.N, self.m, self.loss, self.dp_group, self.tp_group = spec.accum_steps, spec.mesh, 0.0, None, None
        if spec.mesh.size > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = device_mesh(spec)
            self.tp_group = mesh["tp"].get_group()
            self.dp_group = mesh["dp"].get_group() if spec.mesh.dp > 1 else None
            if spec.mesh.tp > 1:
                parallelize_module(self.model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x), y) / self.N
        loss.backward()
        if self.extra and self.tp_group is not None:
            dist.all_reduce(loss.detach().clone(), group=self.tp_group)
        self.loss += loss.item()
        if (micro == self.N - 1 or self.eager_dp) and self.dp_group is not None:  # the replicas' mean, per shard
            for p in self.model.parameters():
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=self.dp_group)
                g /= self.m.dp

    def grads(self):
        return {n: p.grad for n, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss, self.loss = self.loss, 0.0
        return _dp_mean(loss, self.dp_group)

    def params(self):
        return {n: p.detach() for n, p in self.model.named_parameters()}


class TpExtraReduce(Tp):
    extra = True


class TpEagerDp(Tp):
    eager_dp = True


class Tp16(Tp):
    hidden = 16  # torch refuses an uneven DTensor shard: tp=3 cannot split it (the adapter says so: mesh_sizes)


def tp_counts(case):
    """Per micro-step, the forward's one all-reduce of the Rowwise output's partial sums (and nothing in the
    backward: the inputs need no gradient)."""
    n = case.pipeline_chunks  # one per micro-step of the outer step
    each = {"all_reduce": n} if case.mesh.tp > 1 else {}
    return {"tp": CountRow("Colwise/Rowwise MLP", before=each, boundary=each)}


DATA = verify.data.regression(features=FEATURES)
_AXES = ("dp", "pp")
pipe = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts, name="mesh_pipe")(Pipe)  # correct: must pass
pipe_ema = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts, name="broken_mesh.scale_grads_ema")(PipeEma)
pipe_owned_twice = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts,
                                  name="broken_mesh.owned_twice")(PipeOwnedTwice)
pipe_no_loss = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts, name="broken_mesh.no_loss")(PipeNoLoss)
pipe_pp_chatter = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts,
                                 name="broken_mesh.pp_chatter")(PipeChatter)
pipe_world_barrier = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts,
                                    name="broken_mesh.world_barrier")(PipeBarrier)
pipe_rescales_received = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts,
                                       name="broken_mesh.rescales_received")(PipeRescalesReceived)
pipe_grads_wiped = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts,
                                 name="broken_mesh.grads_wiped")(PipeGradsWiped)
pipe_divides_again = verify.adapter(data=DATA, mesh_axes=_AXES, counts=pipe_counts,
                                   name="broken_mesh.divides_again")(PipeDividesAgain)
tp = verify.adapter(data=DATA, mesh_axes=("dp", "tp"), counts=tp_counts, name="mesh_tp")(Tp)  # correct: must pass
tp_extra_reduce = verify.adapter(data=DATA, mesh_axes=("dp", "tp"), counts=tp_counts,
                                 name="broken_mesh.tp_extra_reduce")(TpExtraReduce)
tp_eager_dp = verify.adapter(data=DATA, mesh_axes=("dp", "tp"), counts=tp_counts, name="broken_mesh.eager_dp")(TpEagerDp)
tp16 = verify.adapter(data=DATA, mesh_axes=("dp", "tp"), counts=tp_counts, mesh_sizes={"tp": (2, 4, 8, 16)},
                     name="mesh_tp16")(Tp16)  # correct, hidden 16: tp=3 is never drawn, a skip where asked for
# the harness's own tests: a pipeline that declares no counts (its pp axis goes unjudged), one keyed wrongly
pipe_uncounted = verify.adapter(data=DATA, mesh_axes=_AXES, name="mesh_pipe_uncounted")(Pipe)
pipe_bad_counts = verify.adapter(data=DATA, mesh_axes=_AXES, counts=lambda case: {"stage": None},
                                 name="mesh_pipe_bad_counts")(Pipe)
