"""Deliberately broken fp16 trainers of the overflow path: each passes every gate that draws only windows
without an overflow, and changes one thing in xtrain's trainer. The injected-overflow gate
(verify/gates/overflow.py) must reject each, naming the window and the rank.

    skip_decided_on_one_rank     rank 0 alone sees the inf and skips; the other ranks clear non-finite
                                 entries after the all-reduce (nan_to_num) and step: the ranks diverge
    skip_only_overflowing_micro  a micro-step whose backward overflowed is dropped (its contribution undone),
                                 the rest of the window is stepped
    scaler_update_every_micro    scaler.unscale_() + update() after every micro-step: an overflowing window
                                 backs the scale off twice (broken_numerics.UnscaleUpdateEveryMicro)
    nan_to_num_before_check      inf/NaN gradients zeroed after every micro-step, before the scaler's check:
                                 the window is stepped (broken_numerics.SanitizeNonFinite)
"""
from __future__ import annotations

import torch

from xtrain_core.distributed import DistAccumTrainer
from xtrain_core.trainer import AccumTrainer

from . import xtrain
from .template import Planted
from .broken_numerics import SanitizeNonFinite, unscale_update_every_micro

__all__ = ["skip_decided_on_one_rank", "skip_only_overflowing_micro", "scaler_update_every_micro",
           "nan_to_num_before_check"]


class SkipDecidedOnOneRank(DistAccumTrainer):
    """The overflow decision is rank 0's: the others sanitize the reduced gradient and step."""

    def _finish_boundary(self):
        super()._finish_boundary()
        if torch.distributed.get_rank(self.group) != 0:  # rank 0 of its group (a launched sub-world's too)
            torch.nan_to_num_(self.flat, nan=0.0, posinf=0.0, neginf=0.0)


class SkipOnlyOverflowingMicro(Planted, AccumTrainer):
    """Each micro-step's backward is checked on its own: one that overflowed is undone, the window goes on."""

    def before(self, idx, targets, micro):
        self._kept = [g.clone() for g in self._grads_list()] if micro else None

    def after(self, micro):
        before = self._kept
        with torch.no_grad():
            if not all(bool(torch.isfinite(g).all()) for g in self._grads_list()):
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
                if before is not None:
                    for g, b in zip(self._grads_list(), before):
                        g.copy_(b)


class NanToNumBeforeCheck(SanitizeNonFinite):
    """broken_numerics.SanitizeNonFinite, as an adapter of this module."""


_adapter = xtrain.variant
skip_decided_on_one_rank = _adapter(SkipDecidedOnOneRank, xtrain.data_parallel)
skip_only_overflowing_micro = _adapter(SkipOnlyOverflowingMicro, xtrain.single)
scaler_update_every_micro = unscale_update_every_micro  # the same planted bug, already an adapter there
nan_to_num_before_check = _adapter(NanToNumBeforeCheck, xtrain.single)
