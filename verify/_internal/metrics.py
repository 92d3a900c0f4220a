"""Reported metrics: what a trainer logs per optimizer step (`Metrics`, its declaration) and what the harness
sees of the same step itself (`Observer`, inside the harness's loop), so that the metrics gate
(gates/metrics.py) can compare the two. Conventions, each metric's meaning and why the gate judges the
float64 runs: docs/design/metrics.md.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from verify._internal.declare import AdapterError

__all__ = ["Metrics", "METRIC_NAMES", "CONVENTIONS", "Observer", "max_norm_of"]

METRIC_NAMES = ("loss", "grad_norm", "clip_coef", "lr", "tokens", "rows")
# each convention a trainer may declare, first the default; a declaration changes what is expected, never whether
CONVENTIONS = {
    "loss": ("window", "last_micro"),  # the window's mean over every rank | this rank's last micro-batch's loss
    "grad_norm": ("pre_clip", "post_clip"),  # ‖the boundary gradient‖ over every element once | after clipping
    "lr": ("applied", "next"),  # the LR this step applied | the LR after the scheduler's step (the next step's)
    "counts": ("global", "rank"),  # tokens / rows of the whole window over every rank | of this rank's share
}
ENABLE = "declare @verify.adapter(metrics=verify.Metrics(names=(...))) and return them from metrics()"


@dataclass(frozen=True, kw_only=True)
class Metrics:
    """What a trainer's metrics() returns after each optimizer_step(), {name: float}: `names` ⊆ METRIC_NAMES
    (loss, grad_norm, clip_coef, lr, tokens, rows), the conventions it follows (CONVENTIONS) and the clip
    threshold `max_norm` (a float, or options -> float | None; None: no clipping). With max_norm the harness
    also checks the coefficient the optimizer saw applied, whether or not clip_coef is reported."""

    names: tuple[str, ...] = ()
    max_norm: float | Callable[[Any], float | None] | None = None
    loss: str = "window"
    grad_norm: str = "pre_clip"
    lr: str = "applied"
    counts: str = "global"
    clip_eps: float = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coefficient = max_norm / (norm + clip_eps)

    def __post_init__(self):
        names = (self.names,) if isinstance(self.names, str) else tuple(self.names)
        bad = [n for n in names if n not in METRIC_NAMES]
        if bad:
            raise AdapterError(f"Metrics.names must be among {', '.join(METRIC_NAMES)}, got {bad[0]!r}")
        object.__setattr__(self, "names", names)
        for field, allowed in CONVENTIONS.items():
            if getattr(self, field) not in allowed:
                raise AdapterError(f"Metrics.{field} must be one of {', '.join(map(repr, allowed))}, "
                                   f"got {getattr(self, field)!r}")
        if self.max_norm is not None and not callable(self.max_norm) and not float(self.max_norm) > 0:
            raise AdapterError(f"Metrics.max_norm must be > 0, a callable (options -> float | None) or None, "
                               f"got {self.max_norm!r}")

    def declared(self) -> dict:
        """The report's line: the names, the threshold and the conventions that are not the defaults."""
        cap = self.max_norm
        if callable(cap):
            cap = f"{getattr(cap, '__module__', '?')}.{getattr(cap, '__qualname__', repr(cap))}"
        return {"names": list(self.names), **({"max_norm": cap} if cap is not None else {}), **self.conventions()}

    def conventions(self) -> dict:
        """The declared conventions that are not the defaults (the report lists them)."""
        return {f: getattr(self, f) for f, allowed in CONVENTIONS.items() if getattr(self, f) != allowed[0]}


def max_norm_of(metrics: Metrics | None, options) -> float | None:
    """The clip threshold of one case's options (None: no clipping, or none declared)."""
    if metrics is None or metrics.max_norm is None:
        return None
    m = metrics.max_norm(options) if callable(metrics.max_norm) else metrics.max_norm
    return None if m is None else float(m)


def _sumsq(t: torch.Tensor) -> float:
    return float(t.detach().double().pow(2).sum())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if callable(getattr(t, "to_local", None)) else t


def _key(t: torch.Tensor) -> tuple:
    """A parameter by its storage: stepped twice (two optimizers, or a retried step), it counts once."""
    t = _local(t)
    return t.data_ptr(), tuple(t.shape), t.dtype


