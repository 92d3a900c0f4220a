"""The release matrix's stacks: for each framework, the recipes a release runs, what a venv of it pins, and the
known accumulation bugs by release range, with what their verdicts mean (benchmarks/frameworks.py runs them).

A version token is STACK-RELEASE (trl-0.21.0, deepspeed-current) or a bare release of transformers (4.45.2).
A release with known bugs runs the recipes those bugs concern (its expected verdict: rejected); a release without
runs the stack's recipes (expected: passes). A row per (release, recipe).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from verify import Gate

TORCH = "torch==2.13.0"  # pinned like the README's install: the local CPU wheel, never a multi-GB CUDA build
TOOLS = ["pytest>=8", "hypothesis>=6.100"]
HF, TRL, SFT = "examples.hf_trainer:factory", "examples.trl_grpo:factory", "examples.trl_sft:factory"
DEEPSPEED_BF16 = "examples.deepspeed_zero:bf16_zero1"
DEEPSPEED_MUON = "examples.deepspeed_zero:muon_zero3"


@dataclass(frozen=True)
class Known:
    """A bug of the releases [since, fixed) of a stack, shown by `recipe`."""
    since: tuple
    fixed: tuple
    what: str
    recipe: str


def _release(release: str) -> tuple:
    return tuple(int(x) for x in (release.split(".") + ["0"])[:3])


@dataclass(frozen=True)
class Stack:
    key: str  # the version token's prefix ("" for transformers)
    title: str
    package: str
    recipes: tuple
    shown: tuple  # the distributions whose installed versions a row shows
    known: tuple = ()
    extra_pins: dict = field(default_factory=dict)  # release -> the pins of its time (other packages)
    default_pins: tuple = ()
    probe_metrics: bool = False  # the metrics gate on each declared metric alone (the HF recipe)
    no_deps: bool = False  # the release installed without its own dependencies (what its recipe imports needs none)
    eras: tuple = ()  # (since, recipes), oldest first: from release `since` on, the recipes a bug-free release runs

    def pins(self, release: str) -> list[str]:
        own = self.package if release == "current" else f"{self.package}=={release}"
        return [TORCH, own, *self.extra_pins.get(release, self.default_pins), *TOOLS]

    def bugs(self, release: str) -> list[Known]:
        if release == "current":
            return []
        r = _release(release)
        return [k for k in self.known if k.since <= r < k.fixed]

    def recipes_of(self, release: str) -> tuple:
        """The recipes a release without known bugs runs: its era's ('current': the last era's)."""
        recipes = self.recipes
        for since, era in self.eras:
            if release == "current" or since <= _release(release):
                recipes = era
        return recipes

    def rows(self, release: str) -> list[tuple[str, list[str]]]:
        """(recipe, the known bugs it shows on this release) for each recipe the release runs."""
        bugs = self.bugs(release)
        if not bugs:
            return [(r, []) for r in self.recipes_of(release)]
        recipes = list(dict.fromkeys(k.recipe for k in bugs))
        return [(r, [k.what for k in bugs if k.recipe == r]) for r in recipes]


# -- transformers: the HF recipe (examples/hf_trainer.py), GPT-2 on padded data -------------------------------
PER_MICRO = ("each micro-batch's own token mean on padded data: GPT-2 takes no loss kwargs before 4.50 (4.49 not "
             "checked), and the Trainer's fix (#34191 / #34373, 4.46) reaches only a model that takes num_items_in_batch")
NOT_OVER_N = ("the loss of a model without loss kwargs not divided by N before backward: N× the gradient and the "
              "logged grad_norm (#35207, fixed in 4.48)")
NEXT_LR = "the LR logged after the scheduler's step: the next step's (#35942, fixed in 4.51 by #36973)"
PER_RANK = ("under DDP each rank's loss divided by its own valid-target count (average_tokens_across_devices=False "
            "by default; True from 4.54, #39395)")
TWICE_OVER_N = ("accelerate's backward divides the loss by N a second time: the gradient and the logged grad_norm "
                "1/N (#45305, fixed in 5.5.4 by #45349)")
OVERCOUNT = ("num_items_in_batch counts every label, position 0 of each row included, while the causal-LM loss shifts it "
             "away: each window's token mean is divided by its valid targets + its rows (#46204, fixed in 5.10.1; every "
             "release from 4.46 has it, the matrix runs TRL's SFT recipe on it from 5.9.0, with TRL 1.16)")
# TRL: its GRPO loss (examples/trl_grpo.py) on the harness's fixed rollouts
LOCAL_BNPO = ("the token-level loss ('bnpo') divided by each micro-batch's own completion tokens on each rank, then by "
              "gradient_accumulation_steps: 'exact only with gas=1 and num GPUs=1' (trl PR #3938, 'dapo' from 0.22)")
# DeepSpeed (examples/deepspeed_zero.py)
MUON_PER_MICRO = ("Muon under ZeRO-3 applies Newton–Schulz inside the reduce hook on every micro-batch, not once to the "
                  "window's gradient (#8443, fixed by PR #8600 in 0.19.8; Muon reached ZeRO-3 in 0.18.9)")
# NeMo Automodel: its chunked cross-entropy (examples/nemo_chunked_loss.py), installed without its training stack
CHUNK_MEANS = ("ChunkedCrossEntropy(reduction='mean') adds its chunks' means: once a micro-batch is longer than the chunk "
               "the loss is up to chunks× its mean (NeMo Automodel #3803; the loss was rewritten in 0.7.0)")
NEMO = "examples.nemo_chunked_loss:factory"
# ms-swift: its DPOTrainer on packed preference pairs (examples/swift_dpo.py)
SWIFT = "examples.swift_dpo:factory"
PACKED_PAIRS = ("packed DPO averages each micro-batch's pairs, then divides by gradient_accumulation_steps: micro-batches "
                "packing different numbers of pairs weigh their pairs unequally (ms-swift PR #10144, fixed in 4.6.0)")
BOUNDARY_LEFT_OUT = ("BF16_Optimizer (bf16, grad_accum_dtype fp32, ZeRO-1) adds the boundary micro-batch to the "
                     "rank-local fp32 buffer after the all-reduce: it is left out of the average (PR #7985, 0.19.0)")
# verl: its legacy PPO actor (examples/verl_actor.py), DataParallelPPOActor.update_policy, one recipe per loss_agg_mode
VERL = "examples.verl_actor:"
VERL_TOKEN_MEAN = ("the legacy actor never fills config.global_batch_info, so agg_loss's token-mean divides each "
                   "micro-batch by its own valid tokens (and each rank by its own), then by the micro-batches: "
                   "verl #5625, #7321 (PR #5877 closed; 0.8.0 dropped the actor for its engine, which fills it)")
# verl 0.9: its engine actor (examples/verl_engine.py), FSDPEngineWithLMHead.train_batch with ppo_loss; the sync
# deferred to the last micro-batch (#7719), as 0.9.0 always did. 0.9.0 pads through flash-attn (no CPU row); 0.8.0 not tried
VERL_ENGINE = "examples.verl_engine:"
VERL_SEQ_MEAN = ("the legacy actor never fills config.global_batch_info, so agg_loss's sequence means divide each "
                 "micro-batch by its own non-empty sequences (those without a response token are left out since "
                 "0.6), then by the micro-batches: wrong once a window holds an empty completion (#7321's fallback)")

STACKS = {s.key: s for s in [
    Stack("", "transformers", "transformers", (HF, SFT), ("transformers", "accelerate", "trl"), probe_metrics=True,
          known=(Known((0, 0, 0), (4, 50, 0), PER_MICRO, HF), Known((4, 46, 0), (4, 48, 0), NOT_OVER_N, HF),
                 Known((0, 0, 0), (4, 51, 0), NEXT_LR, HF), Known((0, 0, 0), (4, 54, 0), PER_RANK, HF),
                 Known((5, 2, 0), (5, 5, 4), TWICE_OVER_N, HF), Known((5, 9, 0), (5, 10, 1), OVERCOUNT, SFT)),
          # accelerate of each release's time for the old ones (their Trainer predates accelerate's later changes)
          extra_pins={"4.45.2": ["accelerate==1.0.1"], "4.46.3": ["accelerate==1.1.1"], "4.50.0": ["accelerate==1.5.2"],
                      "5.5.3": ["accelerate==1.13.0"], "5.9.0": ["accelerate", "trl==1.16.0"]},
          default_pins=("accelerate", "trl")),
    Stack("trl", "TRL", "trl", (TRL, "examples.trl_grpo:grpo", "examples.trl_grpo:dr_grpo"),
          ("trl", "transformers", "accelerate"), known=(Known((0, 0, 0), (0, 22, 0), LOCAL_BNPO, TRL),),
          extra_pins={"0.21.0": ["transformers==4.55.4", "accelerate==1.15.0"]},
          default_pins=("transformers", "accelerate")),
    Stack("deepspeed", "DeepSpeed", "deepspeed", ("examples.deepspeed_zero:factory", "examples.deepspeed_zero:bf16",
                                                  DEEPSPEED_MUON),
          ("deepspeed",), known=(Known((0, 18, 6), (0, 19, 0), BOUNDARY_LEFT_OUT, DEEPSPEED_BF16),
                                 Known((0, 18, 9), (0, 19, 8), MUON_PER_MICRO, DEEPSPEED_MUON))),
    # the loss module imports torch (0.7.0: and transformers); the package's own dependencies (megatron-fsdp, wandb,
    # mlflow, GPU kernels) are its trainer's, which the recipe does not run
    Stack("nemo_automodel", "NeMo Automodel", "nemo-automodel", (NEMO,), ("nemo-automodel",),
          known=(Known((0, 0, 0), (0, 7, 0), CHUNK_MEANS, NEMO),), default_pins=("transformers",), no_deps=True),
    # the release brings its own transformers, TRL, accelerate and datasets (4.5.3: transformers < 5.17)
    Stack("swift", "ms-swift", "ms-swift", (SWIFT,), ("ms-swift", "transformers", "trl"),
          known=(Known((0, 0, 0), (4, 6, 0), PACKED_PAIRS, SWIFT),)),
    Stack("verl", "verl", "verl", tuple(VERL + m for m in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                                                           "seq_mean_token_sum_norm")), ("verl", "transformers"),
          known=(Known((0, 0, 0), (0, 8, 0), VERL_TOKEN_MEAN, VERL + "token_mean"),
                 *(Known((0, 6, 0), (0, 8, 0), VERL_SEQ_MEAN, VERL + m)
                   for m in ("seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"))),
          eras=(((0, 9, 0), tuple(VERL_ENGINE + m for m in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                                                             "seq_mean_token_sum_norm"))),)),
    # torchtitan 0.3.0 imports triton at import time; its train step on the CPU: examples/torchtitan_train.py
    Stack("torchtitan", "torchtitan", "torchtitan", ("examples.torchtitan_train:factory",), ("torchtitan",),
          default_pins=("triton",)),
    Stack("accelerate", "Accelerate", "accelerate", ("examples.accelerate_accumulate:factory",), ("accelerate",)),
    Stack("lightning", "Lightning", "lightning",
          ("examples.lightning_trainer:factory", "examples.fabric_no_backward_sync:factory"), ("lightning",)),
]}


def parse(token: str) -> tuple[Stack, str]:
    """'trl-0.21.0' -> (TRL's stack, '0.21.0'); '4.45.2' -> (transformers', '4.45.2'). ValueError if unknown."""
    key, _, release = token.rpartition("-")
    if key not in STACKS:
        raise ValueError(f"{token!r}: stack {key!r} is not one of {', '.join(k for k in STACKS if k)} (or a bare "
                         f"transformers release)")
    if release != "current" and not re.fullmatch(r"\d+\.\d+(\.\d+)?", release):
        raise ValueError(f"{token!r} is not a release number (e.g. 4.45.2, trl-0.21.0, deepspeed-0.18.8) or 'current'")
    return STACKS[key], release


def explain(f: dict, known=()) -> str | None:
    """What a failure means, where its verdict shows a known class (None otherwise); `known`: the row's bugs."""
    text = f["verdict"]
    loss_gates = (Gate.EQUIVALENCE, Gate.NORMALISER, Gate.SPLIT_INVARIANCE, Gate.DP_EQUIVALENCE)
    if PER_MICRO in known and "nan" in text.lower() and f["gate"] in loss_gates:
        return ("a micro-batch without a valid target gives 0/0 = NaN where the window's token mean is defined: the "
                "loss is a mean per micro-batch, not over the window's valid targets")
    if LOCAL_BNPO in known and f["gate"] in loss_gates:
        return ("TRL 0.21's 'bnpo' divides each micro-batch's token sum by that micro-batch's own completion tokens "
                "(and each rank by its own), then by gradient_accumulation_steps: the window's loss is off by a factor "
                "that depends on how TRL's shuffle spreads the tokens over the micro-steps (and ranks); the normaliser "
                "gate names the class: at one row per micro-batch the loss is the mean of the micro-batches' own token "
                "means")
    if PACKED_PAIRS in known and f["gate"] in loss_gates:
        return ("each micro-batch's DPO loss is the mean over its own packed pairs, then ÷ N: a micro-batch of 1 pair "
                "gives that pair the weight of a micro-batch of 3 (1/2 against 1/6 each, where the window's pair mean "
                "gives each 1/4); the normaliser gate names it: the windows' losses weighted by their pairs do not "
                "add up to the union's")
    if OVERCOUNT in known and f["gate"] in loss_gates:
        return ("rows without a valid target still add one to the count (their position 0), so the window's loss is "
                "Σ / (valid targets + rows): the normaliser's padding check names it; every split counts the same rows, "
                "so equivalence passes")
    if CHUNK_MEANS in known and f["gate"] in loss_gates:
        return ("the case's options put the chunk below a micro-batch's tokens (the declared threshold's corner): the "
                "accumulation's micro-batches and the big batch span different numbers of chunks, so their summed "
                "chunk means differ by that count")
    if (VERL_TOKEN_MEAN in known or VERL_SEQ_MEAN in known) and f["gate"] in loss_gates:
        return ("each micro-batch is normalised by its own count (valid tokens, or non-empty sequences) and the "
                "micro-batches averaged with loss_scale_factor = 1/N: wrong as soon as their counts differ, and a "
                "micro-batch without a response token is 0/0 = NaN, after which verl's _optimizer_step skips the "
                "whole mini-batch (grad_norm not finite); equal micro-batches pass at worlds 1 and 2")
    if MUON_PER_MICRO in known and f["gate"] in loss_gates:
        return ("the boundary gradient grads() reads is already Newton–Schulz-orthogonalised, per micro-batch: "
                "N micro-steps give N orthogonalisations of partial gradients where the big batch gives one")
    if BOUNDARY_LEFT_OUT in known and f["gate"] == Gate.DP_EQUIVALENCE:
        return ("each rank's boundary gradient lacks the other ranks' last micro-batch: only data parallelism (W ≥ 2) "
                "with N ≥ 2 shows it, the bf16 ranks against the float64 big batch")
    if PER_RANK in known and " W=" in text and f["gate"] in loss_gates:
        return ("each rank divides by its own valid-target count (a rank without one: 0/0 = NaN), not the window's "
                "over every rank: average_tokens_across_devices is off by default before 4.54")
    if f["gate"] == Gate.REPORTED_METRICS:
        return explain_metric(text)
    ops = re.findall(r"\w+:(\w+) \w+ \[", text)
    if f["gate"] == Gate.BOUNDARY_ONLY and ops and all("broadcast" in op for op in ops):
        return ("broadcasts only, no gradient: DDP (broadcast_buffers=True) sends the model's buffers from rank 0 on "
                "every forward, no_sync() or not — real per-micro-step traffic (this GPT-2 keeps its causal mask, "
                "bool positions², and masked_bias as buffers), not the accumulation bug")
    return None


