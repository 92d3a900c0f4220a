"""NeMo Automodel's ChunkedCrossEntropy (reduction="mean") as a token-mean LM's loss: each micro-step turns the
micro-batch's mean back into its sum (× its valid targets), and the boundary divides by the window's count. Its
chunk length is declared as a threshold, so every gate also runs with micro-batches longer than one chunk: where
0.5-0.6 return the SUM of the chunks' means (NeMo Automodel #3803), fixed in 0.7.0.

    pip install --no-deps nemo-automodel==0.6.0   # its loss module needs torch only (0.7.0: and transformers)
    pytest --pyargs verify --verify-trainer examples.nemo_chunked_loss:factory
"""
import dataclasses
import inspect

import torch
from nemo_automodel.components.loss.chunked_ce import ChunkedCrossEntropy

import verify
from examples.token_mean_lm import SEQ_LEN, VOCAB, TinyLM

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class Options:
    chunk_len: int = 1 << 20  # tokens per chunk; NeMo's default (32) would split every micro-batch here


def chunk_side(options, above):
    """Past the chunk: a micro-batch's tokens span several chunks (5 tokens: every row is split)."""
    return dataclasses.replace(options or Options(), chunk_len=5 if above else 1 << 20)


class Trainer:
    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = TinyLM().to(spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.ce = ChunkedCrossEntropy(chunk_len=(spec.options or Options()).chunk_len, compile=False,
                                      ignore_index=IGNORE, reduction="mean")
        # 0.7.0 projects inside the loss: it takes the hidden states and the head's weight, not the logits
        self.takes_hidden = "lm_weight" in inspect.signature(self.ce.forward).parameters
        self.n, self.tokens, self.loss_sum = spec.accum_steps, 0, 0.0

    def mean(self, x, y):
        if self.takes_hidden:
            return self.ce(self.model.hidden(x), y, self.model.head.weight)
        return self.ce(self.model(x), y)

    def micro_step(self, x, y, micro):
        count = int((y != IGNORE).sum())
        if count:  # the micro-batch's mean × its count: its sum (a micro-batch without a valid target adds nothing)
            loss_sum = self.mean(x, y) * count
            loss_sum.backward()
            self.loss_sum += float(loss_sum.detach())
        self.tokens += count
        if micro == self.n - 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad /= max(self.tokens, 1)

    def grads(self):  # 0.7.0 projects with the head's weight alone: its bias has no gradient there
        return {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        loss = self.loss_sum / self.tokens if self.tokens else float("nan")
        if self.tokens:  # a window without a valid target is no step
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.tokens, self.loss_sum = 0, 0.0
        return loss

    def params(self):
        return dict(self.model.named_parameters())


factory = verify.adapter(data=verify.data.tokens(vocab=VOCAB, seq_len=SEQ_LEN), defaults=Options(),
                         batches=verify.Batches(ignore_index=IGNORE),
                         thresholds=(verify.Threshold(name="NeMo chunk length", apply=chunk_side),))(Trainer)
