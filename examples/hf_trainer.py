"""Hugging Face transformers.Trainer, its own loop (train()), gradient_accumulation_steps=N, proven with one call:
verify.hf.trainer(Trainer, ...) — the same call proves any subclass (TRL's SFTTrainer: examples/trl_sft.py).
A tiny GPT-2 built from its config (no download), padded data with labels -100, clipping at the default
max_grad_norm=1.0, DDP under the harness's process group at world > 1; the loss, grad_norm and LR that HF logs
each step checked (docs/verify-your-trainer.md, "A transformers.Trainer subclass").

    pip install "xtrain[examples]"      # transformers, accelerate
    pytest --pyargs verify --verify-trainer examples.hf_trainer:factory -n auto
    python -m verify.selftest --verify-trainer examples.hf_trainer:factory
"""
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import verify

VOCAB = 64
SEQ = 8


def gpt2(spec):
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ + 1, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: two runs must agree
    return GPT2LMHeadModel(config)


# DDP broadcasts the model's buffers at every forward (broadcast_buffers=True): GPT-2 before transformers 4.46
# registers its attention mask (bool) and masked_bias (float) as buffers. Declared; later releases have none.
BUFFERS = verify.Expected("broadcast", count=2, why="DDP's buffer broadcast at every forward (GPT-2 < 4.46)")

ARGS = TrainingArguments(output_dir="out", learning_rate=1e-3)  # max_grad_norm stays its default, 1.0: clipping on
DATA = verify.data.causal_lm(vocab=VOCAB, seq_len=SEQ)

factory = verify.hf.trainer(Trainer, model=gpt2, args=ARGS, data=DATA, expected=(BUFFERS,))
