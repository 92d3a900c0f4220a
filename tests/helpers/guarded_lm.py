"""A token-mean LM that stops on a non-finite step loss, as torchtitan's train_step does ("Loss is not finite ...
Stopping training."): a window without a valid target (0/0) raises, so it declares empty_windows=False. The
harness must never run such a window on it, not even one row alone for a κ (examples/torchtitan_train.py)."""
import math

import torch
import torch.nn.functional as F

import verify
from examples.token_mean_lm import IGNORE, SEQ_LEN, VOCAB, Trainer


class Guarded(Trainer):
    def optimizer_step(self):
        if not math.isfinite(self.loss):
            raise RuntimeError(f"Loss is not finite (loss={self.loss}): stopping training")
        return super().optimizer_step()


guarded = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ_LEN),
                         batches=verify.Batches(ignore_index=IGNORE, empty_windows=False))(Guarded)


class LastMicro(Guarded):
    """Reports its last micro-batch's own token mean as the step's loss (Metrics(loss="last_micro")): NaN where that
    micro-batch holds no valid target, which the harness must not run alone to learn."""

    def micro_step(self, x, y, micro):
        if micro == self.n - 1:
            count = int((y != IGNORE).sum())
            with torch.no_grad():
                total = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
            self.last = float(total) / count if count else float("nan")
        super().micro_step(x, y, micro)

    def metrics(self):
        return {**self.logged, "loss": self.last}


last_micro = guarded.replace(factory=LastMicro, name="guarded, last micro-batch's loss",
                             metrics=verify.Metrics(names=("loss",), loss="last_micro"), ref=None)
