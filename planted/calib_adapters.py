"""Small MLP trainers of real framework behaviour the float64 checks must judge at the precision each has
(tests/harness/test_calibration.py), a real 1e-5 error they must still reject, and the declarations of issue 15.
None of them declares anything about its float64 precision: a float64 run is judged at what an fp32 run resolves.

    hf_style          HF's ForCausalLMLoss: the loss on `logits.float()`, a downcast on a float64 model
    fabric_64_true    Lightning Fabric precision="64-true": the forward's output cast to float32
    fp32_constant     `loss * torch.tensor(1 / N)`: a float32 constant (no twin can reveal it); fp32_constant_dp on ranks
    off_by_1e5        accumulation 1e-5 relative off (a real error), with the same float32 constant
    per_rank_sched    Accelerate's prepared scheduler: steps once per RANK per optimizer step, declared
    per_rank_undeclared  the same without the declaration (must fail at W > 1)
    per_rank_unemulated  declared, but its one-process reference ignores Spec.schedule_world (must fail)
    dropout           train-mode dropout drawn from the global RNG: two identical runs differ
    batch_norm        BatchNorm1d in train mode: deterministic, and a true non-equivalence (per-micro-batch stats)

Every trainer is the textbook loop (backward of loss / N, the optimizer at the boundary) with
partial_grads(), and reduces its gradients over the default group at the boundary when there is one.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import verify
from planted.template import TextbookSteps, window_loss

FEATURES, CLASSES = 8, 5


class Trainer(TextbookSteps):
    """N micro-steps of backward(loss / N), then AdamW; the LR warms up linearly over 3 optimizer steps."""

    def __init__(self, spec):
        with torch.random.fork_rng():  # init from the seed; the global RNG (dropout's) is left alone
            torch.manual_seed(spec.seed)
            self.model = self.build().to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 3))
        self.n, self.spec, self.losses = spec.accum_steps, spec, []
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def build(self):
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def loss(self, x, y):
        return F.mse_loss(self.model(x), y)

    def scale(self, loss):
        return loss if self.n == 1 else loss / self.n

    def sched_steps(self) -> int:
        return 1

    def optimizer_step(self):
        self.opt.step()
        for _ in range(self.sched_steps()):
            self.sched.step()
        self.opt.zero_grad()
        loss, self.losses = window_loss(self.losses, self.world), []
        return loss


class HFStyle(Trainer):
    def build(self):
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))

    def loss(self, x, y):
        return F.cross_entropy(self.model(x).float(), y)  # ForCausalLMLoss: logits = logits.float()


class Fabric64True(Trainer):
    def loss(self, x, y):
        out = self.model(x).float()  # "64-true" hands the loss a float32 output
        return F.mse_loss(out, y.to(out.dtype))


class Fp32Constant(Trainer):
    def scale(self, loss):
        return loss * torch.tensor(1 / self.n)  # a float32 constant, whatever the run's dtype


class OffBy1e5(Fp32Constant):
    def scale(self, loss):
        return loss if self.n == 1 else loss * (1 + 1e-5) / self.n


class PerRankScheduler(Trainer):
    """Accelerate's prepared scheduler steps num_processes times per call; called schedule_world // W
    times, W ranks and one process both advance it schedule_world times per optimizer step."""

    def sched_steps(self) -> int:
        return self.world * max(1, self.spec.schedule_world // self.world)


class PerRankUndeclared(Trainer):
    def sched_steps(self) -> int:
        return self.world  # what Accelerate does, with nothing declared


class Dropout(Trainer):
    def build(self):
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 1))


class BatchNormed(Trainer):
    def build(self):
        return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 1))


_reg = verify.data.regression(features=FEATURES)
_cls = verify.data.classification(features=FEATURES, classes=CLASSES)
hf_style = verify.adapter(data=_cls, data_parallel=True)(HFStyle)
fabric_64_true = verify.adapter(data=_reg, data_parallel=True)(Fabric64True)
fp32_constant = verify.adapter(data=_reg)(Fp32Constant)
fp32_constant_dp = verify.adapter(data=_reg, data_parallel=True)(Fp32Constant)
off_by_1e5 = verify.adapter(data=_reg)(OffBy1e5)
per_rank_sched = verify.adapter(data=_reg, data_parallel=True, scheduler_per_rank=True)(PerRankScheduler)
per_rank_undeclared = verify.adapter(data=_reg, data_parallel=True)(PerRankUndeclared)
per_rank_unemulated = verify.adapter(data=_reg, data_parallel=True, scheduler_per_rank=True)(PerRankUndeclared)
dropout = verify.adapter(data=_reg)(Dropout)
dropout_dp = verify.adapter(data=_reg, data_parallel=True)(Dropout)
batch_norm = verify.adapter(data=_reg)(BatchNormed)
