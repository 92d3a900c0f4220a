"""verl 0.9's engine actor: FSDPEngineWithLMHead.train_batch with ppo_loss (its micro-batch split, global counts,
gradient sync deferred or not, and optimizer_step, unmodified) on the harness's fixed rollouts, one mini-batch per
window; a tiny Qwen2 saved from its config, FSDP2 over the ranks (world 1 too). verl has no CPU platform: the recipe
registers one (CPUPlatform). The gradient is read as in examples/verl_actor.py: optimizer_step wrapped. The float64
reference extends verl's dtype table with fp64 (PrecisionType.to_dtype), its runs only. docs/design/recipes.md.

    pip install "verl>=0.9.1,<0.10"        # no GPU extras (0.9.0 needs flash-attn); [verl] pins the legacy <0.8
    pytest --pyargs verify --verify-trainer examples.verl_engine:token_mean
    python -m verify.selftest --verify-trainer examples.verl_engine:seq_mean_token_mean
"""
import contextlib
import tempfile
from functools import partial

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, Qwen2Config
from verl.plugin.platform import set_platform
from verl.plugin.platform.platform_cuda import PlatformCUDA

import verify


class CPUDevice:
    """torch.cpu, plus the memory queries verl's engine logs (nothing to report on the CPU)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def mem_get_info(self, device=None):
        return 0, 0

    def memory_allocated(self, device=None):
        return 0

    def memory_reserved(self, device=None):
        return 0

    def max_memory_allocated(self, device=None):
        return 0

    def max_memory_reserved(self, device=None):
        return 0

    def reset_peak_memory_stats(self, device=None):
        pass

    def empty_cache(self):
        pass

    def manual_seed(self, seed):
        pass

    def manual_seed_all(self, seed):
        pass


class CPUPlatform(PlatformCUDA):
    """verl's platforms are CUDA, ROCm and NPU (it falls back to CUDA without one): the CPU, through verl's own
    plugin point (verl.plugin.platform.set_platform), before the engine's modules read it at import."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPUDevice()

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def empty_cache(self):
        pass

    def communication_backend_name(self):
        return "gloo"


set_platform(CPUPlatform())

from verl import DataProto  # noqa: E402  (after the platform: the engine reads it at import)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.torch_dtypes import PrecisionType  # noqa: E402
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

VOCAB, PROMPT, COMPLETION = 16, 3, 6
MAX_NORM = 1.0
VERL_TO_DTYPE = PrecisionType.to_dtype


def model_config():
    """A one-layer Qwen2, eager attention (verl's default is flash_attention_2)."""
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=PROMPT + COMPLETION,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config._attn_implementation = "eager"
    return config


def to_dtype(precision):
    """verl's PrecisionType.to_dtype, and fp64 (verl's table stops at fp32: the float64 reference's only change)."""
    if precision == "fp64":
        return torch.float64
    return VERL_TO_DTYPE(precision)


@contextlib.contextmanager
def dtypes(float64):
    if float64:
        PrecisionType.to_dtype = staticmethod(to_dtype)
    try:
        yield
    finally:
        PrecisionType.to_dtype = staticmethod(VERL_TO_DTYPE)


