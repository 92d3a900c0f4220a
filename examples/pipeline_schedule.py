"""A 16-layer MLP in pipeline stages with torch.distributed.pipelining (gloo on CPU, NCCL on GPUs): the
schedule's micro-batches are the accumulation, several schedule.step calls the outer accumulation. The
schedule — GPipe, 1F1B, or Interleaved1F1B with 2 looped stages per rank — is the adapter's option, drawn
per case.

    pytest --pyargs verify --verify-trainer examples.pipeline_schedule:factory -n auto
    python -m verify.selftest --verify-trainer examples.pipeline_schedule:factory
"""
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import verify

WIDTH = 8
LAYERS = 16  # Linear layers (each but the last with a Tanh): pp × stages per rank ≤ 16 (interleaved: pp ≤ 8)
SCHEDULES = [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B]


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
        if spec.mesh.size > 1:
            self.build_schedule(spec, model)
        else:
            # Mesh() (the reference, the one-process gates: no group): the plain model is the one stage
            self.stages = [model]
            self.schedule = None
            self.first = True
            self.last = True
        # this rank's parameters: the stages' slices keep the model's names
        self.own = {name: p for stage in self.stages for name, p in stage.named_parameters()}
        self.opt = torch.optim.SGD(self.own.values(), lr=0.05, momentum=0.9)

    def build_schedule(self, spec, model):
        mesh = verify._internal.ranks.mesh.device_mesh(spec)
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
        self.opt.step()
        self.opt.zero_grad()
        loss = self.loss
        self.loss = 0.0
        if not self.last:
            return None  # only the last stage knows the loss
        return loss

    def params(self):
        return dict(self.own)


factory = verify.adapter(data=verify.data.regression(features=WIDTH), mesh_axes=("pp",), defaults=ScheduleGPipe,
                         options=st.sampled_from(SCHEDULES))(Trainer)
