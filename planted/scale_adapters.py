"""The Llama-shaped recipe (examples/llama_scale.py) with the field's most common accumulation bug, at every size
the recipe has: each micro-batch divided by its OWN valid-token count, then ÷ N (open-instruct #1137, TRL 0.21's
bnpo). Right only where every micro-batch holds the same count; the equivalence gate draws padded windows.
`billion` is what `python -m verify.gpu_gate --scale` is measured on (reports/scale/)."""
import dataclasses

import torch.nn.functional as F

from examples import llama_scale
from examples.llama_scale import IGNORE


class MicroTokenMean(llama_scale.Trainer):
    def micro_step(self, x, y, micro):
        loss_sum = self.forward_sum(x, y)
        count = int((y != IGNORE).sum())
        (loss_sum / max(count, 1) / self.n).backward()  # BUG: this micro-batch's own count, then ÷ N
        self.loss_sum += loss_sum.detach() / max(count, 1) / self.n
        self.tokens += count
        if micro == self.n - 1:
            tokens = int(self.tokens)
            self.loss = float(self.loss_sum) if tokens else float("nan")
            self.logged = {"loss": self.loss, "tokens": tokens}
            self.tokens.zero_(), self.loss_sum.zero_()


class ChunkMeansLlama(llama_scale.Llama):
    def loss_sum(self, ids, targets):
        """NeMo Automodel #3803's shape: a chunked mean that SUMS its chunks' means (k chunks: up to k× the mean),
        × the count to make the sum this trainer divides. One chunk (below the threshold): exactly right."""
        h, y, c = self.hidden(ids), targets.flatten(), self.o.loss_chunk
        means = [F.cross_entropy(self.head(h[i:i + c]), y[i:i + c], ignore_index=IGNORE)
                 for i in range(0, h.shape[0], c) if (y[i:i + c] != IGNORE).any()]
        return sum(means) * (y != IGNORE).sum() if means else h.sum() * 0


class ChunkMeans(llama_scale.Trainer):
    model_class = ChunkMeansLlama


def _broken(adapter, cls=MicroTokenMean, what="per-micro token mean"):
    return dataclasses.replace(adapter, factory=cls, name=f"broken: {adapter.name}, {what}", ref=None)


tiny = _broken(llama_scale.factory)
billion = _broken(llama_scale.billion)
m134 = _broken(llama_scale.m134)
half = _broken(llama_scale.half)
chunk_means = _broken(llama_scale.factory, ChunkMeans, "a chunked mean summing its chunks' means")
