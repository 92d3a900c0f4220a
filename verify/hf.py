"""Any `transformers.Trainer` subclass proven with one call: its own train(), compute_loss, collator and logs.

    factory = verify.hf.trainer(MyTrainer, model=build_model, args=MyArguments(output_dir="out", learning_rate=1e-3))
    pytest --pyargs verify --verify-trainer mypkg.train:factory -n auto

verify.Pull drives the subclass's loop (the gradient read before clipping, at the boundary); a TrainerCallback
keeps what its on_log logs, judged by the metrics gate. Design: docs/design/recipes.md, "Trainer subclasses".
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile

import torch

import verify
from verify._internal.cases.pull import Pull

__all__ = ["trainer", "LOG_KEYS"]

# the harness's metric names -> the keys HF logs them under (state.log_history, logging_steps=1)
LOG_KEYS = {"loss": "loss", "grad_norm": "grad_norm", "lr": "learning_rate"}
# Alone, accelerate still wraps the model in DDP whose no_sync() is a no-op there: it reduces on every micro-step
ALONE = verify.Expected("all_reduce", count=2, world=1, why="accelerate's no_sync() is a no-op at world 1")
MAX_STEPS = 100  # past any case's steps: the default linear decay then moves the LR 1% a step, which the gate sees


def owned(spec) -> dict:
    """The TrainingArguments fields the harness sets: its window, one pre-collated micro-batch per item, the
    case's dtype (no autocast: it would round the float64 reference), a log every step, nothing saved or shown."""
    return dict(output_dir=tempfile.gettempdir(), gradient_accumulation_steps=spec.accum_steps,
                per_device_train_batch_size=1, max_steps=MAX_STEPS, use_cpu=spec.device == "cpu", report_to="none",
                save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
                dataloader_pin_memory=False, dataloader_num_workers=0, dataloader_prefetch_factor=None,
                dataloader_persistent_workers=False, bf16=False, fp16=False)



def trainer(cls, *, model, args=None, data=None, rows=None, batch=None, logged=None, expected=(), declare=None,
            **trainer_kwargs):
    """An adapter factory that proves `cls` (a transformers.Trainer subclass) on each case.

    model(spec) -> the nn.Module to train, built under the case's seed (moved to spec.device and spec.dtype here).
    args: the subclass's arguments (TrainingArguments, SFTConfig, ...); the fields owned() sets are replaced.
    data: a verify.data maker (default causal_lm(vocab=64, seq_len=8)). The subclass's own collator (the one it
    builds, or data_collator=) collates each micro-batch's rows, rows(x, y) -> a dict of lists as a tokenized
    dataset yields it (default: input_ids and the shifted labels). batch(x, y) instead: the micro-batch as the
    model takes it, no collator. logged: the metrics judged from its logs (default loss, grad_norm and lr; before
    transformers 5 HF rounds its logged loss to 4 decimals, so not the loss). expected: more verify.Expected
    collectives its DDP may issue. declare: more keyword arguments of verify.adapter (they win over these).
    Everything else goes to cls(...)."""
    import transformers
    from transformers import Trainer, TrainingArguments

    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"verify.hf.trainer: cls={cls!r} is not a transformers.Trainer subclass")
    if not callable(model):
        raise TypeError(f"verify.hf.trainer: model={model!r} must be a callable spec -> torch.nn.Module")
    if args is not None and not isinstance(args, TrainingArguments):
        raise TypeError(f"verify.hf.trainer: args={type(args).__name__} is not a TrainingArguments (or a subclass)")
    if rows is not None and batch is not None:
        raise TypeError("verify.hf.trainer: give rows= (for the subclass's collator) or batch= (no collator), not both")
    if logged is None:
        logged = ("loss", "grad_norm", "lr") if int(transformers.__version__.split(".")[0]) >= 5 else ("grad_norm", "lr")
    unknown = set(logged) - set(LOG_KEYS)
    if unknown:
        raise ValueError(f"verify.hf.trainer: logged={tuple(logged)} names {sorted(unknown)}: choose from "
                         f"{', '.join(LOG_KEYS)}")
    for key in ("train_dataset", "args", "model"):
        if key in trainer_kwargs:
            raise TypeError(f"verify.hf.trainer: {key}= is the harness's (it feeds the cases' micro-batches)")
    data = data or verify.data.causal_lm(vocab=64, seq_len=8)
    rows = rows or _default_row
    max_norm = args.max_grad_norm if args is not None else TrainingArguments.max_grad_norm
    declared = dict(data=data,
                    # HF steps AdamW on a window without a valid label (momentum moves the parameters): not drawn
                    batches=verify.Batches(ignore_index=-100, empty_windows=False),
                    distributed=verify.Distributed(data_parallel=True, expected=(ALONE, *verify.DDP_EXPECTED, *expected)))
    if logged:
        declared["metrics"] = verify.Metrics(names=tuple(logged), max_norm=max_norm if max_norm else None)
    # named after the caller's module, where workers find it again by importing that module (Adapter.locate)
    caller = sys._getframe(1).f_globals.get("__name__", "__main__")
    declared["name"] = f"{caller}: verify.hf.trainer({cls.__name__})"
    declared.update(declare or {})

    def factory(spec):
        torch.manual_seed(spec.seed)
        net = model(spec).to(spec.device, spec.dtype)
        base = args if args is not None else TrainingArguments(output_dir=tempfile.gettempdir())
        collate = {}  # the subclass's collator, known once it is built
        pull = Pull(spec, batch=batch or _Rows(rows, collate))
        # built on a one-row stand-in of the data (a subclass may require a datasets.Dataset), then fed the cases
        run = cls(model=net, args=dataclasses.replace(base, **owned(spec)), train_dataset=_stand_in(data, rows),
                  **trainer_kwargs)
        collate["own"] = run.data_collator
        run.train_dataset, run.data_collator = pull.dataset, pull.collate
        logs = _Logs()
        run.add_callback(logs)
        _quiet(run)
        return pull.start(run.train, net, metrics=logs.reader(logged) if logged else None)

    factory.__module__ = caller
    return verify.adapter(**declared)(factory)


