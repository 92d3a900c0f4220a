"""verl's PPO actor: DataParallelPPOActor.update_policy (its micro-batch split, loss scaling, agg_loss and
_optimizer_step, unmodified) on the harness's fixed rollouts, one mini-batch per window, one adapter per loss_agg_mode;
a tiny Qwen2 from its config, FSDP2 (fully_shard) over the ranks at world > 1. The gradient is read as verl's own
actor test reads it: _optimizer_step wrapped. verl 0.4-0.7 (0.8 replaced the actor by its engine). docs/design/recipes.md.

    pip install "xtrain-verify[verl]"      # verl (no GPU extras), transformers
    pytest --pyargs verify --verify-trainer examples.verl_actor:token_mean
    python -m verify.selftest --verify-trainer examples.verl_actor:seq_mean_token_mean
"""
import torch
import torch.distributed as dist
import verl
from packaging.version import Version
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, Qwen2Config
from verl import DataProto
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.config import FSDPActorConfig, OptimizerConfig

import verify

VOCAB, PROMPT, COMPLETION = 16, 3, 6
MAX_NORM = 1.0
# agg_loss's sequence means leave out a sequence without a response token (verl PR #2967, 0.6.0); before, each counted
EMPTY_SEQUENCES_COUNT = Version(verl.__version__) < Version("0.6")


def model_config():
    """A one-layer Qwen2, eager attention (the same sums in every run)."""
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=PROMPT + COMPLETION,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config._attn_implementation = "eager"
    return config


class Trainer:
    LOSS_AGG_MODE = "token-mean"

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.module = AutoModelForCausalLM.from_config(model_config()).to(spec.device, spec.dtype)
        self.model = self.module
        if dist.get_world_size() > 1:  # verl's actor runs under FSDP; FSDP2 reduce-scatters at each backward
            from torch.distributed.fsdp import fully_shard
            self.model = fully_shard(self.module)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3)
        self.n = spec.accum_steps
        self.spec = spec
        self.window = []

    def actor(self, rows):
        """verl's actor for one window of `rows` rows per rank: one mini-batch (one optimizer step) of
        micro-batches of rows / N. use_torch_compile=False: no inductor on the gates' CPU runs."""
        config = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=rows // self.n,
                                 ppo_epochs=1, loss_agg_mode=self.LOSS_AGG_MODE, entropy_coeff=0.0,
                                 grad_clip=MAX_NORM, use_dynamic_bsz=False, use_torch_compile=False,
                                 optim=OptimizerConfig(lr=1e-3), rollout_n=1)
        actor = DataParallelPPOActor(config=config, actor_module=self.model, actor_optimizer=self.opt)
        step = actor._optimizer_step

        def read_then_step():  # verl's own actor test reads the gradient here: after the window, before clipping
            self.grad = {name: p.grad.detach().clone() for name, p in self.module.named_parameters()}
            return step()

        actor._optimizer_step = read_then_step
        return actor

    def micro_step(self, x, y, micro):
        self.window.append(verify.data.unpack_rollouts(x, y))
        if micro < self.n - 1:
            return
        batch = self.batch(self.window)
        self.metrics = self.actor(len(batch)).update_policy(batch)
        self.window = []

    def batch(self, window):
        """The window's rollouts as verl's trainer hands them to the actor (its DataProto)."""
        prompts = torch.cat([r.prompt_ids for r in window])
        responses = torch.cat([r.completion_ids for r in window])
        mask = torch.cat([r.completion_mask for r in window]).to(self.spec.dtype)
        ids = torch.cat([prompts, responses], dim=1)
        rows, length = ids.shape
        advantages = torch.cat([r.advantages for r in window])[:, None] * mask  # GRPO's: the score on every token
        tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "position_ids": torch.arange(length, device=ids.device).expand(rows, length),
                   "responses": responses, "response_mask": mask, "advantages": advantages,
                   "old_log_probs": torch.cat([r.old_logps for r in window])}
        return DataProto(batch=TensorDict(tensors, batch_size=[rows]), meta_info={"temperature": 1.0})

    def grads(self):
        return self.grad

    def optimizer_step(self):
        # verl stepped in update_policy; its logged pg_loss: the micro-batches' losses × loss_scale_factor, summed
        loss = torch.tensor(self.metrics["actor/pg_loss"], dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return loss

    def params(self):
        return dict(self.module.named_parameters())


class SeqMeanTokenSum(Trainer):
    LOSS_AGG_MODE = "seq-mean-token-sum"


class SeqMeanTokenMean(Trainer):
    LOSS_AGG_MODE = "seq-mean-token-mean"


class SeqMeanTokenSumNorm(Trainer):
    LOSS_AGG_MODE = "seq-mean-token-sum-norm"


def answered(inputs, targets):
    """The sequences verl's sequence means count: a completion with at least one response token (from 0.6)."""
    return (targets != -100).any(dim=1).long()


DATA = verify.data.rollouts(vocab=VOCAB, prompt_len=PROMPT, completion_len=COMPLETION)


def counts(case):
    """What a window communicates, all at its boundary (the actor runs the window's micro-batches there): FSDP2's
    all-gather of the parameters and its reduce-scatter of the gradient (on gloo an all-reduce) on every verl
    micro-batch, as verl's actor never turns gradient sync off; then the clip norm (one all-reduce of each parameter's
    squared norm: torch's _get_total_norm on DTensors) and the logged loss's mean."""
    if case.world == 1:  # the plain module: no collective
        return verify.CountRow("verl actor, one rank", before={}, boundary={})
    n = case.accum_steps
    params = list(AutoModelForCausalLM.from_config(model_config()).parameters())
    elements = sum(p.numel() for p in params) * n + len(params) + 1
    return verify.CountRow("verl actor under FSDP2, sync every micro-batch", before={},
                           boundary={"all_gather": n, "reduce_scatter": n, "all_reduce": 2},
                           elements=(elements, elements))


def declare(trainer, normaliser):
    """The adapter of one loss_agg_mode. bf16: verl's forward runs under autocast in fsdp_config.dtype (bf16 or fp16
    only); a float64 reference is not cast. process_group: the actor asks torch.distributed for its rank even alone.
    empty_windows=False: a window without a response token steps AdamW."""
    sequences = None if EMPTY_SEQUENCES_COUNT or normaliser == "token_mean" else answered
    return verify.adapter(data=DATA, batches=verify.Batches(ignore_index=-100, empty_windows=False),
                          distributed=verify.Distributed(process_group=True, counts=counts),
                          numerics=verify.Numerics(precisions=("bf16",)),
                          objective=verify.Objective(terms={"loss": normaliser}, sequences=sequences),
                          name=f"verl DataParallelPPOActor (loss_agg_mode={trainer.LOSS_AGG_MODE!r})")(trainer)


token_mean = declare(Trainer, "token_mean")
seq_mean_token_sum = declare(SeqMeanTokenSum, "seq_sum")
seq_mean_token_mean = declare(SeqMeanTokenMean, "seq_mean")
seq_mean_token_sum_norm = declare(SeqMeanTokenSumNorm, "seq_sum")
