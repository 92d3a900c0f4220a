"""Deliberately broken token-weighted trainers that every split-based gate passes: each divides by a count
that is the same under every split of the window, or mishandles a window without a valid target. Only
the token-mean and empty-window gates (verify/_internal/gates/tokens.py) can see them; they must reject every one.

    all_positions       Σ CE over valid targets / every target position of the window, padding included
    count_plus_one      ... / (valid count + 1)
    sequences           ... / the number of sequences holding at least one valid target
    empty_div_by_zero   an empty window divided by its count of 0: NaN gradients, stepped
    empty_stepped       an empty window stepped on its zero gradient: AdamW's momentum and weight decay
                        move the parameters, its step count and the LR schedule advance

Each changes one thing in xtrain's single-process AccumTrainer (loss_norm="tokens"); none declares a plain
step (accum_steps=1 is not the textbook token mean: the bit-exact gate would name the bug first, which is
not what these show).
"""
from __future__ import annotations

import torch

from xtrain_core.model import IGNORE
from xtrain_core.trainer import AccumTrainer

from xtrain_proof import adapters as xtrain


class _WindowCount(AccumTrainer):
    """The token-weighted sum path at every N (N == 1 included, so the count is split-consistent), the
    accumulated Σ CE divided by `count()` of the whole window instead of its valid targets."""

    def _reset_window(self):
        super()._reset_window()
        self._rows_with_target = 0

    def _objective(self, forward_mean, forward_sum, idx, targets, micro, *, alone):
        self._rows_with_target += int(((targets != IGNORE).sum(1) > 0).sum())
        return super()._objective(forward_mean, forward_sum, idx, targets, micro, alone=False)

    def count(self, tokens: int) -> int:
        raise NotImplementedError

    def _finish(self):
        tokens = int(self._den)
        if tokens:  # the sum path backwarded Σ/(N·B·S): × N·B·S / count
            torch._foreach_mul_(self._grads_list(), self._positions / self.count(tokens))

    def _step_loss(self):
        tokens = int(self._den)
        return self._num / self.count(tokens) if tokens else torch.full_like(self._num, float("nan"))


class AllPositions(_WindowCount):
    def count(self, tokens):
        return self._positions  # N·B·S: every target position, padding included


class CountPlusOne(_WindowCount):
    def count(self, tokens):
        return tokens + 1


class Sequences(_WindowCount):
    def count(self, tokens):
        return self._rows_with_target


class EmptyDivByZero(_WindowCount):
    """The right count, divided without a guard: 0/0 on an empty window, and the window stepped."""

    def count(self, tokens):
        return tokens

    def _finish(self):
        grads = self._grads_list()  # a tensor count: 0/0 is NaN, not a ZeroDivisionError
        torch._foreach_div_(grads, self._den.to(grads[0].dtype) / self._positions)

    def _window_tokens(self):
        return None  # never "empty": _update always steps


class EmptyStepped(AccumTrainer):
    """The right count; an empty window stepped like any other on its zero gradient."""

    def _window_tokens(self):
        tokens = super()._window_tokens()
        return None if tokens == 0 else tokens


def _adapter(cls):
    return xtrain.variant(cls, xtrain.tokens_adapter.replace(factory=xtrain.single_factory, data_parallel=False,
                                                             plain=None, precisions=("fp32",)))


all_positions = _adapter(AllPositions)
count_plus_one = _adapter(CountPlusOne)
sequences = _adapter(Sequences)
empty_div_by_zero = _adapter(EmptyDivByZero)
empty_stepped = _adapter(EmptyStepped)
