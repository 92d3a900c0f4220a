"""A 16-layer MLP in pipeline stages with torch.distributed.pipelining (gloo on CPU, NCCL on GPUs): the
schedule's micro-batches are the accumulation, several schedule.step calls the outer accumulation. The
schedule — GPipe, 1F1B, or Interleaved1F1B with 2 looped stages per rank — is the adapter's option, drawn
per case. Clipped by the whole model's norm over the stages, which metrics() logs.

    pytest --pyargs verify --verify-trainer examples.pipeline_schedule:factory -n auto
    python -m verify.selftest --verify-trainer examples.pipeline_schedule:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import verify

WIDTH = 8
LAYERS = 16  # Linear layers (each but the last with a Tanh): pp × stages per rank ≤ 16 (interleaved: pp ≤ 8)
SCHEDULES = [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B]
MAX_NORM = 4.0  # the clip threshold; the drawn cases' norms straddle it, so clipped and unclipped steps are checked


def warmup(step):
    """The LR factor of a 3-step linear warm-up (the LR moves, so logging the wrong step's would show)."""
    return min(1.0, (step + 1) / 3)


def build_model(spec):
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS - 1)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, 1)).to(spec.device, spec.dtype)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the whole model (same init), then keeps its stages
        model = build_model(spec)
        self.n = spec.accum_steps
        self.chunks = spec.pipeline_chunks
        self.buffered = []
        self.loss = 0.0
        self.rows = 0
        self.replicas = spec.mesh.dp  # examples/pipeline_dp.py's dp replicas (here 1)
        self.logged = {}
        if spec.mesh.size > 1:
            self.build_schedule(spec, model)
        else:
            # Mesh() (the reference, the one-process gates: no group): the plain model is the one stage
            self.stages = [model]
            self.schedule = None
            self.first = True
            self.last = True
            self.pp_group = None
        # this rank's parameters: the stages' slices keep the model's names
        self.own = {name: p for stage in self.stages for name, p in stage.named_parameters()}
        self.opt = torch.optim.SGD(self.own.values(), lr=0.05, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup)

    def build_schedule(self, spec, model):
        mesh = verify.device_mesh(spec)
        pp = spec.mesh.pp
        looped = spec.options is ScheduleInterleaved1F1B
        n_stages = 2 * pp if looped else pp
        # looped: this rank holds stages rank, rank + pp, ...
        own = range(mesh.get_local_rank("pp"), n_stages, pp)
        self.stages = [model[LAYERS * s // n_stages:LAYERS * (s + 1) // n_stages] for s in own]
        stages = [PipelineStage(m, s, n_stages, spec.device, group=mesh.get_group("pp"))
                  for m, s in zip(self.stages, own)]
        schedule = spec.options or ScheduleGPipe
        if schedule is Schedule1F1B and self.chunks < pp:
            # torch refuses 1F1B with fewer micro-batches than stages, where its order is GPipe's
            schedule = ScheduleGPipe
        # scale_grads=False: the schedule's default divides EVERY .grad by chunks after each step, also what
        # the window's earlier steps accumulated (an exponential moving average, torchtitan #1733). Instead
        # loss_fn divides each micro-batch's loss by the window's N = chunks × outer, as plain accumulation does.
        self.schedule = schedule(stages if looped else stages[0], self.chunks, loss_fn=self.loss_fn,
                                 scale_grads=False)
        self.first = own[0] == 0
        self.last = stages[-1].is_last
        self.pp_group = mesh.get_group("pp")

    def loss_fn(self, output, target):
        return F.mse_loss(output, target) / self.n

    def schedule_step(self, xs, ys):
        """The forward and backward of this step's micro-batches; returns their losses (÷ N), none off the
        last stage."""
        losses = []
        if self.schedule is None:  # Mesh(): the plain model, one chunk
            losses.append(self.loss_fn(self.stages[0](xs), ys))
            losses[0].backward()
            return losses
        # stage 0's rank feeds the inputs, the last stage's rank the targets (torch 2.11 refuses inputs elsewhere)
        inputs = [xs] if self.first else []
        if self.last:
            self.schedule.step(*inputs, target=ys, losses=losses)
        else:
            self.schedule.step(*inputs)
        return losses

    def micro_step(self, x, y, micro):
        self.buffered.append((x, y))
        self.rows += len(y)
        if (micro + 1) % self.chunks == 0:  # one schedule step over the buffered chunks (Mesh(): one chunk)
            xs = torch.cat([x for x, _ in self.buffered])
            ys = torch.cat([y for _, y in self.buffered])
            self.buffered = []
            losses = self.schedule_step(xs, ys)
            # Σ raw / N over the window: its mean loss (0 off the last stage)
            step_loss = xs.new_zeros(())
            for loss in losses:
                step_loss = step_loss + loss.detach()
            self.loss = self.loss + step_loss

    def grads(self):
        return {name: p.grad for name, p in self.own.items()}

    def optimizer_step(self):
        params = list(self.own.values())
        # The stages own disjoint parameters: Σg² of this rank's, summed over the pp group, is the whole model's
        # (each parameter once), so every stage clips by the same norm. (The dp replicas, in pipeline_dp.py,
        # hold the same averaged gradient: summing over them too would count each parameter dp times.)
        sumsq = sum(p.grad.pow(2).sum() for p in params)
        if self.pp_group is not None:
            dist.all_reduce(sumsq, group=self.pp_group)
        norm = sumsq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
        lr = self.opt.param_groups[0]["lr"]  # read before the step: the LR this step applies
        self.opt.step()
        self.sched.step()  # once per optimizer step, after it
        self.opt.zero_grad()
        loss = self.loss
        # every replica holds the same number of rows: the window's over every rank
        self.logged = {"grad_norm": norm.item(), "lr": lr, "rows": self.rows * self.replicas}
        if self.last:
            self.logged["loss"] = loss.item()  # only the last stage knows the loss: the others log none
        self.loss = 0.0
        self.rows = 0
        if not self.last:
            return None
        return loss

    def metrics(self):
        """What the last step logs: the pre-clip norm, the LR, the window's rows over every rank, and on the last
        stage the loss."""
        return self.logged

    def params(self):
        return dict(self.own)


# metrics: what metrics() logs, and the threshold it clips at (the harness checks the scale the optimizer saw)
metrics = verify.Metrics(names=("loss", "grad_norm", "lr", "rows"), max_norm=MAX_NORM)
factory = verify.adapter(data=verify.data.regression(features=WIDTH), distributed=verify.Distributed(mesh_axes=("pp",)),
                         defaults=ScheduleGPipe,
                         options=st.sampled_from(SCHEDULES), metrics=metrics)(Trainer)
