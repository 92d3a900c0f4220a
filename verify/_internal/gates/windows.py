"""Window-level gates: every way to split a window, and every micro-step's contribution.

split invariance   every (N, B, W) with N·B·W = E of one padded window gives the float64 big batch (the
                   equivalence gate at W = 1, the data-parallel gates at W > 1): per-micro-batch or
                   per-rank token means and miscounts show once blocks hold different valid counts.
partial sums       with `partial_grads()`: after micro-step n, the gradient equals the float64 big batch of
                   micro-batches 0..n (each lands exactly once, in order, whatever N).
long window        LONG_N micro-steps in each declared low precision (`check_long_window`).

Design: docs/design/numerics.md, "Every split of a window".
"""
from __future__ import annotations

import math

import torch

from verify._internal.cases.case import Case, _cpu, _to, drive, split, twin
from verify._internal.gates.kappa import block_runs
from verify._internal.cases.corners import LONG_N
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped
from verify._internal.gates.diagnose import determinism
from verify._internal.gates.floor64 import summation_floor
from verify._internal.gates.single import _equivalence, check_equivalence, run_alone
from verify._internal.gates.tolerance import (C, EPS32, KAPPA_EXACT_ABOVE, bound64, condition, measured_floor,
                                              overall_error, param_err, scale_note, twin_floor, whole_norm)

__all__ = ["splits", "check_split_invariance", "check_partial_sums", "checkpoints", "check_long_window", "check_order",
           "summation_floor", "LOW_PRECISIONS", "LONG_N"]

LOW_PRECISIONS = ("bf16", "fp16")