def precision(spec):
    """(model_dtype, mixed_precision): verl's default for bf16 (bf16 parameters in the forward, fp32 master weights
    and reduction), fp32 throughout for fp32, fp64 throughout for the float64 reference."""
    if spec.dtype == torch.float64:
        return "fp64", {"param_dtype": "fp64", "reduce_dtype": "fp64", "buffer_dtype": "fp64"}
    if spec.precision == "bf16":
        return "fp32", None
    return "fp32", {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


class Trainer:
    LOSS_AGG_MODE = "token-mean"
    SYNC = {}  # FSDPEngineConfig's default: the sync deferred to the last micro-batch (0.9.0's only way, #7719)

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        model_dtype, mixed = precision(spec)
        with tempfile.TemporaryDirectory(prefix="verl-engine-") as path, dtypes(spec.dtype == torch.float64):
            AutoModelForCausalLM.from_config(model_config()).save_pretrained(path)
            model = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=False,
                                  override_config={"attn_implementation": "eager"})
            engine = FSDPEngineConfig(strategy="fsdp2", forward_only=False, use_dynamic_bsz=False,
                                      use_torch_compile=False, model_dtype=model_dtype, mixed_precision=mixed,
                                      **self.SYNC)
            optim = FSDPOptimizerConfig(lr=1e-3, clip_grad=MAX_NORM, total_training_steps=1)
            self.engine = FSDPEngineWithLMHead(model_config=model, engine_config=engine, optimizer_config=optim,
                                               checkpoint_config=None)
            self.engine.initialize()
        self.module = self.engine.module
        step = self.engine.optimizer_step

        def read_then_step():  # after the window's micro-batches, before clipping
            self.grad = {name: p.grad.detach().clone() for name, p in self.module.named_parameters()}
            return step()

        self.engine.optimizer_step = read_then_step
        self.n = spec.accum_steps
        self.spec = spec
        self.window = []

    def loss(self, rows):
        """ppo_loss as ActorRolloutRefWorker sets it (partial(ppo_loss, config=...)); the counts come with the data."""
        config = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=rows // self.n,
                                 ppo_epochs=1, loss_agg_mode=self.LOSS_AGG_MODE, entropy_coeff=0.0,
                                 grad_clip=MAX_NORM, use_dynamic_bsz=False, use_torch_compile=False, rollout_n=1)
        return partial(ppo_loss, config=config)

    def micro_step(self, x, y, micro):
        self.window.append(verify.data.unpack_rollouts(x, y))
        if micro < self.n - 1:
            return
        data = self.batch(self.window)
        with self.engine.train_mode():
            self.output = self.engine.train_batch(data, loss_function=self.loss(data.batch_size[0]))
        self.window = []

    def batch(self, window):
        """The window's rollouts as verl's trainer hands them to the actor: padded, then left_right_2_no_padding
        (ray_trainer._update_actor), global_batch_size the mini-batch's sequences over every rank."""
        prompts = torch.cat([r.prompt_ids for r in window])
        responses = torch.cat([r.completion_ids for r in window])
        mask = torch.cat([r.completion_mask for r in window]).to(self.spec.dtype)
        ids = torch.cat([prompts, responses], dim=1)
        rows, length = ids.shape
        advantages = torch.cat([r.advantages for r in window])[:, None] * mask  # GRPO's: the score on every token
        tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompts": prompts,
                   "position_ids": torch.arange(length, device=ids.device).expand(rows, length).clone(),
                   "responses": responses, "response_mask": mask, "advantages": advantages,
                   "old_log_probs": torch.cat([r.old_logps for r in window])}
        data = DataProto(batch=TensorDict(tensors, batch_size=[rows]), meta_info={"temperature": 1.0}).to_tensordict()
        data = left_right_2_no_padding(data)
        tu.assign_non_tensor(data, global_batch_size=rows * dist.get_world_size(), micro_batch_size_per_gpu=rows // self.n,
                             use_dynamic_bsz=False, use_remove_padding=False, use_fused_kernels=False,
                             calculate_entropy=False, compute_loss=True)
        return data

    def grads(self):
        return self.grad

    def optimizer_step(self):
        # the engine stepped in train_batch; the loss as TrainingWorker logs it: the micro-batches' losses summed,
        # the ranks' averaged
        loss = torch.tensor(sum(self.output["loss"]), dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return loss

    def params(self):
        return dict(self.module.named_parameters())


class SyncEveryMicro(Trainer):
    # 0.9.1's switch; its trainer yaml (trainer/config/engine/fsdp.yaml) sets it False, the dataclass True
    SYNC = {"use_no_sync_for_gradient_accumulation": False}


class SeqMeanTokenSum(Trainer):
    LOSS_AGG_MODE = "seq-mean-token-sum"


class SeqMeanTokenMean(Trainer):
    LOSS_AGG_MODE = "seq-mean-token-mean"


class SeqMeanTokenSumNorm(Trainer):
    LOSS_AGG_MODE = "seq-mean-token-sum-norm"


DATA = verify.data.rollouts(vocab=VOCAB, prompt_len=PROMPT, completion_len=COMPLETION)


def row(case, deferred):
    """What a window communicates, all at its boundary (the engine runs the window's micro-batches there): the
    window's valid tokens (one all-reduce, ppo_loss's global count); FSDP2's units (verl's apply_fsdp2: each decoder
    layer, embed_tokens, lm_head and the root) each all-gather their parameters for every micro-batch's forward and
    again for its backward; their gradient reduce-scatter (on gloo an all-reduce of the padded gradient) on the
    last micro-batch only where verl defers the sync (#7719), on every one where it does not; then the clip norm
    (one all-reduce of each parameter's squared norm) and the logged loss's mean. The same at world 1: the engine
    shards over one rank too."""
    n, world = case.accum_steps, case.world
    module = AutoModelForCausalLM.from_config(model_config())
    units = module.config.num_hidden_layers + 3
    params = list(module.parameters())
    padded = sum(-(-p.shape[0] // world) * world * p[0].numel() for p in params)
    syncs = 1 if deferred else n
    elements = padded * syncs + len(params) + 2
    return verify.CountRow("verl engine, FSDP2, sync " + ("at the last micro-batch" if deferred else
                                                         "on every micro-batch"),
                           before={}, boundary={"all_gather": 2 * units * n, "all_reduce": 3 + units * syncs},
                           elements=(elements, elements))


def deferred_sync(case):
    return row(case, deferred=True)


def sync_every_micro(case):
    return row(case, deferred=False)


def declare(trainer, normaliser, what, counts):
    """The adapter of one loss_agg_mode and sync mode. bf16: verl's FSDP2 default (bf16 parameters in the forward,
    fp32 reduction); the float64 reference is fp64 throughout. empty_windows=False: a window without a response
    token is 0/0 in ppo_loss (verl's engine then skips the step: grad_norm not finite)."""
    return verify.adapter(data=DATA, batches=verify.Batches(ignore_index=-100, empty_windows=False),
                          distributed=verify.Distributed(process_group=True, counts=counts),
                          numerics=verify.Numerics(precisions=("bf16",)),
                          objective=verify.Objective(terms={"loss": normaliser}),
                          name=f"verl FSDPEngineWithLMHead (loss_agg_mode={trainer.LOSS_AGG_MODE!r}, {what})")(trainer)


token_mean = declare(Trainer, "token_mean", "deferred gradient sync", deferred_sync)
token_mean_sync_every_micro = declare(SyncEveryMicro, "token_mean", "gradient sync on every micro-batch",
                                      sync_every_micro)
# the sequence means divide by global_batch_size, the mini-batch's sequences (an empty completion counts)
seq_mean_token_sum = declare(SeqMeanTokenSum, "seq_sum", "deferred gradient sync", deferred_sync)
seq_mean_token_mean = declare(SeqMeanTokenMean, "seq_mean", "deferred gradient sync", deferred_sync)
seq_mean_token_sum_norm = declare(SeqMeanTokenSumNorm, "seq_sum", "deferred gradient sync", deferred_sync)
