"""The zoo's optimizers and LR schedules, as people build them: SGD, SGD with momentum, AdamW, a factored one
(torch.optim.Adafactor), and Muon on the hidden 2-D weights with AdamW for the rest (embeddings, head, biases,
norms, convolutions: torch.optim.Muon takes 2-D weights only). Each optimizer gets its own scheduler of the
same kind, stepped once per optimizer step.
"""
from __future__ import annotations

import math

import torch

from benchmarks.zoo.models import hidden_matrices

OPTIMIZERS = ("sgd", "momentum", "adamw", "adafactor", "muon")
SCHEDULES = ("none", "warmup", "step", "cosine", "linear")


def optimizers(kind: str, model: torch.nn.Module, params=None) -> list[torch.optim.Optimizer]:
    """The optimizers of `params` (default: the model's); Muon's first, so it is the one whose LR is logged."""
    params = list(model.parameters()) if params is None else list(params)
    if kind == "sgd":
        return [torch.optim.SGD(params, lr=0.05)]
    if kind == "momentum":
        return [torch.optim.SGD(params, lr=0.02, momentum=0.9, nesterov=True)]
    if kind == "adamw":
        return [torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)]
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2)]
    if kind == "muon":
        hidden = {id(p) for p in hidden_matrices(model)}
        matrices = [p for p in params if id(p) in hidden]
        rest = [p for p in params if id(p) not in hidden]
        out = [MuonInParamDtype(matrices, lr=0.02, weight_decay=0.01)] if matrices else []
        return out + ([torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01)] if rest else [])
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")


def newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's quintic Newton–Schulz iteration, in grad's own dtype (torch's runs it in bfloat16)."""
    a, b, c = ns_coefficients
    x = grad.T if grad.size(0) > grad.size(1) else grad
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


class MuonInParamDtype(torch.optim.Muon):
    """torch.optim.Muon with Newton–Schulz in the parameters' dtype: how a Muon user runs the gates (torch's bf16
    iteration is out of the float64 reference's reach until a native-precision mode: design/tolerance.md, "An update
    computed in bf16")."""

    def step(self, closure=None):
        import torch.optim._muon as muon

        saved, muon._zeropower_via_newtonschulz = muon._zeropower_via_newtonschulz, newton_schulz
        try:
            return super().step(closure)
        finally:
            muon._zeropower_via_newtonschulz = saved


def warmup(step: int) -> float:
    """A 3-step linear warm-up: the LR moves within the first steps, so a schedule stepped per micro-step shows."""
    return min(1.0, (step + 1) / 3)


def cosine(step: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(step, 100) / 100))


def schedulers(kind: str, opts) -> list:
    """One scheduler per optimizer; open-ended (a few dozen steps at least: the gates step up to 12 times)."""
    if kind == "none":
        return []
    make = {"warmup": lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup),
            "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8),
            "cosine": lambda o: torch.optim.lr_scheduler.LambdaLR(o, cosine),
            "linear": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=4)}
    if kind not in make:
        raise ValueError(f"scheduler must be one of {SCHEDULES}, got {kind!r}")
    return [make[kind](o) for o in opts]
