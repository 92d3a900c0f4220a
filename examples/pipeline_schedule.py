"""An 8-layer MLP split into pipeline stages with torch.distributed.pipelining (gloo on CPU, NCCL on GPUs):
the schedule's micro-batches are the accumulation, several schedule.step calls the outer accumulation, and
dp replicas of the pipeline reduce their stages' gradients once, at the boundary.

    pytest --pyargs verify --verify-trainer examples.pipeline_schedule:factory -n auto
    python -m verify.selftest --verify-trainer examples.pipeline_schedule:factory
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import strategies as st
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleLoopedBFS)

import verify

WIDTH, LAYERS = 8, 8  # Linear layers; pp × stages per rank ≤ LAYERS


def schedule(strategy, stages, chunks, loss_fn):
    # torch refuses 1F1B with fewer micro-batches than stages (its order is GPipe's then) and Interleaved1F1B
    # with chunks not a multiple of chunks // pp (Looped BFS runs the same looped stages, no such rule)
    pp = stages[0].group_size
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B if chunks >= pp else ScheduleGPipe,
           "interleaved": ScheduleInterleaved1F1B if chunks < pp or chunks % (chunks // pp) == 0 else ScheduleLoopedBFS}
    many = strategy == "interleaved"
    # scale_grads=False: the schedule's default divides EVERY .grad by chunks after each step, also what earlier
    # steps of the window accumulated (an exponential moving average, torchtitan #1733). Instead each micro loss
    # is divided by the window's N = chunks × outer, as in plain accumulation (no scale at all when N == 1).
    return cls[strategy](stages if many else stages[0], chunks, loss_fn=loss_fn, scale_grads=False)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)  # every rank builds the whole model (same init), then keeps its stages
        dims = [WIDTH] * LAYERS + [1]
        layers = sum(([torch.nn.Linear(a, b), torch.nn.Tanh()] for a, b in zip(dims, dims[1:])), [])[:-1]
        full = torch.nn.Sequential(*layers).to(spec.device, spec.dtype)  # slices keep the full model's names
        mesh, per_rank = verify.mesh.device_mesh(spec), 2 if spec.options == "interleaved" else 1
        pp, rank, self.dp = mesh.size(1), mesh.get_local_rank("pp"), mesh.get_group("dp")
        n = pp * per_rank
        cut = [2 * (LAYERS * s // n) for s in range(n)] + [len(full)]
        self.stages = [full[cut[s]:cut[s + 1]] for s in range(rank, n, pp)]  # looped: stages rank, rank + pp
        self.n, self.chunks, self.batch, self.loss = spec.accum_steps, spec.pipeline_chunks, [], 0.0
        loss_fn = lambda out, y: F.mse_loss(out, y) if self.n == 1 else F.mse_loss(out, y) / self.n  # noqa: E731
        stages = [PipelineStage(m, s, n, torch.device(spec.device), group=mesh.get_group("pp"))
                  for m, s in zip(self.stages, range(rank, n, pp))]
        self.first, self.last = stages[0].is_first, stages[-1].is_last
        self.schedule = schedule(spec.options or "gpipe", stages, self.chunks, loss_fn)
        self.params_ = {k: p for m in self.stages for k, p in m.named_parameters()}
        self.opt = torch.optim.SGD(self.params_.values(), lr=0.05, momentum=0.9)

    def micro_step(self, x, y, micro):
        self.batch.append((x, y))
        if (micro + 1) % self.chunks == 0:  # a schedule step over the buffered chunks: stage 0 inputs, last targets
            xs, ys = (torch.cat(t) for t in zip(*self.batch))
            losses, self.batch = [], []
            self.schedule.step(*[xs][:self.first], target=ys if self.last else None, losses=losses)
            self.loss = self.loss + sum(loss.detach() for loss in losses)  # the raw micro losses / N: their mean over the window
        if micro == self.n - 1 and dist.get_world_size(self.dp) > 1:  # the boundary: dp replicas average once
            for g in self.grads().values():
                dist.all_reduce(g, group=self.dp)
                g /= dist.get_world_size(self.dp)

    def grads(self):
        return {k: p.grad for k, p in self.params_.items()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = self.loss, 0.0
        if self.last and dist.get_world_size(self.dp) > 1:
            dist.all_reduce(loss, group=self.dp)
            loss = loss / dist.get_world_size(self.dp)
        return loss if self.last else None

    def params(self):
        return dict(self.params_)


factory = verify.adapter(data=verify.data.regression(features=WIDTH), mesh_axes=("dp", "pp"),
                         options=st.sampled_from(["gpipe", "1f1b", "interleaved"]), defaults="gpipe")(Trainer)