def explain_metric(text: str) -> str | None:
    """What a metrics verdict of the HF recipe means, where it shows a known bug (None otherwise)."""
    if re.search(r"\blr reported ", text) and "(= the LR after the scheduler's step" in text:
        return ("HF logged the LR after stepping its scheduler: the next step's, not the one applied (#35942; "
                "fixed in 4.51 by #36973)")
    if re.search(r"\bgrad_norm reported ", text) and "= 1/N (micro-steps)" in text:
        return ("1/N of the big batch's: in 5.2-5.5.3 the Trainer hands accelerate N steps of accumulation, whose "
                "backward divides the already normalised loss by N again: the gradient itself is 1/N (#45305, fixed "
                "in 5.5.4 by #45349)")
    if re.search(r"\bgrad_norm reported ", text) and "= N (micro-steps)" in text:
        return ("N× the big batch's: in 4.46-4.47 the loss of a model without loss kwargs (GPT-2's) is not divided "
                "by gradient_accumulation_steps before backward, so the gradient itself is N× (#35207, fixed in 4.48)")
    return None


def known_text() -> list[str]:
    """One line per stack with known bugs, for the report's head."""
    out = []
    for s in STACKS.values():
        if s.known:
            told = dict.fromkeys(f"{_range(k.since, k.fixed)}, {k.what}" for k in s.known)  # one bug, several recipes
            out.append(f"{s.title}: " + "; ".join(told) + ".")
    return out


def _range(since, fixed) -> str:
    upto = ".".join(map(str, fixed))
    return f"before {upto}" if since == (0, 0, 0) else f"from {'.'.join(map(str, since))} to before {upto}"
