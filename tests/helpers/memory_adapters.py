"""A trainer that is not a GPT, for verify.memory's tests: a position-wise MLP regressing one number per
vector of a set of `tokens` float vectors, SGD with momentum. Nothing of xtrain's: its own model, loss,
optimizer, options and data, declared as an adapter the way a user would.

Sized so accumulation is measurable on the CPU: one row's activations (tokens × hidden floats per layer,
~16 MiB) are well above the 4 MiB noise floor, the parameters (~1.2 MiB) well below them.
Referenced as `tests.helpers.memory_adapters:NAME` (the CLI tests run from the repository root with it on
PYTHONPATH, so the probe processes import it too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verify import Adapter, Spec


@dataclass(frozen=True)
class MLPOptions:
    tokens: int = 2048
    features: int = 64
    hidden: int = 512
    lr: float = 1e-2

    def describe(self) -> str:
        return f"T={self.tokens} F={self.features} H={self.hidden} lr={self.lr:g}"


def vectors(rows: int, seed: int, options: MLPOptions | None = None):
    o = options or MLPOptions()
    g = torch.Generator().manual_seed(int(seed))
    x = torch.randn(rows, o.tokens, o.features, generator=g, dtype=torch.float64)
    return x, torch.tanh(x.sum(-1, keepdim=True) / o.features ** 0.5)


class MLPTrainer:
    def __init__(self, spec: Spec):
        o = spec.options or MLPOptions()
        g = torch.Generator().manual_seed(spec.seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(o.features, o.hidden), torch.nn.GELU(),
                                         torch.nn.Linear(o.hidden, o.hidden), torch.nn.GELU(),
                                         torch.nn.Linear(o.hidden, 1))
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        self.model.to(device=spec.device, dtype=spec.dtype)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=o.lr, momentum=0.9)
        self.n, self._loss = spec.accum_steps, None

    def micro_step(self, inputs, targets, micro):
        loss = F.mse_loss(self.model(inputs), targets)
        (loss / self.n).backward()
        self._loss = loss.detach() if micro == 0 else self._loss + loss.detach()

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._loss / self.n

    def params(self):
        return {k: p.detach() for k, p in self.model.named_parameters()}


mlp = Adapter(factory=MLPTrainer, data=vectors, defaults=MLPOptions(), name="position-wise MLP (tests)")
tiny_mlp = Adapter(factory=MLPTrainer, data=vectors, defaults=MLPOptions(tokens=4, features=3, hidden=5),
                   name="tiny position-wise MLP (tests)")


def gibibyte_model(query):
    """A user's own memory model (the predicted_peak hook), deliberately wrong: 1 GiB for every configuration,
    far above what the tiny MLP allocates, so verify.memory must call the ratio absurd and exit 1."""
    from verify.memory import Prediction

    return Prediction(mode="one GiB", peaks={c: dict(bytes=2**30, terms={"everything": 2**30}) for c in query.configs},
                      quantity="a fixed guess", text="Mode **one GiB** (tests/helpers/memory_adapters.py).")


tiny_mlp_modelled = tiny_mlp.replace(predicted_peak=gibibyte_model)
