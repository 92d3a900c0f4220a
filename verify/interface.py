"""The trainer-under-test interface: what the harness drives, and nothing more.

A trainer is built by a factory from a `Spec` (model, optimizer, N, seed, dtype). The harness then
calls, per optimizer step:

    for micro in range(N): trainer.micro_step(idx, targets, micro)   # (B, S) int64 each
    grads = trainer.grads()             # boundary gradient: after accumulation, before clip/step
    loss  = trainer.optimizer_step()    # clip, optimizer, schedule, zero_grad; the step loss
    trainer.params()                    # name -> tensor, any time

The harness never reaches into a trainer's internals: it controls the micro-step boundaries (so it
can attribute work to them) and compares what the four methods return. xtrain's `AccumTrainer` is
one implementation; verify/broken.py holds deliberately wrong ones that the gates must reject.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from xtrain_core.config import ModelConfig, OptimConfig
from xtrain_core.data import TokenStream
from xtrain_core.model import build_model


class Trainer(Protocol):
    def micro_step(self, idx: torch.Tensor, targets: torch.Tensor, micro: int) -> None: ...
    def grads(self) -> dict[str, torch.Tensor]: ...
    def optimizer_step(self) -> torch.Tensor | float: ...
    def params(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True, kw_only=True)
class Spec:
    model: ModelConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    accum_steps: int = 1
    seed: int = 0
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def build_model(self):
        return build_model(self.model, self.seed, dtype=self.dtype, device=self.device)


TrainerFactory = Callable[[Spec], Trainer]


def xtrain_factory(spec: Spec) -> Trainer:
    from xtrain_core.trainer import AccumTrainer

    return AccumTrainer(spec.build_model(), spec.optim, spec.accum_steps)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One drawn combination: schedule (N, B, K), shapes, seeds, optimizer."""

    accum_steps: int
    micro_batch: int
    seq_len: int
    steps: int
    model: ModelConfig
    optim: OptimConfig
    seed: int = 0
    data_seed: int = 0
    device: str = "cpu"
    world: int = 1
    """Data-parallel ranks; micro_batch is then B_local, per rank per micro-step."""

    @property
    def effective_batch(self) -> int:
        return self.accum_steps * self.micro_batch * self.world

    def spec(self, *, accum_steps: int | None = None, dtype=torch.float32, device: str | None = None) -> Spec:
        return Spec(model=self.model, optim=self.optim, seed=self.seed, dtype=dtype, device=device or self.device,
                    accum_steps=self.accum_steps if accum_steps is None else accum_steps)

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K big batches of (N·B·W, S), drawn in order from one stream."""
        s = TokenStream(self.model.vocab_size, self.seq_len, seed=self.data_seed)
        return [tuple(t.to(self.device) for t in s.next(self.effective_batch)) for _ in range(self.steps)]

    def __str__(self):
        m = self.model
        w = f" W={self.world}" if self.world != 1 else ""
        return (f"N={self.accum_steps} B={self.micro_batch}{w} S={self.seq_len} K={self.steps} "
                f"model(L={m.n_layer} h={m.n_head} d={m.d_model} V={m.vocab_size}) seed={self.seed}")


@dataclass
class Trace:
    """What one run returned: per-step losses, step-0 boundary grads, params after every step."""

    losses: list[float]
    grads0: dict[str, torch.Tensor]
    params: list[dict[str, torch.Tensor]]


def run(trainer: Trainer, batches, accum_steps: int) -> Trace:
    """Drive `trainer` over big batches, each split into `accum_steps` micro-batches in order."""
    losses, params, grads0 = [], [], None
    for idx, tgt in batches:
        for m, (x, y) in enumerate(zip(idx.chunk(accum_steps), tgt.chunk(accum_steps))):
            trainer.micro_step(x, y, m)
        if grads0 is None:
            grads0 = {k: g.detach().clone() for k, g in trainer.grads().items()}
        loss = trainer.optimizer_step()
        losses.append(float(loss))
        params.append({k: p.detach().clone() for k, p in trainer.params().items()})
    return Trace(losses, grads0, params)
