"""The self-test's wrapper (verify/selftest/operators.py): a Mutant delegates to the trainer under test and
lets one Operator override one behaviour: a micro-step, the boundary gradient, the step loss, the metrics it
reports, or what torch.distributed does around each call. Design: docs/design/self-test.md.
"""
from __future__ import annotations

import contextlib

import torch

from verify.selftest.metric_ops import world as _world

__all__ = ["Mutant", "respec"]


def respec(spec, per_window, **kw):
    """`spec` with accum_steps per_window(N), and each declared window's count (Spec.windows: a short last
    window) mapped alike, so the inner trainer's windows stay those of the operator's bug."""
    from dataclasses import replace

    windows = None if spec.windows is None else tuple(per_window(m) for m in spec.windows)
    return replace(spec, accum_steps=per_window(spec.accum_steps), windows=windows, **kw)


class Mutant:
    """The wrapper: delegates to the inner trainer; an operator overrides one behaviour."""

    def __init__(self, op, factory, spec, ignore_index=None, metrics=None, objective=None):
        self.op, self.N, self.ignore, self.precision, self.spec = op, spec.accum_steps, ignore_index, spec.precision, spec
        self.make, self.objective = factory, objective  # objective operators build the term alone (Spec.terms)
        self.declared, self.prev_lr, self.last = metrics, None, {}  # metrics operators: the declaration, the last window
        self.inner = factory(respec(spec, op.inner_accum))
        # per_micro_mean: a second trainer, one micro-batch per window, to read each micro-batch's own mean
        self.aux = factory(respec(spec, lambda n: 1)) if op.aux else None
        self._scaled = False  # boundary-gradient operators act once per step
        self._stale = None  # stale_micro_batch: the previous step's last micro-batch
        self._reset()

    def _reset(self) -> None:
        self.counts = [0.0, 0.0, 0.0, 0.0]  # this rank's window: valid targets, target positions, rows, micro-step 0's valid
        self.micro_last = (0, 0)  # the last micro-step's valid targets and rows
        self.sumsq, self.own_last = None, None  # Σ g² per name at the boundary; the last micro-batch's (norm, loss)
        self.micro_grads, self.micro_losses = [], []
        self.low_sum, self.low_weight = None, 0.0  # low_precision_accumulation: Σ c_m·g_m in bf16 / fp16, Σ c_m
        self.factor = 1.0

    # -- the protocol --------------------------------------------------------------------------------
    def micro_step(self, x, y, micro):
        valid = int((y != self.ignore).sum()) if self.ignore is not None else y.numel()
        self.counts = [self.counts[0] + valid, self.counts[1] + y.numel(), self.counts[2] + y.shape[0],
                       self.counts[3] + (valid if micro == 0 else 0)]
        self.micro_last = (valid, int(y.shape[0]))
        with self._around():
            self.op.micro(self, x, y, micro)

    def grads(self):
        with self._around():
            g = self.inner.grads()
        self._boundary(g)
        self._sumsq(g)
        return g

    def optimizer_step(self):
        if self.op.scale is not None and not self._scaled:
            self._boundary(self.inner.grads())
        if self.op.metrics is not None and self.sumsq is None:  # grads_from="optimizer": the harness read none
            self._sumsq(self.inner.grads())
        self._scaled = False
        with self._around():
            loss = self.op.loss(self, self.inner.optimizer_step())
        self.last = dict(sumsq=self.sumsq, micro_last=self.micro_last, own_last=self.own_last)
        self._reset()
        return loss

    def metrics(self):
        out = dict(self.inner.metrics()) if callable(getattr(self.inner, "metrics", None)) else {}
        return self.op.metrics(self, out) if self.op.metrics is not None else out

    def _sumsq(self, g: dict) -> None:
        if self.op.metrics is not None:
            self.sumsq = {k: float(v.detach().double().pow(2).sum()) for k, v in g.items() if v is not None}

    def params(self):
        with self._around():
            return self.inner.params()

    def _around(self):
        return self.op.around(self) if self.op.around is not None else contextlib.nullcontext()

    def _boundary(self, grads: dict) -> None:
        if not self._scaled and self.op.scale is not None:
            f = self.factor = self.op.scale(self)
            if callable(self.op.replace_grads):
                self.op.replace_grads(self, grads)
            elif f != 1.0:
                with torch.no_grad():
                    for g in grads.values():
                        g.mul_(f)
        self._scaled = True

    def window_counts(self) -> list[float]:
        """[valid targets, target positions, rows, micro-step 0's valid targets] of the whole window: this
        rank's, summed over ranks by one all_reduce where there are several (inside grads(): the harness's
        reading, reported, not judged as training traffic)."""
        if _world() == 1:
            return list(self.counts)
        import torch.distributed as dist

        dev = next(iter(self.inner.params().values())).device
        t = torch.tensor(self.counts, dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        return t.tolist()
