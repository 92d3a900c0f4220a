"""A token-mean LM that stops on a non-finite step loss, as torchtitan's train_step does ("Loss is not finite ...
Stopping training."): a window without a valid target (0/0) raises, so it declares empty_windows=False. The
harness must never run such a window on it, not even one row alone for a κ (examples/torchtitan_train.py)."""
import math

import verify
from examples.token_mean_lm import IGNORE, SEQ_LEN, VOCAB, Trainer


class Guarded(Trainer):
    def optimizer_step(self):
        if not math.isfinite(self.loss):
            raise RuntimeError(f"Loss is not finite (loss={self.loss}): stopping training")
        return super().optimizer_step()


guarded = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ_LEN),
                         batches=verify.Batches(ignore_index=IGNORE, empty_windows=False))(Guarded)
