"""ms-swift's DPOTrainer on packed preference pairs, proven with one call: verify.hf.trainer. Its own train(),
collator (the template's packing), concatenated forward and sigmoid DPO loss; a tiny Qwen2 from its config and a
tokenizer built in memory (no download). Each row packs 1..3 pairs: the loss is a mean over the window's pairs.
Before 4.6.0 each micro-batch's pairs were averaged, then ÷ N: rejected (ms-swift PR #10144, benchmarks/stacks.py).

    pip install "xtrain-verify[swift]"      # ms-swift, with its transformers, TRL and accelerate
    pytest --pyargs verify --verify-trainer examples.swift_dpo:factory
    python -m verify.selftest --verify-trainer examples.swift_dpo:factory
"""
import copy
import tempfile

import torch
from swift.model import ModelInfo, ModelMeta
from swift.rlhf_trainers import DPOConfig, DPOTrainer
from swift.template import get_template
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

import verify
import verify.hf

VOCAB, SEQ, PAIRS = 16, 12, 3  # a row: 1..PAIRS documents of SEQ tokens in all, each document one pair
MAX_NORM = 0.2  # below this model's pre-clip norms (0.21-0.60 measured on the self-test's cases): clipping on
INFO = dict(model_type="qwen2", model_dir="tiny-qwen2", torch_dtype=torch.float32, max_model_len=4 * SEQ,
            quant_method=None, quant_bits=0, task_type="causal_lm")


def config():
    """A one-layer Qwen2, eager attention (the same sums in every run)."""
    c = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4 * SEQ,
                    pad_token_id=0, eos_token_id=1, bos_token_id=1)
    c._attn_implementation = "eager"
    return c


def qwen2(spec):
    """The policy, with the model_info / model_meta that swift's loader attaches (its trainer reads them)."""
    model = AutoModelForCausalLM.from_config(config())
    model.model_info = ModelInfo(**INFO, config=model.config)
    model.model_meta = ModelMeta("qwen2", [], template="dummy")
    return model


def template():
    """swift's template over a word-level tokenizer of the ids 0..VOCAB-1, in DPO's mode (rlhf), packing:
    what swift's PackingDataset sets (its collator then lays every chosen, then every rejected, in one row)."""
    vocab = {str(i): i for i in range(VOCAB)}
    processor = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="0")),
                                        pad_token="0", eos_token="1", unk_token="0")
    processor.model_info = ModelInfo(**INFO, config=config())
    processor.model_meta = ModelMeta("qwen2", [], template="dummy")
    t = get_template(processor, template_type="dummy", padding_free=True)
    t.set_mode("rlhf")
    t.packing = True
    return t


class PackedDPO(DPOTrainer):
    """swift's DPOTrainer, its reference model a frozen copy of the policy as built (what swift's rlhf pipeline
    loads for full-parameter DPO: the same checkpoint twice)."""

    def __init__(self, model, **kwargs):
        super().__init__(model=model, ref_model=copy.deepcopy(model), **kwargs)


def pair(tokens):
    """One document -> one preference pair as swift's encoder gives it: the first token the prompt (label -100),
    the rest the chosen completion; the rejected one each token + 1."""
    prompt, chosen = tokens[:1], tokens[1:]
    rejected = [(t + 1) % VOCAB for t in chosen]
    out = {}
    for side, completion in (("chosen", chosen), ("rejected", rejected)):
        out[f"{side}_input_ids"] = prompt + completion
        out[f"{side}_labels"] = [-100] * len(prompt) + completion
        out[f"{side}_length"] = len(prompt) + len(completion)
    return out


def packed_row(x, y):
    """A harness row (verify.data.packed: ids and position_ids) -> the packed row swift's PackingDataset yields:
    a list of its pairs, one per document."""
    ids, starts = x[0].tolist(), (x[1] == 0).nonzero().flatten().tolist() + [x.shape[1]]
    return [pair(ids[a:b]) for a, b in zip(starts, starts[1:])]


# Sigmoid DPO. verify.hf.trainer replaces the fields the harness owns; dataloader_num_workers=0 here too: swift's
# arguments derive a prefetch factor and persistent workers from it when built, which a later replace keeps
ARGS = DPOConfig(output_dir=tempfile.gettempdir(), beta=0.1, loss_type="sigmoid", learning_rate=1e-3, max_grad_norm=MAX_NORM,
                 bf16=False, check_model=False, dataloader_num_workers=0, dataloader_persistent_workers=False)
# swift logs the LR after the scheduler's step (its _maybe_log_save_evaluate reads _get_learning_rate() then): the
# next step's, as transformers did before 4.51 (#35942). Declared as that convention.
METRICS = verify.Metrics(names=("loss", "grad_norm", "lr"), max_norm=MAX_NORM, lr="next")
# The loss is a mean over the window's pairs (sequences = documents = pairs), not over its rows or micro-batches.
# No ignore_index: every pair has valid targets (a pair without one would still add log 2 to the mean).
# One process: at world > 1 swift gathers every logged metric with gather_object per micro-step.
factory = verify.hf.trainer(
    PackedDPO, model=qwen2, template=template(), args=ARGS,
    data=verify.data.packed(vocab=VOCAB, seq_len=SEQ, max_docs=PAIRS), rows=packed_row, logged=METRICS.names,
    declare={"batches": verify.Batches(), "metrics": METRICS,
             "objective": verify.Objective(terms={"loss": "seq_mean"}, sequences=verify.data.count_documents),
             "distributed": verify.Distributed(), "name": "ms-swift DPOTrainer (packed pairs)"})
