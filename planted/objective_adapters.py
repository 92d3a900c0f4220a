"""One correct trainer per declared normaliser (verify.Objective), and the bugs of each that the normaliser gate
(verify/_internal/gates/objective.py) must reject, naming the term and the factor or the weights that fit.

    correct     token_mean, seq_mean (TRL's grpo), seq_sum (Dr. GRPO), sum, row_mean (no padding), two_terms
                (a token mean plus a z-loss row mean, each alone under Spec.terms)
    broken      seq_token_weighted   a token weight where a sequence weight is declared
                seq_nonempty         sequences counted only when they hold a valid target (empty ones dropped)
                dr_grpo_own_length   Dr. GRPO's constant taken from each micro-batch's longest sequence (verl #3741)
                sum_over_n           ÷ N where a sum is declared
                z_missing_over_n     the z-loss term without the 1/N its sibling has (trl PRs #4935, #5828)
                z_over_n_twice       the z-loss term's 1/N applied twice

A tiny token model (embedding → linear head, AdamW): every term is summed over its units in each micro-step,
and the gradient divided by the window's count of them at the boundary — the one way a window-level normaliser
is exact under accumulation, since the count is known only when the window ends.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import verify

IGNORE = -100
VOCAB, SEQ, D = 12, 6, 8
Z_WEIGHT = 0.1  # the z-loss's weight: large enough that a wrong factor on it shows in every gradient


class Normalised:
    """The window's loss, by KIND: Σ over its units of `numerator` / the window's count of `units`."""

    KIND = "token_mean"

    def __init__(self, spec: verify.Spec):
        torch.manual_seed(spec.seed)
        self.model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, D), torch.nn.Linear(D, VOCAB)).to(spec.device,
                                                                                                       spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.n, self.terms = spec.accum_steps, spec.terms
        self._reset()

    def _reset(self):
        self.total, self.count, self.valid = 0.0, 0.0, 0

    def per_token(self, x, y):
        """(rows, S) cross-entropy of every valid target (0 at padding), the (rows, S) mask, the logits."""
        logits = self.model(x)
        mask = y != IGNORE
        ce = F.cross_entropy(logits.flatten(0, 1), y.clamp(min=0).flatten(), reduction="none").view_as(y)
        return ce * mask, mask, logits

    def numerator(self, ce, mask, micro):
        return ce.sum()

    def units(self, ce, mask) -> float:
        return float(mask.sum())

    def micro_step(self, x, y, micro):
        ce, mask, _ = self.per_token(x, y)
        num = self.numerator(ce, mask, micro)
        num.backward()
        self.total += float(num.detach())
        self.count += self.units(ce, mask)
        self.valid += int(mask.sum())

    def grads(self):
        if self.valid and self.count:  # divided once, by the window's count, before anyone reads the gradient
            for p in self.model.parameters():
                if p.grad is not None and not getattr(p, "_divided", False):
                    p.grad.div_(self.count)
                    p._divided = True
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        self.grads()
        return self._step(self.total / self.count if self.valid and self.count else float("nan"))

    def _step(self, loss):
        if self.valid:  # a window without a valid target is no step at all
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for p in self.model.parameters():
            p._divided = False
        self._reset()
        return loss

    def params(self):
        return dict(self.model.named_parameters())


class SeqMean(Normalised):
    KIND = "seq_mean"

    def numerator(self, ce, mask, micro):  # Σ over sequences of each one's token mean (an empty one: 0)
        return (ce.sum(1) / mask.sum(1).clamp(min=1)).sum()

    def units(self, ce, mask):
        return float(mask.shape[0])


class SeqSum(Normalised):
    KIND = "seq_sum"

    def numerator(self, ce, mask, micro):  # Dr. GRPO: Σ over tokens / the declared constant (the row length)
        return ce.sum() / SEQ

    def units(self, ce, mask):
        return float(mask.shape[0])


class Summed(Normalised):
    KIND = "sum"

    def units(self, ce, mask):
        return 1.0 if not self.count else 0.0  # the window's count stays 1: no division


class TwoTerms(Normalised):
    """A token-mean cross-entropy "ce" plus a z-loss "z" (PaLM's: a row mean of logsumexp²; each micro-batch's own
    row mean ÷ N, the window's row mean for equal micro-batches). Σ ce is backwarded with the count unknown and
    divided at the boundary; z is backwarded into its own buffer, added after that division. Builds only the
    terms Spec.terms names."""

    def _reset(self):
        super()._reset()
        self.z_grads, self.z_total = None, 0.0

    def micro_step(self, x, y, micro):
        want = self.terms or ("ce", "z")
        ce, mask, logits = self.per_token(x, y)
        self.valid += int(mask.sum()) if "ce" in want else x.shape[0]
        if "ce" in want:
            self.count += float(mask.sum())
            self.total += float(ce.sum().detach())
        z = Z_WEIGHT * torch.logsumexp(logits, dim=-1).pow(2).mean(-1).mean() * self.z_scale() / self.n
        params = list(self.model.parameters())
        if "z" in want:
            zg = torch.autograd.grad(z, params, retain_graph="ce" in want, allow_unused=True)
            self.z_grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(zg, params)] \
                if self.z_grads is None else [a + (b if b is not None else 0) for a, b in zip(self.z_grads, zg)]
            self.z_total += float(z.detach())
        if "ce" in want:
            ce.sum().backward()

    def z_scale(self) -> float:
        return 1.0  # what the z term's 1/N is multiplied by (the bugs change it)

    def grads(self):
        want = self.terms or ("ce", "z")
        for i, p in enumerate(self.model.parameters()):
            if getattr(p, "_divided", False):
                continue
            g = p.grad / self.count if "ce" in want and self.count else (p.grad if p.grad is not None else None)
            if self.z_grads is not None:
                g = self.z_grads[i] if g is None else g + self.z_grads[i]
            p.grad = g
            p._divided = True
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        want = self.terms or ("ce", "z")
        self.grads()
        ce = self.total / self.count if self.count else (0.0 if "ce" not in want else float("nan"))
        return self._step(ce + self.z_total)


# -- the bugs -----------------------------------------------------------------------------------------------

class SeqNonEmpty(SeqMean):
    def units(self, ce, mask):
        return float((mask.sum(1) > 0).sum())


class DrGrpoOwnLength(SeqSum):
    def numerator(self, ce, mask, micro):  # the micro-batch's longest valid length, not the declared constant
        return ce.sum() / mask.sum(1).max().clamp(min=1)


class MicroTokenMean(Normalised):
    def numerator(self, ce, mask, micro):  # each micro-batch's own token mean (clamped, as TRL 0.21's bnpo), ÷ N
        return ce.sum() / mask.sum().clamp(min=1)

    def units(self, ce, mask):
        return 1.0


class ShuffledMicroTokenMean(MicroTokenMean):
    """TRL 0.21's GRPOTrainer: the window's rows shuffled before they are split, then each micro-batch's own mean."""

    def micro_step(self, x, y, micro):
        self.held = [*getattr(self, "held", []), (x, y)] if micro else [(x, y)]
        if micro < self.n - 1:
            return
        xs, ys = torch.cat([a for a, _ in self.held]), torch.cat([b for _, b in self.held])
        order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(len(xs)))
        for xm, ym in zip(xs[order].chunk(self.n), ys[order].chunk(self.n)):
            super().micro_step(xm, ym, micro)


