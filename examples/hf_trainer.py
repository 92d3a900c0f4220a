"""Hugging Face transformers.Trainer, its own loop (train()), gradient_accumulation_steps=N: a tiny GPT-2
built from its config (no download), padded data with labels -100, clipping at the default
max_grad_norm=1.0, DDP under the harness's process group at world > 1, the loss, grad_norm and LR that HF
logs each step checked. verify.Pull runs train() in a thread, feeds it the harness's micro-batches and
reads the gradient before HF clips it (docs/verify-your-trainer.md, "The framework owns the loop").

    pip install "xtrain[examples]"      # transformers, accelerate
    pytest --pyargs verify --verify-trainer examples.hf_trainer:factory -n auto
    python -m verify.selftest --verify-trainer examples.hf_trainer:factory
"""
import tempfile

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments

import verify

VOCAB = 64
SEQ = 8
MAX_NORM = 1.0  # TrainingArguments' default max_grad_norm


def batch(x, y):
    """A micro-batch as the model takes it. HF shifts the labels inside the model, so position 0 is no
    target (verify.data.shifted_labels)."""
    return {"input_ids": x, "labels": verify.data.shifted_labels(y)}


# Alone, accelerate still wraps the model in DDP but its no_sync() is a no-op there: DDP reduces on every
# micro-step over its one rank (the gradient bucket, find_unused_parameters' bitmap). Declared for world 1.
ALONE = verify.Expected("all_reduce", count=2, world=1, why="accelerate's no_sync() is a no-op at world 1")
# DDP broadcasts the model's buffers at every forward (broadcast_buffers=True): GPT-2 before transformers 4.46
# registers its attention mask (bool) and masked_bias (float) as buffers. Declared; later releases have none.
BUFFERS = verify.Expected("broadcast", count=2, why="DDP's buffer broadcast at every forward (GPT-2 < 4.46)")
# What HF logs per optimizer step (state.log_history, logging_steps=1) under the harness's names: `loss` (the
# window's token mean over every rank), `grad_norm` (what clip_grad_norm_ returned: before clipping) and
# `learning_rate` (read before the scheduler's step: the LR applied; before 4.51 the next step's, a bug).
LOG_KEYS = {"loss": "loss", "grad_norm": "grad_norm", "lr": "learning_rate"}
# Before 5.0 HF rounds its logged loss to 4 decimals, which no float64 check tells from a 1e-5 error: not declared
if int(transformers.__version__.split(".")[0]) >= 5:
    LOGGED = ("loss", "grad_norm", "lr")
else:
    LOGGED = ("grad_norm", "lr")
METRICS = verify.Metrics(names=LOGGED, max_norm=MAX_NORM)


# empty_windows=False: HF steps AdamW on a window without a valid label (zero gradient, but momentum moves
# the parameters): such windows are not drawn.
@verify.adapter(data=verify.data.causal_lm(vocab=VOCAB, seq_len=SEQ), metrics=METRICS,
                batches=verify.Batches(ignore_index=-100, empty_windows=False),
                distributed=verify.Distributed(data_parallel=True, expected=(ALONE, *verify.DDP_EXPECTED, BUFFERS)))
def factory(spec):
    torch.manual_seed(spec.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ + 1, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: two runs must agree
    model = GPT2LMHeadModel(config).to(spec.device, spec.dtype)
    # per_device_train_batch_size=1: each item of the Pull dataset is already a whole micro-batch. max_steps=100
    # (more than any case runs): the default linear decay moves the LR 1% a step, so the LR applied and the
    # next step's differ far beyond the metrics gate's bound
    args = TrainingArguments(output_dir=tempfile.gettempdir(), gradient_accumulation_steps=spec.accum_steps,
                             per_device_train_batch_size=1, max_steps=100, learning_rate=1e-3,
                             max_grad_norm=MAX_NORM, use_cpu=spec.device == "cpu", report_to="none",
                             save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
                             dataloader_pin_memory=False)
    pull = verify.Pull(spec, batch=batch)
    trainer = Trainer(model=model, args=args, train_dataset=pull.dataset, data_collator=pull.collate)
    trainer.remove_callback(PrinterCallback)  # logs stay in log_history: the gates build hundreds of trainers

    def logged():
        """HF's log of the step that just ran."""
        entry = trainer.state.log_history[-1]
        return {name: entry[LOG_KEYS[name]] for name in LOGGED}

    return pull.start(trainer.train, model, metrics=logged)
