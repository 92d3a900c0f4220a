"""Deliberately broken fp16 trainers of the overflow path: each passes every gate that draws only windows
without an overflow, and changes one thing in xtrain's trainer. The injected-overflow gate
(verify/_internal/gates/overflow.py) must reject each, naming the window and the rank.

    skip_decided_on_one_rank     rank 0 alone sees the inf and skips; the other ranks clear non-finite
                                 entries after the all-reduce (nan_to_num) and step: the ranks diverge
    skip_only_overflowing_micro  a micro-step whose backward overflowed is dropped (its contribution undone),
                                 the rest of the window is stepped
    scaler_update_every_micro    scaler.unscale_() + update() after every micro-step: an overflowing window
                                 backs the scale off twice (broken_numerics.UnscaleUpdateEveryMicro)
    nan_to_num_before_check      inf/NaN gradients zeroed after every micro-step, before the scaler's check:
                                 the window is stepped (broken_numerics.SanitizeNonFinite)
    found_inf_of_rank_0_tokens   a hand-written fp16 data-parallel loop (FoundInfOfRankZero, not xtrain's;
    found_inf_of_rank_0_float    token and float data, no overflow= hook: the harness injects): each rank's
                                 found_inf from its own gradient, then BROADCAST from rank 0 instead of
                                 all-reduced. An overflow on rank 0 skips everywhere; one on another rank is
                                 stepped on by every rank. found_inf_all_reduced_* is the same loop done
                                 right (all-reduce MAX), a control that passes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from xtrain_core.distributed import DistAccumTrainer
from xtrain_core.trainer import AccumTrainer

from xtrain_proof import adapters as xtrain
from planted.template import ModelState, Planted, window_loss
from planted.broken_numerics import SanitizeNonFinite, unscale_update_every_micro
from verify.data import regression, tokens
from verify import adapter

__all__ = ["skip_decided_on_one_rank", "skip_only_overflowing_micro", "scaler_update_every_micro",
           "nan_to_num_before_check", "found_inf_of_rank_0_tokens", "found_inf_of_rank_0_float",
           "found_inf_all_reduced_tokens", "found_inf_all_reduced_float"]


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


def _world():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class FoundInfOfRankZero(ModelState):
    """Static loss scaling by hand (Megatron / apex style): scaled backward per micro-step; at the boundary
    each rank checks ITS OWN gradient, the flag is broadcast from rank 0 (the bug), then the gradients are
    all-reduced. A skip halves the scale; a step unscales and steps without looking again."""

    decide = "broadcast"
    vocab = 0  # > 0: a token model (Embedding -> Linear, next-token cross-entropy) on integer inputs

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        v = self.vocab
        layers = ([torch.nn.Embedding(v, 8), torch.nn.Linear(8, v)] if v else
                  [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)])
        self.model = torch.nn.Sequential(*layers).to(spec.device, spec.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.n, self.losses, self.device = spec.accum_steps, [], torch.device(spec.device).type
        self.fp16, self.scale, self.found = spec.precision == "fp16", 2.0**8, None

    def _loss(self, x, y):
        out = self.model(x).float()
        return F.cross_entropy(out.flatten(0, 1), y.flatten()) if self.vocab else F.mse_loss(out, y)

    def micro_step(self, x, y, micro):
        with torch.autocast(self.device, dtype=torch.float16, enabled=self.fp16):
            loss = self._loss(x, y)
        (loss * (self.scale if self.fp16 else 1.0) / self.n).backward()
        self.losses.append(loss.detach())
        if micro < self.n - 1:
            return
        grads = [p.grad for p in self.model.parameters()]
        found = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()
        if _world() > 1:
            if self.decide == "broadcast":
                dist.broadcast(found, src=0)  # the bug: rank 0's own gradient decides for every rank
            else:
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
            for g in grads:
                dist.all_reduce(g)
                g.div_(_world())
        self.found = bool(found)

    def grads(self):
        s = self.scale if self.fp16 else 1.0
        return {k: p.grad / s for k, p in self.model.named_parameters()}

    def optimizer_step(self):
        if self.fp16 and self.found:
            self.scale /= 2  # skipped: no step
        else:
            for p in self.model.parameters():
                p.grad.div_(self.scale if self.fp16 else 1.0)
            self.opt.step()
        self.opt.zero_grad()
        loss, self.losses = window_loss(self.losses, _world()), []
        return loss

    def loss_scale(self):
        return self.scale


class FoundInfOfRankZeroTokens(FoundInfOfRankZero):
    vocab = 16


class FoundInfAllReduced(FoundInfOfRankZero):
    decide = "all_reduce"


class FoundInfAllReducedTokens(FoundInfOfRankZeroTokens):
    decide = "all_reduce"


class NanToNumBeforeCheck(SanitizeNonFinite):
    """broken_numerics.SanitizeNonFinite, as an adapter of this module."""


_adapter = xtrain.variant
skip_decided_on_one_rank = _adapter(SkipDecidedOnOneRank, xtrain.data_parallel)
skip_only_overflowing_micro = _adapter(SkipOnlyOverflowingMicro, xtrain.single)
scaler_update_every_micro = unscale_update_every_micro  # the same planted bug, already an adapter there
nan_to_num_before_check = _adapter(NanToNumBeforeCheck, xtrain.single)

_FP16 = dict(precisions=("fp32", "fp16"), data_parallel=True)  # no overflow= hook: the harness injects
found_inf_of_rank_0_tokens = adapter(data=tokens(vocab=16, seq_len=4), name="broken: FoundInfOfRankZeroTokens",
                                     **_FP16)(FoundInfOfRankZeroTokens)
found_inf_of_rank_0_float = adapter(data=regression(features=8), name="broken: FoundInfOfRankZero",
                                    **_FP16)(FoundInfOfRankZero)
found_inf_all_reduced_tokens = adapter(data=tokens(vocab=16, seq_len=4), name="control: FoundInfAllReducedTokens",
                                       **_FP16)(FoundInfAllReducedTokens)
found_inf_all_reduced_float = adapter(data=regression(features=8), name="control: FoundInfAllReduced",
                                      **_FP16)(FoundInfAllReduced)
