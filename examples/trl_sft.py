"""TRL's SFTTrainer (a transformers.Trainer subclass: its own compute_loss, its collator, its logs) proven with the
one call a user of any subclass adds: verify.hf.trainer(SFTTrainer, ...). A tiny Llama from its config and a
word-level tokenizer built in memory (no download); each row is cut after its last valid target, so TRL's
collator pads the micro-batch itself.

    pip install "xtrain[examples]"      # trl, transformers, accelerate
    pytest --pyargs verify --verify-trainer examples.trl_sft:factory -n auto
"""
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import verify

VOCAB = 64
SEQ = 8
PAD = VOCAB - 1  # the pad token's id: TRL's collator pads with it and gives pads the label -100


def llama(spec):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ + 1,
                         bos_token_id=0, eos_token_id=0, pad_token_id=PAD)
    return LlamaForCausalLM(config)


def tokenizer():
    """Only its pad token is read: the data is already token ids."""
    words = {f"t{i}": i for i in range(VOCAB - 1)} | {"<pad>": PAD}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="t0")), pad_token="<pad>",
                                   eos_token="t0")


def row(x, y):
    """A tokenized example as SFT data holds it: labels = input_ids, with the targets the harness masks as -100
    (position 0 keeps its token: the model shifts it away, a count must too), cut after the last valid target (a
    causal model's earlier outputs never see what follows). TRL's collator pads the micro-batch's rows."""
    labels = verify.data.shifted_labels(y)
    labels[0] = x[0]
    valid = (labels[1:] != -100).nonzero()
    end = int(valid[-1]) + 2 if len(valid) else 1
    return {"input_ids": x[:end].tolist(), "labels": labels[:end].tolist()}


# TRL's compute_loss gathers its metrics over the ranks on every micro-step (gather_for_metrics): the valid,
# correct and attended token counts and the entropy sum, one element each. Side traffic, no gradient: declared.
METRICS = (verify.Expected("all_gather", count=3, dtype="integer", numel=1, why="SFTTrainer's token counts"),
           verify.Expected("all_gather", count=1, dtype="floating", numel=1, why="SFTTrainer's entropy sum"),
           # DDP broadcasts the model's buffers at every forward (broadcast_buffers=True): Llama's rotary inv_freq
           verify.Expected("broadcast", count=1, dtype="floating", why="DDP's buffer broadcast: the rotary inv_freq"),
           # torch DDP's one-time bucket rebuild follows the first backward here, under no_sync() (seen at step 0,
           # micro-step 1): SFTConfig checkpoints activations, so HF builds DDP without find_unused_parameters
           verify.Expected("broadcast", count=2, dtype="integer", step=0, micro=1, why="DDP's one-time bucket rebuild"))

factory = verify.hf.trainer(SFTTrainer, model=llama, rows=row, processing_class=tokenizer(), expected=METRICS,
                            args=SFTConfig(output_dir="out", learning_rate=1e-3, max_length=None, bf16=False,
                                           dataset_kwargs={"skip_prepare_dataset": True}),
                            data=verify.data.causal_lm(vocab=VOCAB - 1, seq_len=SEQ))
