"""DeepSpeed: deepspeed.initialize with gradient_accumulation_steps, engine.backward / engine.step every micro-step
(the engine steps the optimizer at its own boundary), ZeRO stage 0-3 drawn by the harness, gradient clipping by
the engine; torch's AdamW as the client optimizer. gloo ranks on CPU (DeepSpeed's CPU accelerator), NCCL on GPUs.
Adapters: factory (fp32, stages 0-3), bf16 (bf16 parameters, gradients accumulated in fp32: BF16_Optimizer at
stage 1, ZeRO's fp32 buffers at 2-3; refused at 0), bf16_zero1 (PR #7985's stage 1) and muon_zero3 (Muon, ZeRO-3).

    pip install "xtrain-verify[deepspeed]"
    pytest --pyargs verify --verify-trainer examples.deepspeed_zero:factory -n auto
    python -m verify.selftest --verify-trainer examples.deepspeed_zero:factory
"""
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
from hypothesis import strategies as st

import verify

MAX_NORM = 1.0
FEATURES, HIDDEN = 8, 32


@dataclass(frozen=True)
class Options:
    stage: int = 0  # ZeRO stage: 0 (plain data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)
    persistence_threshold: int | None = None  # ZeRO-3's stage3_param_persistence_threshold (None: DeepSpeed's 1e5)


def persistence_side(options, above):
    """ZeRO-3's persistence threshold: parameters smaller than it are never partitioned, so a small model (this one's
    largest tensor: 256 elements) is all persistent. Above it (a threshold of 0) every parameter is partitioned and
    gathered for each forward and backward; below it (DeepSpeed's default) none is."""
    return Options(stage=3, persistence_threshold=0 if above else None)


