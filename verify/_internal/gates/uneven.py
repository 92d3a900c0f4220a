"""Uneven windows (Case.rank_rows): when the data-parallel gate fails on one, does the gradient fit each rank's
own mean averaged equally over ranks (DDP's ÷ W of per-rank means, trl PR #6713)? Then the failure names every
rank's share of the window and the factor its weight is off by. Runs only on the failing path.
Design: docs/design/distributed.md, "Uneven windows".
"""
from __future__ import annotations

import torch

from verify._internal.cases.case import Case, drive, shard
from verify._internal.gates.kappa import fed
from verify._internal.objective import NORMALISERS, Weights, objective_of
from verify._internal.verdict import Gate, GateFailure

__all__ = ["rank_grads_job", "rank_counts", "equal_weights"]


def _normaliser(adapter) -> str | None:
    """The one window-level term's normaliser (a row mean when none is declared), or None (several terms)."""
    obj = objective_of(adapter)
    if obj is None:
        return "row_mean"
    terms = [k for t, k in obj.terms.items() if t not in obj.per_micro]
    return terms[0] if len(terms) == 1 and NORMALISERS[terms[0]].additive else None


def rank_counts(adapter, case: Case, kind: str) -> list[float]:
    """Step 0's count of each rank's rows under normaliser `kind` (rows, valid targets, sequences)."""
    obj = objective_of(adapter)
    weights = Weights(adapter, obj) if obj is not None else None
    x, y = case.batches(adapter)[0]
    out = []
    for r in range(case.world):
        blocks = shard(x, y, case.accum_steps, r, case.world, case.rank_rows)
        out.append(sum(weights.of(kind, a, b) if weights else float(b.shape[0]) for a, b in blocks))
    return out


def rank_grads_job(ctx, adapter, case: Case) -> list[dict | None]:
    """On a one-rank pool: each rank's float64 step-0 gradient of its own rows alone (the adapter at
    accum_steps=1 on them: that rank's own mean)."""
    x, y = case.batches(adapter)[0]
    out = []
    for r in range(case.world):
        blocks = shard(x, y, case.accum_steps, r, case.world, case.rank_rows)
        batch = (torch.cat([a for a, _ in blocks]), torch.cat([b for _, b in blocks]))
        if not fed(adapter, batch[1]):  # never fed alone (empty_windows=False): that rank has no own mean
            out.append(None)
            continue
        t = adapter(case.spec(accum_steps=1, dtype=torch.float64, device=str(ctx.device), adapter=adapter))
        out.append(drive(t, [batch], 1, dtype=torch.float64, device=ctx.device, gate=Gate.DP_EQUIVALENCE).grads0)
    return out


def _flat(g: dict, names) -> torch.Tensor:
    return torch.cat([g[n].double().flatten() for n in names])


def equal_weights(adapter, case: Case, failure: GateFailure, got: dict, pool) -> GateFailure:
    """`failure` with the ranks' weights named when the float64 boundary gradient `got` (rank 0's) fits the
    equal-weight average of the ranks' own means far better than the count-weighted one; else `failure`."""
    kind = _normaliser(adapter)
    if not case.uneven or kind is None or failure.gate is not Gate.DP_EQUIVALENCE or not got:
        return failure
    counts = rank_counts(adapter, case, kind)
    total, W = sum(counts), case.world
    if not total or len(set(counts)) == 1:
        return failure
    own = pool.run(rank_grads_job, adapter, case)[0]
    if any(g is None for g in own):
        return failure
    names = [n for n in got if all(n in g for g in own)]
    if not names:
        return failure
    mine = [_flat(g, names) for g in own]
    equal = sum(mine) / W
    right = sum(c / total * g for c, g in zip(counts, mine))
    cand = _flat(got, names)
    if not (cand - equal).norm() < 0.1 * (cand - right).norm():
        return failure
    unit = NORMALISERS[kind].weight
    shares = "; ".join(f"rank {r}: {c:g} of {total:g} {unit}, weight 1/{W} where {c / total:.3g} (×{total / (W * c):.3g})"
                       if c else f"rank {r}: none of the {total:g} {unit}, weight 1/{W} where 0"
                       for r, c in enumerate(counts))
    head, sep, tail = str(failure).rpartition("; case ")
    why = (f" — the gradient is each rank's own mean averaged equally over the {W} ranks (÷ W): {shares}. On uneven "
           f"windows weight each rank by its share of the GLOBAL count (reduce sums and divide by the global {unit}, "
           f"or scale by W·local/global)")
    return GateFailure(head + why + sep + tail if sep else str(failure) + why, gate=failure.gate, case=failure.case,
                       error=failure.error, bound=failure.bound, hint=failure.hint)
