"""TRL's GRPOTrainer: its own loss and accumulation (training_step -> compute_loss per loss_type, steps_per_generation,
num_items_in_batch) on the harness's fixed rollouts, generation replaced by them; a tiny Qwen2 from its config, DDP
via TRL's Accelerator at world > 1. Adapters: factory (token-level: "dapo" from TRL 0.22, "bnpo" before, local: trl
PR #3938), grpo (sequence mean), dr_grpo (Σ tokens / sequences × max_completion_length). docs/design/recipes.md.

    pip install "xtrain-verify[trl]"      # trl, transformers, accelerate (or [examples]: every recipe)
    pytest --pyargs verify --verify-trainer examples.trl_grpo:factory
    python -m verify.selftest --verify-trainer examples.trl_grpo:factory
"""
import contextlib
import tempfile

import torch
import trl
from datasets import Dataset
from packaging.version import Version
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
from trl import GRPOConfig, GRPOTrainer

import verify

VOCAB, PROMPT, COMPLETION = 16, 3, 6
MAX_NORM = 1.0
# TRL's loss mask apart from its attention mask (tool_mask: tokens attended but not trained on) from 0.26
TOOL_MASK = Version(trl.__version__) >= Version("0.26")
# TRL's token-level (DAPO) aggregation: "dapo" since 0.22 (trl PR #3938); before it, "bnpo" (the default then)
TOKEN_LEVEL = "dapo" if Version(trl.__version__) >= Version("0.22") else "bnpo"
# TRL's metrics in compute_loss, per micro-step: global (sum, count) reductions in 1.16.0, per-micro-batch means
# gathered in 0.21.0 (the two releases measured; a release whose logging differs fails the count table, named)
GLOBAL_METRICS = Version(trl.__version__) >= Version("0.22")
METRIC_MEANS = "TRL's logged entropy and clip ratios: (sum, count) over the ranks, every micro-step"
METRIC_GATHERS = "TRL's logged clip ratios (per sequence or per micro-batch), gathered every micro-step"


def no_reward(completions, **kwargs):
    """Never called: the rollouts (and their advantages) are the harness's data, not generated and scored."""
    return [0.0] * len(completions)


def tokenizer():
    """A word-level tokenizer over the ids 0..VOCAB-1, built in memory (GRPOTrainer needs a processing class)."""
    vocab = {str(i): i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="0")),
                                   pad_token="0", eos_token="1", unk_token="0")


def model_config():
    """A one-layer Qwen2, eager attention (the same sums in every run)."""
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=PROMPT + COMPLETION,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1)
    config._attn_implementation = "eager"
    return config


class FixedRollouts(GRPOTrainer):
    """GRPOTrainer whose generation step returns the harness's rollouts of the window (set in `rollouts`) in the
    form its own _generate_and_score_completions returns; TRL then shuffles and splits them into its micro-steps."""

    rollouts = None

    def _generate_and_score_completions(self, inputs):
        return self.rollouts


