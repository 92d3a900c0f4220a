"""The objective operators' edits (verify/selftest/operators.py): bugs in how a declared term normalises, planted
around any trainer through the Mutant (the four methods, Spec.terms, the batches). Design: docs/design/self-test.md.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from verify.selftest.mutant import respec

__all__ = ["batch_term", "count_again", "reset_per_micro", "per_micro_aux"]


def micro_weights_differ(objective) -> bool:
    """Whether a mean of micro-batch means can differ from the window's under `objective`: a window-level term
    weighs a micro-batch by its valid targets (token_mean), by 1 (sum), or by declared sequences per row. By its
    rows (row_mean, seq_mean, seq_sum with one sequence per row) the harness's equal micro-batches weigh the
    same, and the mean of their means is the window's: no bug to plant (an equivalent mutant)."""
    if objective is None or objective.sequences is not None:
        return True
    kinds = [k for t, k in objective.terms.items() if t not in objective.per_micro and k != "batch"]
    return any(k in ("token_mean", "sum") for k in kinds)


def batch_term(objective) -> str | None:
    """The first window-level term declared `batch` (a global-batch auxiliary loss), or None."""
    if objective is None:
        return None
    return next((t for t, k in objective.terms.items() if k == "batch" and t not in objective.per_micro), None)


def count_again(w) -> float:
    """Boundary factor: the window's gradient divided by its count once more (valid targets, else rows)."""
    c = w.window_counts()
    n = c[0] if w.ignore is not None else c[2]
    return 1.0 / n if n else 1.0


def _at_inner_params(trainer, inner) -> None:
    with torch.no_grad():
        theirs = trainer.params()
        for k, p in inner.params().items():
            theirs[k].copy_(p)


def reset_per_micro(w, x, y, m):
    """The inner trainer runs as usual; beside it, the batch term alone (Spec.terms) over the whole window and on
    each micro-batch alone, at the inner trainer's parameters: what counts reset every micro-step would compute."""
    term = batch_term(w.objective)
    if m == 0:
        w.shadow = w.make(replace(w.spec, accum_steps=w.N, terms=(term,)))
        w.alone = w.make(respec(w.spec, lambda n: 1, terms=(term,)))
        _at_inner_params(w.shadow, w.inner)
    w.inner.micro_step(x, y, m)
    w.shadow.micro_step(x.clone(), y.clone(), m)
    _at_inner_params(w.alone, w.inner)
    w.alone.micro_step(x.clone(), y.clone(), 0)
    w.micro_grads.append({k: g.detach().clone() for k, g in w.alone.grads().items() if g is not None})
    w.alone.optimizer_step()


def per_micro_aux(w, grads: dict) -> None:
    """The boundary gradient with the batch term's window-level gradient replaced by its micro-batches' mean."""
    window = {k: g.detach().clone() for k, g in w.shadow.grads().items() if g is not None}
    with torch.no_grad():
        for k, g in grads.items():
            mean = sum((mg[k] for mg in w.micro_grads if k in mg), torch.zeros_like(g)) / w.N
            g.add_(mean - window.get(k, torch.zeros_like(g)))
