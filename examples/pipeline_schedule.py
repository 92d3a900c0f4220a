"""An 8-layer MLP in pipeline stages with torch.distributed.pipelining (gloo on CPU, NCCL on GPUs): the
schedule's micro-batches are the accumulation, several schedule.step calls the outer accumulation. The
schedule — GPipe, 1F1B, or Interleaved1F1B with 2 looped stages per rank — is the adapter's option, drawn
per case.

    pytest --pyargs verify --verify-trainer examples.pipeline_schedule:factory -n auto
    python -m verify.selftest --verify-trainer examples.pipeline_schedule:factory
"""
import torch
from hypothesis import strategies as st
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import verify

WIDTH, LAYERS = 8, 16  # Linear layers (each but the last with a Tanh): pp × stages per rank ≤ 16 (interleaved pp 8)


class Trainer:
    last = True  # Mesh() (the reference; the one-process gates, no group): the plain model, one "stage"

    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the whole model (same init), then keeps its stages
        blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS - 1)]
        self.stages = [torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, 1)).to(spec.device, spec.dtype)]
        self.n, self.chunks, self.batch, self.loss = spec.accum_steps, spec.pipeline_chunks, [], 0.0
        # scale_grads=False: the schedule's default divides EVERY .grad by chunks after each step, also what the
        # window's earlier steps accumulated (an exponential moving average, torchtitan #1733). Instead each micro
        # loss is divided by the window's N = chunks × outer, as in plain accumulation.
        self.loss_fn = lambda out, y: torch.nn.functional.mse_loss(out, y) / self.n
        # a step runs the forward and backward of its micro-batches and returns their (divided) losses
        self.step = lambda x, y, out: out.append(self.loss_fn(self.stages[0](x), y)) or out[0].backward() or out
        if spec.mesh.size > 1:
            mesh, n = verify.mesh.device_mesh(spec), (pp := spec.mesh.pp) * (1 + (spec.options is ScheduleInterleaved1F1B))
            own = range(mesh.get_local_rank("pp"), n, pp)  # looped: this rank holds stages rank, rank + pp, ...
            self.stages = [self.stages[0][LAYERS * s // n:LAYERS * (s + 1) // n] for s in own]
            stages = [PipelineStage(m, s, n, spec.device, group=mesh.get_group("pp")) for m, s in zip(self.stages, own)]
            # torch refuses 1F1B with fewer micro-batches than stages, where its order is GPipe's
            cls = ScheduleGPipe if spec.options is Schedule1F1B and self.chunks < pp else spec.options or ScheduleGPipe
            sched = cls(stages if n > pp else stages[0], self.chunks, loss_fn=self.loss_fn, scale_grads=False)
            # stage 0's rank feeds the inputs, the last stage's the targets (torch 2.11 refuses inputs elsewhere)
            self.step, self.last = lambda x, y, out: (sched.step(*[x][:own[0] == 0], **dict(target=y, losses=out) if self.last else {}), out)[1], stages[-1].is_last
        self.own = {k: p for m in self.stages for k, p in m.named_parameters()}  # slices keep the model's names
        self.opt = torch.optim.SGD(self.own.values(), lr=0.05, momentum=0.9)

    def micro_step(self, x, y, micro):
        self.batch.append((x, y))
        if (micro + 1) % self.chunks == 0:  # one schedule step over the buffered chunks (Mesh(): one chunk)
            (xs, ys), self.batch = (torch.cat(t) for t in zip(*self.batch)), []
            # Σ raw / N: the window's mean loss (0 off the last stage)
            self.loss = self.loss + sum((loss.detach() for loss in self.step(xs, ys, [])), xs.new_zeros(()))

    def grads(self):
        return {k: p.grad for k, p in self.own.items()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = self.loss, 0.0
        return loss if self.last else None  # the last stage knows the loss

    def params(self):
        return dict(self.own)


factory = verify.adapter(data=verify.data.regression(features=WIDTH), mesh_axes=("pp",), defaults=ScheduleGPipe,
                         options=st.sampled_from([ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B]))(Trainer)