class Observer:
    """One run's view of every optimizer step, collected by the harness's loop (cases/case.py drive):

        micro(targets)   the valid targets and rows this rank handed the trainer
        grads(g)         Σ g² per name of the boundary gradient grads() returned (pre-clip; a DTensor whole: a
                         collective in the harness's "grads" window), and this rank's local share
        stepping(t)      around optimizer_step(): each optimizer's step pre-hook reads the LR it applies and
                         Σ g² of this rank's gradients as stepped (after clipping); afterwards the LR it holds
        reported(t)      what metrics() returned
    One dict per step in `steps` (plain floats: it pickles back from pool ranks). `scaled`: a bf16 / fp16 run
    (gates/metrics.py judge_precision), whose trainer's loss_scale() is read as its step begins: the scale the
    window's backward used, so a failure can name it."""

    def __init__(self, metrics: Metrics, ignore_index: int | None, *, scaled: bool = False):
        self.metrics, self.ignore, self.steps, self.scaled = metrics, ignore_index, [], scaled
        self.opts: list = []  # the optimizers an earlier step saw: their own pre-clip gradients are read from then on
        self._new()

    def _new(self) -> None:
        # pre / applied: (Σ g², elements) of this rank's gradients before clipping / as an optimizer stepped them
        self.cur = dict(micro_tokens=[], micro_rows=[], sumsq=None, elements=0, pre=None, applied=None, lr=None,
                        lr_after=None, stepped=False, loss_scale=None, reported={})

    def micro(self, targets: torch.Tensor) -> None:
        valid = int((targets != self.ignore).sum()) if self.ignore is not None else targets.numel()
        self.cur["micro_tokens"].append(valid)
        self.cur["micro_rows"].append(int(targets.shape[0]))

    def grads(self, g: dict) -> None:
        full = {k: (v.full_tensor() if callable(getattr(v, "full_tensor", None)) else v) for k, v in g.items()
                if v is not None}
        self.cur["sumsq"] = {k: _sumsq(v) for k, v in full.items()}
        self.cur["elements"] = sum(v.numel() for v in full.values())
        local = [_local(v) for v in g.values() if v is not None]
        self.cur["pre"] = (sum(map(_sumsq, local)), sum(v.numel() for v in local))
        if self.opts:  # the optimizer's own view before it clips (FSDP2: this rank's shards, where grads() is whole)
            mine = _stepped(self.opts)
            # a scaled run's optimizer may still hold the scaled gradient (unscale_ inside optimizer_step, grads()
            # a copy): where it holds the same elements as grads(), grads() is the view
            if not (self.scaled and mine[1] == self.cur["pre"][1]):
                self.cur["pre"] = mine

    @contextlib.contextmanager
    def stepping(self, trainer):
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        opts = []  # every optimizer stepped inside optimizer_step() is the trainer's

        def pre(opt, args, kwargs):  # every optimizer stepped: the LR it applies, first
            if not opts:
                lr = opt.param_groups[0].get("lr")
                self.cur["lr"] = None if lr is None else float(lr)
            if opt not in opts:
                opts.append(opt)
                self.cur["applied"] = _stepped(opts)  # its gradients as stepped: after clipping

        scale = getattr(trainer, "loss_scale", None)
        if self.scaled and callable(scale):  # before optimizer_step(): the scale before the scaler's update()
            self.cur["loss_scale"] = float(scale())
        handle = register_optimizer_step_pre_hook(pre)
        try:
            yield
        finally:
            handle.remove()
        if opts:
            self.cur["stepped"] = True
            self.opts = opts
            lr = opts[0].param_groups[0].get("lr")
            self.cur["lr_after"] = None if lr is None else float(lr)

    def reported(self, trainer) -> None:
        fn = getattr(trainer, "metrics", None)
        got = fn() if callable(fn) else None
        out = {}
        for k, v in (got or {}).items():
            if v is None:
                continue
            try:
                out[k] = float(v)
            except (TypeError, ValueError):
                out[k] = repr(v)  # the gate names it: a metric must read as a number
        self.cur["reported"] = out
        self.steps.append(self.cur)
        self._new()


def _stepped(opts) -> tuple[float, int]:
    """(Σ g², elements) over the local gradients of every parameter these optimizers hold, each storage once."""
    seen = {}
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and _key(p) not in seen:
                    g = _local(p.grad)
                    seen[_key(p)] = (_sumsq(g), g.numel())
    return sum(s for s, _ in seen.values()), sum(n for _, n in seen.values())


def applied_coef(step: dict) -> float | None:
    """‖this rank's gradient as stepped‖ / ‖the same before clipping‖: the clip coefficient applied, where the
    two views hold the same elements (None: not stepped, nothing to divide, or different views)."""
    pre, applied = step.get("pre"), step.get("applied")
    if pre is None or applied is None or pre[1] != applied[1] or not pre[0] > 0:
        return None
    return math.sqrt(applied[0] / pre[0])


def norm_of(step: dict) -> float | None:
    """The harness's pre-clip norm of one step's boundary gradient (every element once), or None."""
    s = step.get("sumsq")
    return None if s is None else math.sqrt(sum(s.values()))
