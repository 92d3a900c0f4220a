"""Deliberately broken trainers of token weighting, mixed precision and long accumulation windows. Each
reproduces a bug users hit and changes one thing in xtrain's trainer; the gates must reject every one
where the bug can exist.

token weighting (padded data; every one agrees with the big batch while all micro-batches and ranks hold
the same number of valid tokens, so only padding shows them — transformers #24725, torchtitan #1842):
    per_micro_mean          CE mean per micro-batch × 1/N (loss_norm="mean" on padded data)
    per_rank_mean           each rank divides by its own token count, then the ranks are averaged (/W)
    count_divided_twice     the accumulated sum divided by the token count twice
    count_from_first_micro  the window's count taken as N × micro-step 0's count
mixed precision (fp16 GradScaler, bf16):
    unscale_update_every_micro   scaler.unscale_() + scaler.update() after every micro-step (an overflow
                                 check per micro-step): earlier micro-steps are unscaled again and again
    manual_unscale_every_micro   the accumulated gradient divided by the scale by hand after every
                                 micro-step, then unscaled once more at the boundary
    bf16_accumulation_buffer     gradients summed in a bf16 buffer: rounding grows with N
    SanitizeNonFinite            inf/NaN gradients zeroed per micro-step, so a poisoned window is stepped
                                 (no gate: poisoned_window_job below runs it, tests/core/test_numerics.py checks it)
long windows:
    drop_micro_63           micro-step 63 never backwards (only when N ≥ 64)
    doubling_buffer         the accumulated gradient doubles before each micro-step adds to it
    narrow_counter          a run-long micro-step counter in uint8 finds each window's start: it wraps at 256, so a
                            window holding micro-step 256 restarts there (only once the RUN passes 256 micro-steps)
"""
from __future__ import annotations

import torch

from xtrain_core.distributed import DistAccumTrainer
from xtrain_core.trainer import AccumTrainer

from xtrain_proof import adapters as xtrain
from planted.template import Planted


# -- token weighting ---------------------------------------------------------------------------------

class PerMicroMean(AccumTrainer):
    """transformers #24725: the CE MEAN of each micro-batch × 1/N, whatever its number of valid tokens."""

    def __init__(self, model, optim, accum_steps, **numerics):
        super().__init__(model, optim, accum_steps, **{**numerics, "loss_norm": "mean"})


class CountDividedTwice(AccumTrainer):
    def _normalize(self, tokens, ranks=1):
        super()._normalize(tokens, ranks)
        if tokens:
            torch._foreach_div_(self._grads_list(), float(tokens))


class CountFromFirstMicro(AccumTrainer):
    """The window's token count estimated as N × micro-step 0's (exact only for equal micro-batches)."""

    def _objective(self, *a, **k):
        out = super()._objective(*a, **k)
        if a[-1] == 0:
            self._first = int(self._den) if torch.is_tensor(self._den) else self._den
        return out

    def _normalize(self, tokens, ranks=1):
        super()._normalize(self.accum_steps * self._first if tokens else tokens, ranks)


class PerRankMean(Planted, DistAccumTrainer):
    """Each rank normalizes by its OWN window's token count, the boundary averages the ranks (/W):
    right only when every rank holds as many valid tokens as every other."""

    def before(self, idx, targets, micro):
        if micro == self.accum_steps - 1 and self.world > 1:
            self._local_tokens = int((self._den if micro else 0)) + int((targets != -100).sum())

    def _objective(self, *a, **k):
        total = super()._objective(*a, **k)
        micro = a[-1]
        if self.world > 1 and micro == self.accum_steps - 1 and self._local_tokens:
            with torch.no_grad():  # this rank's earlier micro-steps, now normalized by its own count
                self.flat[:self.numel].mul_(self._positions / self._local_tokens)
            return total * (self._positions / self._local_tokens)
        return total

    def _finish_boundary(self):
        for b in range(self._next_bucket, len(self.buckets)):
            self._left[b] = 0
        self._launch_ready()
        for w in self._works:
            w.wait()
        self._works = []
        self.flat[:self.numel].div_(self.world)  # the average of per-rank means


# -- mixed precision ---------------------------------------------------------------------------------

class UnscaleUpdateEveryMicro(Planted, AccumTrainer):
    def between(self, micro):
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)  # "check for overflow" each micro-step ...
            self.scaler.update()  # ... which needs an update() before the next unscale_()


class ManualUnscaleEveryMicro(Planted, AccumTrainer):
    def between(self, micro):
        if self.scaler is not None:
            torch._foreach_div_(self._grads_list(), self.scaler.get_scale())


class Bf16AccumulationBuffer(Planted, AccumTrainer):
    """Each micro-step's gradient is added into a bf16 buffer (8 significant bits): once the running sum
    is large next to one micro-step's share, additions round away, so the error grows with N."""

    def after(self, micro):
        if self.precision != "bf16":
            return
        if micro == 0:
            self._buf = {p: p.grad.to(torch.bfloat16) for p in self.model.parameters() if p.grad is not None}
        else:
            for p, b in self._buf.items():
                b.add_(p.grad.to(torch.bfloat16))
        for p in self._buf:
            p.grad = None if micro < self.accum_steps - 1 else self._buf[p].float()


