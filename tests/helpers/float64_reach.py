"""Honest trainers whose float64 runs the float64 checks misjudged (found by the zoo, issue 42 item 1; derivations:
docs/design/tolerance.md, "Later losses", "Noise in the parameters", "An update computed in bf16"):

    pg32          REINFORCE over advantages of both signs (zero-mean over the batch), the log-probabilities from an
                  HF-style `logits.float()` and the per-row terms summed in float32, SGD: the loss is ~1e-3 of its
                  terms, so their float32 rounding, relative to the loss, passes the 64·eps32 cap
    adafactor_lm  honest_lm's causal LM (a separate biased key projection: a gradient zero in exact arithmetic) under
                  torch.optim.Adafactor, whose first step is sign descent: the key bias moves by ±lr·RMS(bias) on noise
    muon32        an MLP, torch.optim.Muon on its hidden matrix (Newton–Schulz in bfloat16 whatever the parameters'
                  dtype) and AdamW on the rest, the loss in float32: a float32-level gradient difference becomes a
                  bfloat16-level update
    muon64        the same with Newton–Schulz in the parameters' dtype (the recipe of tolerance.md)
"""
import contextlib

import torch
import torch.nn.functional as F

import verify
from tests.helpers import honest_lm

FEATURES, ACTIONS, HIDDEN = 6, 5, 64


# -- D: a cancelling loss with a float32 part -------------------------------------------------------------------

def _pg_data(rows: int, seed: int):
    """Features, and per row (action, advantage): advantages of both signs, zero-mean over the batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    y = torch.stack([torch.randint(0, ACTIONS, (rows,), generator=g).double(), adv - adv.mean()], dim=1)
    return x, y


class PolicyGradient32:
    """−mean over rows of advantage × log π(action), π from a linear policy near uniform (a small init); each
    micro-step backward(Σ over its rows / the window's rows); SGD."""

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = torch.nn.Linear(FEATURES, ACTIONS).to(spec.device, spec.dtype)
        with torch.no_grad():
            self.model.weight.mul_(1e-2)
            self.model.bias.zero_()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.n, self.loss = spec.accum_steps, 0.0

    def micro_step(self, x, y, micro):
        logp = torch.log_softmax(self.model(x).float(), dim=-1)  # HF-style: the loss in float32
        taken = logp.gather(1, y[:, 0].long()[:, None]).squeeze(1)
        part = -(y[:, 1].to(logp.dtype) * taken).sum() / (x.shape[0] * self.n)  # float32 terms, a float32 sum
        part.backward()
        self.loss = self.loss + part.detach().double()

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()
        loss, self.loss = self.loss, 0.0
        return loss

    def params(self):
        return dict(self.model.named_parameters())


pg32 = verify.adapter(data=_pg_data, name="honest REINFORCE, zero-mean advantages, logits.float()")(PolicyGradient32)


# -- F: a zero-gradient key bias under Adafactor ----------------------------------------------------------------

class AdafactorLM(honest_lm.TokenMean):
    def __init__(self, spec):
        super().__init__(spec)
        self.opt = torch.optim.Adafactor(self.model.parameters(), lr=1e-2)


adafactor_lm = verify.adapter(data=verify.data.tokens(vocab=honest_lm.VOCAB, seq_len=honest_lm.SEQ),
                              ignore_index=honest_lm.IGNORE, name="honest causal LM (q/k/v bias) under Adafactor")(AdafactorLM)


# -- E: Muon's Newton–Schulz in bfloat16 -----------------------------------------------------------------------

from benchmarks.zoo.optim import newton_schulz  # noqa: E402  (the zoo's Muon runs the same recipe)


@contextlib.contextmanager
def newton_schulz_in_param_dtype():
    """torch.optim.Muon's steps inside run Newton–Schulz in the parameters' dtype, not torch's bfloat16."""
    import torch.optim._muon as muon

    saved, muon._zeropower_via_newtonschulz = muon._zeropower_via_newtonschulz, newton_schulz
    try:
        yield
    finally:
        muon._zeropower_via_newtonschulz = saved


class Muon32:
    """MLP features → HIDDEN → HIDDEN → 1, the loss (MSE) in float32; Muon on the hidden matrix, AdamW on the
    rest; each micro-step backward(loss / N)."""

    ns64 = False

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                                         torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                                         torch.nn.Linear(HIDDEN, 1)).to(spec.device, spec.dtype)
        hidden = self.model[2].weight
        self.opts = [torch.optim.Muon([hidden], lr=0.1),
                     torch.optim.AdamW([p for p in self.model.parameters() if p is not hidden], lr=1e-2)]
        self.n, self.loss = spec.accum_steps, 0.0

    def micro_step(self, x, y, micro):
        loss = F.mse_loss(self.model(x).float(), y.float())
        (loss / self.n).backward()
        self.loss = self.loss + loss.detach().double() / self.n

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        with newton_schulz_in_param_dtype() if self.ns64 else contextlib.nullcontext():
            for o in self.opts:
                o.step()
        for o in self.opts:
            o.zero_grad()
        loss, self.loss = self.loss, 0.0
        return loss

    def params(self):
        return dict(self.model.named_parameters())


class Muon64(Muon32):
    ns64 = True


_reg = verify.data.regression(features=FEATURES)
muon32 = verify.adapter(data=_reg, name="honest MLP, torch.optim.Muon (bf16 Newton–Schulz), float32 loss")(Muon32)
muon64 = verify.adapter(data=_reg, name="honest MLP, torch.optim.Muon, Newton–Schulz in the params' dtype")(Muon64)