def use_accelerator(device: str):
    """DeepSpeed's accelerator for this run's device (a GPU box's gloo ranks on CPU take the CPU one), with float64
    among the dtypes stage 0 may all-reduce: DeepSpeed lists none, and the harness's reference runs are float64."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    base = CUDA_Accelerator if device.startswith("cuda") else CPU_Accelerator
    if base is CPU_Accelerator:
        # DeepSpeed's shared-memory all-reduce kernel serves inference only (deepspeed.comm.inference_all_reduce);
        # the CPU accelerator JIT-compiles it as the engine starts (~70 s on 2 cores). Training never calls it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    accel = get_accelerator()
    if isinstance(accel, base) and torch.float64 in accel.supported_dtypes():
        return

    class WithFloat64(base):
        def supported_dtypes(self):
            return [*base.supported_dtypes(self), torch.float64]

    set_accelerator(WithFloat64())


class Trainer:
    BF16 = False
    MUON = False

    def __init__(self, spec):
        options = spec.options or Options()
        if options.stage == 3 and spec.dtype == torch.float64:
            # zero.Init refuses float64 on every device (its assert; a CPU without oneDNN fp16 only slipped past it
            # through _set_dtype dropping the dtype it is given). ZeRO-2 keeps ZeRO-3's arithmetic (fp32 master
            # weights and gradient partitions, a reduction every micro-step) and its traffic fits ZeRO-3's row.
            options = Options(stage=2)
        if self.MUON and spec.dtype == torch.float64:
            # Muon's float64 reference: the math, at stage 0 (Muon in the optimizer's step, on the window's gradient);
            # ZeRO-1/2 orthogonalise in their flat partition, so grads() there reads the update, not the gradient
            options = Options(stage=0)
        if self.BF16 and spec.precision != "bf16":
            # the bf16 adapter's fp32 / float64 runs are its references: the math, run at stage 0 (each stage's own
            # fp32 path is factory's to prove; ZeRO-1/2's cannot step on the CPU accelerator in 0.18.6-0.18.9)
            options = Options(stage=0)
        use_accelerator(str(spec.device))
        torch.manual_seed(spec.seed)
        # Muon's run: weight matrices only, every parameter Newton–Schulz's (a bias would go to DeepSpeed's auxiliary
        # Adam, a fused op the CPU accelerator JIT-builds first, ~70 s on 2 cores; #8443 is in the matrices' update)
        bias = not self.MUON
        net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN, bias=bias), torch.nn.Tanh(),
                                  torch.nn.Linear(HIDDEN, 1, bias=bias))
        net = net.to(spec.device, spec.dtype)
        world = dist.get_world_size()
        config = {
            "train_micro_batch_size_per_gpu": 1,  # rows per micro-batch: the harness's, checked by nothing here
            "train_batch_size": spec.accum_steps * world,
            "gradient_accumulation_steps": spec.accum_steps,
            "gradient_clipping": MAX_NORM,
            "zero_optimization": {"stage": options.stage},
            "zero_allow_untested_optimizer": True,  # torch's AdamW as the client optimizer
            "steps_per_print": 2**31,
        }
        if options.stage == 3 and options.persistence_threshold is not None:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = options.persistence_threshold
        self.bf16 = self.BF16 and spec.precision == "bf16"
        if self.bf16:
            config["bf16"] = {"enabled": True}
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        if self.MUON:  # DeepSpeed's Muon: Newton–Schulz on the weight matrices (its own Adam on the rest: none here)
            config["optimizer"] = {"type": "Muon", "params": {"lr": 1e-2}}
            config["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed's Muon needs whole gradients
            for p in net.parameters():
                p.use_muon = p.ndim == 2
            opt = None
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        self.engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config, dist_init_required=False)
        self.n, self.world, self.device = spec.accum_steps, world, spec.device
        self.loss_sum = 0.0
        self.logged = {}

    def micro_step(self, x, y, micro):
        out = self.engine(x.to(torch.bfloat16) if self.bf16 else x)
        if self.bf16:
            # the engine cast the model to bf16: the loss is taken in fp32 (upcast only: a float64 run's .float() would
            # round each residual to fp32, which Adam's first step amplifies on a gradient near eps)
            out, y = out.float(), y.float()
        loss = F.mse_loss(out, y)
        # the engine divides by gradient_accumulation_steps and reduces at its boundary (stage 0-1), or every
        # micro-step into its partitioned buffers (stage 2-3)
        self.engine.backward(loss)
        if micro < self.n - 1:
            self.engine.step()  # before the boundary: the engine only counts the micro-step
        self.loss_sum += loss.item()

    def grads(self):
        # the reduced gradient, whole (ZeRO holds each rank's partition; this gathers it), in the accumulation dtype
        return {name: safe_get_full_grad(p) for name, p in self.engine.module.named_parameters()}

    def optimizer_step(self):
        self.engine.step()  # the boundary: clip, step, zero the gradients
        loss = torch.tensor(self.loss_sum / self.n, dtype=torch.float64, device=self.device)  # NCCL: on the GPU
        dist.all_reduce(loss)
        loss = loss / self.world
        self.logged = {"loss": loss.item()}
        self.loss_sum = 0.0
        return loss

    def metrics(self):
        """What the last step logs: the global batch's mean loss (the engine's get_global_grad_norm() is None at
        stage 0, where it clips with torch's clip_grad_norm_ and keeps no norm)."""
        return self.logged

    def params(self):
        out = {}
        for name, p in self.engine.module.named_parameters():
            full = safe_get_full_fp32_param(p)  # the master weights where ZeRO or bf16 keeps them apart
            out[name] = p if full is None else full
        return out


class BF16Trainer(Trainer):
    BF16 = True


class MuonTrainer(Trainer):
    MUON = True