def _default_row(x, y) -> dict:
    """One row of a causal LM's tokenized data; HF causal LMs shift their labels inside the model."""
    return {"input_ids": x.tolist(), "labels": verify.data.shifted_labels(y).tolist()}


class _Rows:
    """The micro-batch (x, y) -> the subclass's collator on its rows, run in the harness's thread when the
    micro-step is fed (the loader only passes it on)."""

    def __init__(self, rows, collate: dict):
        self.rows, self.collate = rows, collate

    def __call__(self, x, y):
        return self.collate["own"]([self.rows(x[i], y[i]) for i in range(x.shape[0])])


def _stand_in(data, rows):
    """One row of the data as a datasets.Dataset where that library is installed (what TRL's trainers check for),
    else a list."""
    x, y = data(1, 0)
    first = [rows(x[0], y[0])]
    if not isinstance(first[0], dict):  # a packed row (ms-swift's packing yields a list of samples)
        return first
    try:
        import datasets
    except ImportError:
        return first
    return datasets.Dataset.from_list(first)


def _quiet(run) -> None:
    """Logs stay in log_history; the gates build hundreds of trainers, none of which should print."""
    from transformers import PrinterCallback, ProgressCallback

    for cb in list(run.callback_handler.callbacks):  # a subclass's own printer (ms-swift's) too
        if isinstance(cb, (PrinterCallback, ProgressCallback)):
            run.remove_callback(cb)


def _Logs():
    """A TrainerCallback keeping what on_log logs at each optimizer step (subclasses log through it too)."""
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        def __init__(self):
            self.last = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and any(key in logs for key in LOG_KEYS.values()):
                self.last = dict(logs)

        def reader(self, names):
            def logged():
                missing = [LOG_KEYS[n] for n in names if LOG_KEYS[n] not in self.last]
                if missing:
                    raise verify.AdapterError(f"the trainer's logs of this step lack {missing} (logged: "
                                              f"{sorted(self.last)}): drop them from logged=")
                return {n: self.last[LOG_KEYS[n]] for n in names}

            return logged

    return Logs()
