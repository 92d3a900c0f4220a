"""Diagnose before judging: is the trainer deterministic at all?

Every gate compares runs: N micro-steps against one big batch, W ranks against one process. A trainer
whose two IDENTICAL runs differ (train-mode dropout drawing from the global RNG, random numbers drawn per
micro-step, nondeterministic kernels) fails them all, and the failure reads like an accumulation bug, at
N=1 too, where accumulation does nothing. So when a numeric check is about to fail, the gate runs the same
configuration once more and compares bit for bit; if the two differ, the failure is GateFailure(gate=
Gate.DETERMINISM) with a hint saying how to fix it, instead of the equivalence verdict. This runs only on the
failing path: a passing gate pays nothing.
"""
from __future__ import annotations

import torch

from verify._internal.verdict import Gate, GateFailure, GateSkipped
from verify._internal.gates.tolerance import _max_abs

__all__ = ["GATE", "HINT", "first_difference", "determinism", "by_term"]

GATE = Gate.DETERMINISM
HINT = ("make the trainer deterministic under the gates: train-mode dropout or any random number drawn per "
        "micro-step (seed its generator from Spec.seed when the trainer is built, or run dropout-free / in eval "
        "mode), nondeterministic kernels (torch.use_deterministic_algorithms(True)). BatchNorm is not this: its "
        "per-micro-batch statistics are deterministic and a true non-equivalence (docs/verify-your-trainer.md)")


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit, NaN where the other has NaN too (torch.equal calls two NaN runs different: a deterministic
    trainer that divides by a count of 0 is not a nondeterministic one)."""
    return x.shape == y.shape and x.dtype == y.dtype and bool(((x == y) | (x.isnan() & y.isnan())).all())


def first_difference(a, b) -> str | None:
    """The first thing two Traces of the same configuration disagree on, bit for bit, or None."""
    for k, (x, y) in enumerate(zip(a.losses, b.losses)):
        if x != y and not (x != x and y != y):  # NaN == NaN here: an undefined loss in both
            return f"the step-{k} loss ({x!r} vs {y!r})"
    for name, g in a.grads0.items():
        h = b.grads0.get(name)
        if h is None or not _same(g, h):
            return f"the step-0 gradient of {name!r} (max|Δ| {_max_abs(g, h) if h is not None else float('nan'):.3e})"
    for k, (pa, pb) in enumerate(zip(a.params, b.params)):
        for name, p in pa.items():
            if name not in pb or not _same(p, pb[name]):
                return f"parameter {name!r} after step {k}"
    return None


def determinism(failure: GateFailure, rerun, first=None) -> GateFailure:
    """The failure to raise: `failure` itself when the trainer is deterministic, else a determinism failure.
    `rerun()` runs the failing configuration afresh and returns its Trace; it is compared with `first` (the
    run already judged), or with a second rerun."""
    a = first if first is not None else rerun()
    what = first_difference(a, rerun())
    if what is None:
        return failure
    case = failure.case
    return GateFailure(f"[{GATE}] two identical runs of the trainer differ in {what}, so no comparison of runs can "
                       f"judge its accumulation (reported instead of a [{failure.gate or 'gate'}] failure): likely "
                       f"train-mode dropout, random numbers drawn per micro-step or nondeterministic kernels; case "
                       f"{case}", gate=GATE, case=case, hint=HINT)


def by_term(adapter, case: Case, failure: GateFailure, check) -> GateFailure:
    """A gate's failure on a loss of several terms, re-run term by term (`check(case)`, Spec.terms = one term):
    the first term that fails alone is named, its own message kept; else the failure as it was."""
    obj = adapter.objective
    if obj is None or not obj.split or failure.gate is Gate.DETERMINISM or failure.case is None:
        return failure
    terms = case.terms if case.terms is not None else tuple(obj.terms)
    if len(terms) < 2:
        return failure
    for term in terms:
        try:
            check(case.replace(terms=(term,)))
        except GateFailure as e:
            tag, rest = str(e).split("] ", 1)  # '[data-parallel equivalence] ...': the tag holds spaces
            return GateFailure(f"{tag}] term {term!r} alone: {rest} (found re-running "
                               f"each term alone after the whole loss failed)", gate=e.gate, case=e.case,
                               error=e.error, bound=e.bound, hint=e.hint)
        except GateSkipped:
            continue
    return failure