class SumOverN(Summed):
    def numerator(self, ce, mask, micro):
        return ce.sum() / self.n


class ZMissingOverN(TwoTerms):
    def z_scale(self):
        return float(self.n)


class ZOverNTwice(TwoTerms):
    def z_scale(self):
        return 1.0 / self.n


def _row_mean():
    from examples.mlp_regressor import Trainer  # the MLP recipe: MSE, a mean over rows, SGD with momentum

    return Trainer


row_mean = verify.adapter(data=verify.data.regression(features=8), name="planted MLP (row_mean)",
                          objective=verify.Objective(terms={"loss": "row_mean"}))(_row_mean())


def _tokens(rows, seed):
    return verify.data.tokens(vocab=VOCAB, seq_len=SEQ)(rows, seed)


def _declare(cls, kind_or_terms, **extra):
    terms = kind_or_terms if isinstance(kind_or_terms, dict) else {"loss": kind_or_terms}
    return verify.adapter(data=_tokens, ignore_index=IGNORE, objective=verify.Objective(terms=terms, **extra),
                          name=f"planted {cls.__name__} ({', '.join(terms.values())})")(cls)


token_mean = _declare(Normalised, "token_mean")
seq_mean = _declare(SeqMean, "seq_mean")
seq_sum = _declare(SeqSum, "seq_sum")
summed = _declare(Summed, "sum")
two_terms = _declare(TwoTerms, {"ce": "token_mean", "z": "row_mean"})

seq_token_weighted = _declare(Normalised, "seq_mean")
seq_nonempty = _declare(SeqNonEmpty, "seq_mean")
dr_grpo_own_length = _declare(DrGrpoOwnLength, "seq_sum")
micro_token_mean = _declare(MicroTokenMean, "token_mean")
shuffled_micro_token_mean = _declare(ShuffledMicroTokenMean, "token_mean")
sum_over_n = _declare(SumOverN, "sum")
z_missing_over_n = _declare(ZMissingOverN, {"ce": "token_mean", "z": "row_mean"})
z_over_n_twice = _declare(ZOverNTwice, {"ce": "token_mean", "z": "row_mean"})

# the z term declared per micro-batch (a true non-equivalence the gates then leave out), and that term ÷ N twice
z_per_micro = _declare(TwoTerms, {"ce": "token_mean", "z": "row_mean"}, per_micro=("z",))
z_per_micro_over_n_twice = _declare(ZOverNTwice, {"ce": "token_mean", "z": "row_mean"}, per_micro=("z",))
