"""The Llama-shaped recipe (examples/llama_scale.py) with the field's most common accumulation bug, at every size
the recipe has: each micro-batch divided by its OWN valid-token count, then ÷ N (open-instruct #1137, TRL 0.21's
bnpo). Right only where every micro-batch holds the same count; the equivalence gate draws padded windows.
`billion` is what `python -m verify.gpu_gate --scale` is measured on (reports/scale/)."""
import dataclasses

import torch

from examples import llama_scale
from examples.llama_scale import IGNORE


class MicroTokenMean(llama_scale.Trainer):
    def micro_step(self, x, y, micro):
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
            loss_sum = self.model.loss_sum(x, y)
        count = int((y != IGNORE).sum())
        (loss_sum / max(count, 1) / self.n).backward()  # BUG: this micro-batch's own count, then ÷ N
        self.loss_sum += loss_sum.detach() / max(count, 1) / self.n
        self.tokens += count
        if micro == self.n - 1:
            tokens = int(self.tokens)
            self.loss = float(self.loss_sum) if tokens else float("nan")
            self.logged = {"loss": self.loss, "tokens": tokens}
            self.tokens.zero_(), self.loss_sum.zero_()


def _broken(adapter):
    return dataclasses.replace(adapter, factory=MicroTokenMean, name=f"broken: {adapter.name}, per-micro token mean",
                               ref=None)


tiny = _broken(llama_scale.factory)
billion = _broken(llama_scale.billion)
m134 = _broken(llama_scale.m134)
half = _broken(llama_scale.half)