def counts(case):
    """What DeepSpeed's engine communicates in one optimizer step, per stage, on gloo (measured at 0.19.8, then
    declared; the table with the reasons: docs/design/distributed.md, "Count tables")."""
    stage = (case.options or Options()).stage
    bf16 = case.precision == "bf16"
    tensors = 4  # parameter tensors (two Linear layers' weight and bias): ZeRO-3 gathers each at most twice a pass
    gathers = (0, 2 * tensors)
    before = {0: {}, 1: {}, 2: {"all_reduce": 1},
              3: {"all_reduce": 1, "all_gather": gathers, "broadcast": (0, None)}}[stage]
    # the boundary: the gradient (stage 0-1), or the last micro-step's (2-3); the clip norm; stage 1-2's parameter
    # all-gather; bf16's overflow flag (stage 2); the recipe's loss
    boundary = {0: {"all_reduce": 3}, 1: {"all_reduce": 2 if bf16 else 3, "all_gather": 1},
                2: {"all_reduce": 4 if bf16 else 3, "all_gather": 1},
                3: {"all_reduce": 3, "all_gather": gathers, "broadcast": (0, None)}}[stage]
    return verify.CountRow(mode=f"ZeRO-{stage}{' bf16' if bf16 else ''}", before=before, boundary=boundary)


def bf16_counts(case):
    """The bf16 adapter's rows: its bf16 runs at the drawn stage, its fp32 / float64 references at stage 0."""
    if case.precision == "bf16":
        return counts(case)
    return counts(case.replace(options=Options(stage=0)))


STAGES = st.builds(Options, stage=st.sampled_from([0, 1, 2, 3]))
metrics = verify.Metrics(names=("loss",), max_norm=MAX_NORM)
PERSISTENCE = verify.Threshold(name="ZeRO-3 parameter persistence", apply=persistence_side)
factory = verify.adapter(data=verify.data.regression(features=FEATURES), options=STAGES, defaults=Options(),
                         metrics=metrics, distributed=verify.Distributed(process_group=True, counts=counts),
                         thresholds=(PERSISTENCE,))(Trainer)
BF16 = verify.Numerics(precisions=("fp32", "bf16"))
bf16 = verify.adapter(data=verify.data.regression(features=FEATURES), numerics=BF16,
                      options=st.builds(Options, stage=st.sampled_from([1, 2, 3])), defaults=Options(stage=1),
                      metrics=metrics, distributed=verify.Distributed(process_group=True, counts=bf16_counts))(BF16Trainer)
# the configuration of DeepSpeed PR #7985 alone: bf16, grad_accum_dtype fp32, ZeRO-1 (BF16_Optimizer)
bf16_zero1 = verify.adapter(data=verify.data.regression(features=FEATURES), numerics=BF16,
                            options=st.just(Options(stage=1)), defaults=Options(stage=1), metrics=metrics,
                            distributed=verify.Distributed(process_group=True, counts=bf16_counts))(BF16Trainer)
def muon_counts(case):
    """ZeRO-3's row with Muon (measured at 0.19.8, N = 1, 2, 4, on the two weight matrices alone): at the boundary
    each weight is fetched for the forward and the backward (1 + 1, cached after the first micro-step), its gradient
    gathered whole for Newton–Schulz (2 calls) and the stepped weight fetched again (1): ≤ 5 per weight."""
    row = counts(case)
    boundary = {**row.boundary, "all_gather": (0, 5 * 2)}
    return verify.CountRow(mode=row.mode + " Muon", before=row.before, boundary=boundary)


def muon_counts64(case):
    """Muon's float64 reference runs at stage 0 (Trainer): stage 0's row."""
    return counts(case.replace(options=Options(stage=0)))


# DeepSpeed's Muon under ZeRO-3 (its Newton–Schulz belongs on the window's gradient, once per step: #8443)
muon_zero3 = verify.adapter(data=verify.data.regression(features=FEATURES), options=st.just(Options(stage=3)),
                            defaults=Options(stage=3),
                            distributed=verify.Distributed(process_group=True, counts=muon_counts,
                                                                     counts64=muon_counts64))(MuonTrainer)