def splits(E: int, max_world: int) -> list[tuple[int, int, int]]:
    """Every (N, B, W) with N·B·W = E and W ≤ max_world, single-process ones first."""
    return [(n, E // (n * w), w) for w in range(1, max_world + 1) if E % w == 0
            for n in range(1, E // w + 1) if (E // w) % n == 0]


def check_split_invariance(adapter, case: Case, *, max_world: int = 1) -> GateResult:
    """Run every split of `case`'s window (E = N·B·W rows, its data seed and padding); raise GateFailure
    naming the first split that disagrees with the big batch. Returns the worst error / bound."""
    from verify._internal.gates.distributed import check_distributed

    E = case.effective_batch
    worlds = max_world if adapter.data_parallel else 1
    worst, where, n_splits, floor = 0.0, "", 0, 0.0
    for n, b, w in splits(E, worlds):
        c = case.replace(accum_steps=n, micro_batch=b, world=w)
        try:
            r = check_equivalence(adapter, c) if w == 1 else check_distributed(adapter, c)
        except GateFailure as e:
            raise GateFailure(f"[{Gate.SPLIT_INVARIANCE}] split N={n} B={b} W={w} of a window of {E} rows: {e}",
                              gate=_outer(e, Gate.SPLIT_INVARIANCE), case=c, error=e.error,
                              bound=e.bound, hint=e.hint) from None
        n_splits += 1
        floor = max(floor, r.extra.get("floor64") or 0.0)
        if r.ratio >= worst:
            worst, where = r.ratio, f"N={n} B={b} W={w}: {r.worst}"
    return GateResult(Gate.SPLIT_INVARIANCE, case, where, worst, splits=n_splits, floor64=floor)


def _outer(inner: GateFailure, gate: Gate) -> Gate:
    """The gate of a failure that wraps another gate's: this one, unless the inner one is a determinism
    diagnosis (which stands: no comparison of runs judges a nondeterministic trainer)."""
    return inner.gate if inner.gate is Gate.DETERMINISM else gate


def check_long_window(adapter, case: Case) -> list[GateResult]:
    """The equivalence gate on one long window (world 1) in every low precision the adapter declares (bf16,
    fp16; the caller draws its fp32 windows): a gradient summed in 8 / 11 significant bits across micro-steps
    rounds relative to the running sum, so its error grows with N while the big batch's does not, and
    crosses C·err(big) + F·κ at some N (reports/cpu/lowprec-detection.md: the N measured). A failure names the precision
    and N. Returns one GateResult per precision run (none where the adapter declares fp32 only).
    The partial-sum gate stays float64: its question (does each micro-step land exactly once) has no
    precision, and a low-precision partial sum after n micro-steps carries the error of a window of n, which
    this check at the longest N already bounds."""
    if not any(p in adapter.precisions for p in LOW_PRECISIONS):
        return []
    return run_alone(_long_window, adapter, case)


def _long_window(adapter, case: Case, device: str) -> list[GateResult]:
    """check_long_window's work, in one process (a pool rank for an adapter that needs a group): the precisions
    share the window's float64 runs (the trainer at N and at 1, the twin), which have no autocast. Each precision:
    the equivalence policy, then the order check on its accumulated run."""
    out, runs = [], {}
    for p in (p for p in LOW_PRECISIONS if p in adapter.precisions):
        c = case.replace(precision=p)
        try:
            r = _equivalence(adapter, c, device, runs)
            ratio = check_order(adapter, c, device, runs)
            if ratio >= r.ratio:
                r.worst, r.ratio = "the boundary gradient, micro-batches reversed", ratio
            out.append(r)
        except GateFailure as e:
            raise GateFailure(f"[{Gate.LONG_WINDOW}] {p}, N={c.accum_steps}: {e}", gate=_outer(e, Gate.LONG_WINDOW),
                              case=c, error=e.error, bound=e.bound, hint=e.hint) from None
    return out


def reverse_micro(batches, n: int):
    """The same windows with their n micro-batches in reverse order, each micro-batch's rows as they were (its
    own gradient bit for bit: only the accumulator's sum changes order)."""
    flip = lambda t: t.reshape(n, -1, *t.shape[1:]).flip(0).reshape(t.shape)  # noqa: E731
    return [(flip(x), flip(y)) for x, y in batches]


def check_order(adapter, case: Case, device: str, runs: dict) -> float:
    """The accumulator's own precision, apart from the forward's: at step 0 every micro-batch's gradient is the
    same whatever its place in the window, so running the window's micro-batches in reverse moves the boundary
    gradient by the accumulator's rounding alone — an fp32 sum's (≤ summation_floor(N)), where a sum rounded to
    bf16 / fp16 after each micro-step moves by its 8 / 11 bits (reports/cpu/lowprec-detection.md: that error
    under C·err(big) at N = 256 in fp16, ×1000 an fp32 sum's here). Relative over the whole gradient:
        moved ≤ C·summation_floor(N)                                          passes;
        moved ≤ C·(Δ(big, rows reversed) + max(Δ(fp32 run, reversed), summation_floor(N)))   else
    (measured only then: a trainer whose micro-steps read a window-wide float statistic moves by its own
    reordering, in fp32 and through the low-precision forward). Reads `_equivalence`'s runs; returns error / bound."""
    N, p = case.accum_steps, case.precision
    acc = runs.get((p, N))
    if N < 2 or acc is None or not acc.grads0:  # no order to change; a step 0 GradScaler skipped: no gradient
        return 0.0
    data = case.batches(adapter)[:1]
    back = reverse_micro(data, N)

    def grads(n, c, batches):
        t = adapter(c.spec(accum_steps=n, dtype=torch.float32, device=device, adapter=adapter))
        return drive(t, batches, n, dtype=torch.float32, device=device, gate=Gate.LONG_WINDOW).grads0

    moved, floor = overall_error(grads(N, case, back), acc.grads0), summation_floor(N)
    if not math.isfinite(moved):  # an overflowed fp16 window: the equivalence policy judged it
        return 0.0
    if moved <= C * floor:
        return moved / (C * floor)
    c32 = case.replace(precision="fp32")
    own = overall_error(grads(1, case, back), runs[p, 1].grads0)
    f32 = overall_error(grads(N, c32, back), grads(N, c32, data))
    b = C * (own + max(f32, floor))
    if not moved <= b:
        bits = {"bf16": 8, "fp16": 11}[p]
        raise GateFailure(
            f"the boundary gradient moves by {moved:.3e} (relative, all parameters) when the window's micro-batches "
            f"run in reverse order, > {C:g}·({own:.1e} (the {p} big batch's, its rows so reversed) + {max(f32, floor):.1e} "
            f"(an fp32 accumulator's: the fp32 run's {f32:.1e}, fp32 summation of N terms {floor:.1e}))",
            gate=Gate.LONG_WINDOW, case=case, error=moved, bound=b,
            hint=f"the window's sum depends on its order by {moved / max(own + max(f32, floor), 1e-300):.3g}× what an fp32 "
                 f"accumulator's does: it is rounded to about {bits} significant bits after micro-steps — a {p} "
                 f"gradient buffer or .grad (keep .grad in fp32 and autocast the forward only), or a micro-step's "
                 f"gradient that depends on its place in the window")
    return moved / b


def _prefix_reference(adapter, case: Case, x, y, device, reverse: bool = False):
    """float64 big batch of these rows (or its twin, case.twin): the adapter at accum_steps=1, one step;
    its Trace (the boundary gradient is grads0)."""
    trainer = adapter(case.spec(accum_steps=1, dtype=torch.float64, device=device, adapter=adapter))
    batches = twin([(x, y)]) if reverse else [(x, y)]
    return drive(trainer, batches, 1, dtype=torch.float64, device=device, gate=Gate.PARTIAL_SUMS)


def checkpoints(N: int) -> set[int]:
    """The micro-steps after which partial sums are judged: every one up to 8, then 2^k − 1 and 2^k, and N − 2.
    A contribution that does not land exactly once at micro-step j leaves every later partial sum wrong until
    something undoes it, and a checkpoint follows j within a factor of 2 (j ≤ n ≤ 2j + 1): a dropped, repeated or
    doubled contribution is seen. Each check costs a big batch of n rows, so all N − 1 would cost O(N²) rows
    (32 640 at N = 256) where these cost O(N) (≈ 800)."""
    out = set(range(min(8, N - 1))) | {N - 2}
    k = 8
    while k < N - 1:
        out |= {k - 1, k}
        k *= 2
    return {m for m in out if 0 <= m < N - 1}


def check_partial_sums(adapter, case: Case) -> GateResult:
    """After micro-step n of step 0 (float64, one process; every n up to 8, then at `checkpoints`),
    `partial_grads()` vs the float64 big batch of micro-batches 0..n, relative error ≤ bound64(floor) per parameter (a parameter without a
    gradient in the reference counts as zero). The floor is eps32 (tolerance.twin_floor: what an fp32 run
    resolves); the reference's own rounding on a twin is measured only where an error reaches KAPPA_EXACT_ABOVE
    of that bound, once per case, on the whole window (a prefix of one row could hide it): its float64 big
    batch and that batch's twin, two more runs. Where a parameter's error reaches KAPPA_EXACT_ABOVE of its
    bound, its sum's condition number κ over the micro-batches so far scales the bound (tolerance.bound64:
    rounding of a float32 part is relative to the terms; one float64 run per micro-batch, once).
    """
    gate, N = Gate.PARTIAL_SUMS, case.accum_steps
    if case.world != 1:
        raise ValueError("the partial-sum gate runs one process (world 1)")
    if adapter.process_group:
        raise GateSkipped(f"{adapter.name} needs a process group: the partial-sum gate runs one plain process")
    device = case.device
    trainer = adapter(case.spec(dtype=torch.float64, device=device, adapter=adapter))
    if not callable(getattr(trainer, "partial_grads", None)):
        raise GateSkipped(f"{adapter.name}'s trainer has no partial_grads(): the per-micro-step check is optional "
                          f"(docs/verify-your-trainer.md says how to expose it)")
    inputs, targets = case.batches(adapter)[0]
    micro = split(inputs, targets, N)
    declared = twin_floor()  # the floor before any twin is measured: what an fp32 run resolves
    worst, at, floor, blocks = 0.0, "", None, None
    judged = checkpoints(N)
    for m, (x, y) in enumerate(micro):
        xd, yd = _to(x, device, torch.float64), _to(y, device, torch.float64)
        trainer.micro_step(xd.clone(), yd.clone(), m)
        if m == N - 1:
            break  # the last one is the boundary: the equivalence gate's
        if m not in judged:
            continue
        got = _cpu(trainer.partial_grads())
        rows = (torch.cat([a for a, _ in micro[:m + 1]]), torch.cat([b for _, b in micro[:m + 1]]))
        want = _prefix_reference(adapter, case, *rows, device).grads0
        whole = whole_norm(want)  # a parameter zero at the run's resolution is judged against the whole (param_err)
        for name in sorted(set(got) | set(want)):
            g = got.get(name)
            if g is None:
                if want[name].abs().max().item() == 0:
                    continue
                raise GateFailure(f"[{gate}] after micro-step {m} of {N}: partial_grads() has no gradient for "
                                  f"{name!r}, which the big batch of micro-batches 0..{m} has; case {case}",
                                  gate=gate, case=case)
            ref = want.get(name, torch.zeros_like(g))
            e = param_err(g, ref, whole, declared)
            if e > KAPPA_EXACT_ABOVE * bound64(declared) and floor is None:  # measure the case's floor, once
                floor = measured_floor(_prefix_reference(adapter, case, inputs, targets, device),
                                       _prefix_reference(adapter, case, inputs, targets, device, True))
                e = param_err(g, ref, whole, floor)
            b = bound64(declared if floor is None else floor)
            if e > KAPPA_EXACT_ABOVE * b:  # a float32 part: rounding relative to the sum's terms
                blocks = blocks if blocks is not None else [t.grads0 for t in block_runs(adapter, case, device, gate)]
                b = bound64(floor, condition(blocks[:m + 1], {name: ref}, whole).get(name, 1.0))
            if not e <= b:
                fail = GateFailure(
                    f"[{gate}] after micro-step {m} of {N} (boundary not reached), gradient of {name!r}"
                    f"{scale_note(ref, whole, floor or declared)}: relative "
                    f"error {e:.3e} > {b:.2e} vs the float64 big batch of micro-batches 0..{m} — that "
                    f"micro-step's contribution did not land exactly once; case {case}",
                    gate=gate, case=case, error=e, bound=b)
                raise determinism(fail, lambda: _prefix_reference(adapter, case, inputs, targets, device))
            if e / b >= worst:
                worst, at = e / b, f"after micro-step {m}: {name!r}"
    return GateResult(gate, case, at, worst, floor64=declared if floor is None else floor)