class SanitizeNonFinite(Planted, AccumTrainer):
    """nan_to_num on the gradient after every micro-step ("robustness"): an inf in micro-step 0 vanishes
    and the window is stepped, where it must be skipped whole."""

    def after(self, micro):
        with torch.no_grad():
            for g in self._grads_list():
                torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)


# -- long windows ------------------------------------------------------------------------------------

class DropMicro63(AccumTrainer):
    def _backward(self, objective):
        if not (self.accum_steps >= 64 and self._next_micro == 63):  # micro-step 63: counted, never backwarded
            super()._backward(objective)


class DoublingBuffer(Planted, AccumTrainer):
    def before(self, idx, targets, micro):
        if micro > 0:
            torch._foreach_mul_(self._grads_list(), 2.0)


class NarrowCounter(Planted, AccumTrainer):
    """zero_grad where its own micro-step counter says a window starts (count % N == 0), the count kept in a uint8:
    right until the run's 256th micro-step, where the count wraps to 0 — mid-window wherever N does not divide 256,
    dropping what that window had accumulated. Only a run of more than 256 micro-steps (K ≥ 2 at N > 128) shows it."""

    def before(self, idx, targets, micro):
        count = getattr(self, "_count", None)
        count = self._count = torch.zeros((), dtype=torch.uint8) if count is None else count
        if int(count) % self.accum_steps == 0:
            self.opt.zero_grad(set_to_none=True)
        count += 1  # uint8: 255 + 1 == 0


def _adapter(cls, base=xtrain.single):
    return xtrain.variant(cls, base)


_single_tokens = xtrain.tokens_adapter.replace(factory=xtrain.single_factory, data_parallel=False)
_dist_tokens = xtrain.tokens_adapter.replace(factory=xtrain.dist_factory, process_group=True)  # a DistAccumTrainer:
# even alone it runs in a (one-rank) group

per_micro_mean = _adapter(PerMicroMean, _single_tokens)
count_divided_twice = _adapter(CountDividedTwice, _single_tokens)
count_from_first_micro = _adapter(CountFromFirstMicro, _single_tokens)
per_rank_mean = _adapter(PerRankMean, _dist_tokens)
unscale_update_every_micro = _adapter(UnscaleUpdateEveryMicro)
manual_unscale_every_micro = _adapter(ManualUnscaleEveryMicro)
bf16_accumulation_buffer = _adapter(Bf16AccumulationBuffer)
drop_micro_63 = _adapter(DropMicro63)
doubling_buffer = _adapter(DoublingBuffer)
narrow_counter = _adapter(NarrowCounter)


# -- a poisoned window, for the fp16 "skip the whole step" check (xtrain-specific: it reaches into .grad) --

def poisoned_window_job(ctx, kind: str, accum_steps: int, poison_rank: int) -> dict:
    """One fp16 window of `accum_steps` micro-steps on every rank of a pool, with an inf written into one
    gradient element on rank `poison_rank` right after micro-step 0's backward. kind: "xtrain" (AccumTrainer
    alone, DistAccumTrainer in a group) or "sanitize" (SanitizeNonFinite, one rank). Returns what the
    boundary did: whether parameters moved, the schedule advanced, the scale backed off."""
    from xtrain_core.config import ModelConfig, OptimConfig
    from xtrain_core.model import build_model

    base = {"xtrain": DistAccumTrainer if ctx.world > 1 else AccumTrainer, "sanitize": SanitizeNonFinite}[kind]

    class Poisoned(base):
        def micro_step(self, idx, targets, micro):
            super().micro_step(idx, targets, micro)
            if micro == 0 and ctx.rank == poison_rank:
                with torch.no_grad():
                    self._grads_list()[0].view(-1)[0] = float("inf")

    model = build_model(ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16), 0, device=ctx.device)
    t = Poisoned(model, OptimConfig(lr=1e-2, warmup_steps=3), accum_steps, precision="fp16")
    before = {k: v.clone() for k, v in t.params().items()}
    gen = torch.Generator().manual_seed(1)
    micro = [(torch.randint(0, 32, (2, 8), generator=gen).to(ctx.device),
              torch.randint(0, 32, (2, 8), generator=gen).to(ctx.device)) for _ in range(accum_steps)]
    scale = t.scaler.get_scale()
    t.train_step(micro)
    moved = any(not torch.equal(before[k], v) for k, v in t.params().items())
    finite = all(bool(torch.isfinite(v).all()) for v in t.params().values())
    return dict(rank=ctx.rank, moved=moved, finite=finite, last_skipped=t.last_skipped,
                schedule_steps=t.sched.last_epoch, scale_before=scale, scale_after=t.scaler.get_scale())