class Trainer:
    LOSS_TYPE = TOKEN_LEVEL

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(model_config()).to(spec.device, spec.dtype)
        # bf16=False: GRPOConfig defaults to bf16 autocast; the harness's fp32 runs (and float64 references) get none
        # num_generations=2, per_device_train_batch_size=2: TRL's checks on its generation batch, which the fixed
        # rollouts replace; steps_per_generation defaults to gradient_accumulation_steps (one window, one
        # generation); beta=0 (TRL's default): no reference model to load, so the KL term is off
        args = GRPOConfig(output_dir=tempfile.gettempdir(), loss_type=self.LOSS_TYPE,
                          gradient_accumulation_steps=spec.accum_steps, per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=COMPLETION, beta=0.0, learning_rate=1e-3,
                          max_grad_norm=MAX_NORM, bf16=False, use_cpu=spec.device == "cpu", report_to="none", save_strategy="no",
                          logging_steps=1, disable_tqdm=True, dataloader_pin_memory=False)
        prompts = Dataset.from_dict({"prompt": ["2 3 4"] * 2})
        self.trl = FixedRollouts(model=model, reward_funcs=no_reward, args=args, train_dataset=prompts,
                                 processing_class=tokenizer())
        self.acc = self.trl.accelerator
        self.model = self.acc.prepare_model(model)  # DDP under the harness's process group
        self.module = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.n = spec.accum_steps
        self.window = []

    def micro_step(self, x, y, micro):
        self.window.append(verify.data.unpack_rollouts(x, y))
        if micro < self.n - 1:
            return
        # TRL generates a whole window (its generation batch) before the window's micro-steps: so here, at its end
        self.trl.rollouts = self.generated(self.window)
        self.trl.current_gradient_accumulation_steps = self.n  # what Trainer.train() sets per window
        self.model.train()
        self.losses = []
        for i in range(self.n):  # Trainer.train()'s inner loop: no_sync() but on the window's last micro-batch
            sync = contextlib.nullcontext() if i == self.n - 1 else self.acc.no_sync(self.model)
            with sync:
                self.losses.append(self.trl.training_step(self.model, [], None))
        self.window = []

    def generated(self, window):
        """The window's rollouts as TRL's _generate_and_score_completions returns them: the prompts and completions,
        the advantages, the old policy's log-probs, and the number of completion tokens the loss counts over the
        whole generation batch and every rank (num_items_in_batch; read from TRL 0.22 on)."""
        prompt_ids = torch.cat([r.prompt_ids for r in window])
        completion_ids = torch.cat([r.completion_ids for r in window])  # every token as sampled, masked ones too
        loss_mask = torch.cat([r.completion_mask for r in window])
        out = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
               "advantages": torch.cat([r.advantages for r in window]),
               "old_per_token_logps": torch.cat([r.old_logps for r in window])}
        if TOKEN_LEVEL == "dapo":  # the count TRL 0.22's token-level loss divides by (0.21 knows no such key)
            out["num_items_in_batch"] = self.acc.gather(loss_mask.sum()).sum()
        if TOOL_MASK:  # a masked target is attended, not in the loss: TRL's tool_mask (completion_mask: attention)
            out.update(completion_mask=torch.ones_like(loss_mask), tool_mask=loss_mask)
        else:  # one mask for both; the harness masks a completion's tail (padding) and, in one check, its head
            out.update(completion_mask=loss_mask)
        return out

    def grads(self):
        return {name: p.grad for name, p in self.module.named_parameters()}

    def optimizer_step(self):
        # DDP averaged the gradient over the ranks at the last backward: the local norm is the global one
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), MAX_NORM)
        self.opt.step()
        self.opt.zero_grad()
        # what Trainer logs: the micro-steps' losses (each already scaled for the window) summed, mean over ranks
        return self.acc.reduce(torch.stack(self.losses).sum(), "mean")

    def params(self):
        return dict(self.module.named_parameters())


class Grpo(Trainer):
    LOSS_TYPE = "grpo"


class DrGrpo(Trainer):
    LOSS_TYPE = "dr_grpo"


DATA = verify.data.rollouts(vocab=VOCAB, prompt_len=PROMPT, completion_len=COMPLETION)


def gradient_elements():
    """The tiny model's parameter elements: what DDP reduces once per synchronised backward."""
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config()).parameters())


def counts(case):
    """What a window communicates, all at its boundary (TRL generates, then runs the window's micro-steps there):
    DDP's gradient once (alone, Accelerate's no_sync() is a no-op: once per micro-step), and, declared as side
    traffic (sized, per TRL micro-step, no gradient's), TRL's metric logging in compute_loss plus the logged loss's
    mean over the ranks. Not judged at world 1 (no ranks to count against)."""
    grads = gradient_elements() * (1 if case.world > 1 else case.accum_steps)
    n, rows = case.accum_steps, case.micro_batch  # TRL's micro-steps per window, rows in each
    if GLOBAL_METRICS:  # entropy and 3 clip ratios as (sum, count) reductions; 2 clip ratios gathered per sequence
        metrics = (verify.Expected("all_reduce", count=4 * n, dtype="floating", numel=2, why=METRIC_MEANS),
                   verify.Expected("all_gather", count=2 * n, dtype="floating", numel=rows, why=METRIC_GATHERS))
    else:  # entropy and 3 clip ratios, each the micro-batch's mean, gathered
        metrics = (verify.Expected("all_gather", count=4 * n, dtype="floating", numel=1, why=METRIC_GATHERS),)
    logged = verify.Expected("all_reduce", count=1, dtype="floating", numel=1, why="the logged loss, mean over ranks")
    return verify.CountRow("TRL GRPOTrainer, one generation per window", before={}, boundary=None,
                           elements=(grads, grads), carriers=None, side=(*metrics, logged))


def declare(trainer, normaliser):
    """The adapter of one loss_type. empty_windows=False: a window without a completion token still steps AdamW
    (zero gradient, moving moments)."""
    return verify.adapter(data=DATA, batches=verify.Batches(ignore_index=-100, empty_windows=False),
                          distributed=verify.Distributed(data_parallel=True, counts=counts),
                          objective=verify.Objective(terms={"loss": normaliser}),
                          name=f"TRL GRPOTrainer (loss_type={trainer.LOSS_TYPE!r})")(trainer)


factory = declare(Trainer, "token_mean")
grpo = declare(Grpo, "seq_mean")
dr_grpo = declare(DrGrpo, "seq_sum")
