"""The single-process gates, for any adapter. Each raises GateFailure naming what differs.

equivalence  N micro-steps of B rows vs the SAME trainer at accum_steps=1 on the N·B batch, same init and
             data, judged by tolerance.py (fp32 step 0 and every step's loss, float64 every step).
bit-exact    accum_steps=1 vs the adapter's declared plain step: every gradient, loss and parameter after
             K steps torch.equal; GateSkipped, with the reason, without a plain step.

An adapter that needs a process group even alone (DDP, Accelerate) is run on a one-rank pool.
Design: docs/design/tolerance.md, docs/design/protocol.md.
"""
from __future__ import annotations

import torch

from verify._internal.precision import AUTOCAST
from verify._internal.cases.case import TWIN_COPIES, Case, drive, twin
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped, bare
from verify._internal.gates.diagnose import by_term, determinism
from verify._internal.gates.kappa import block_runs, loss_kappa
from verify._internal.gates.floor64 import TwinMeter, same_start, start_print
from verify._internal.gates.tolerance import Judge, conditions, twin_floor

__all__ = ["check_equivalence", "check_bit_exact", "run_alone", "GateResult", "GateSkipped"]


def _equivalence(adapter, case: Case, device: str, runs64: dict | None = None) -> GateResult:
    """`runs64`: float64 runs by (rows, N) and the twins' measured floors by ("floor", i), kept across calls on the
    same case (a float64 run has no autocast: the long-window gate's bf16 and fp16 passes share theirs); the
    accumulated run is left there by (precision, N)."""
    if adapter.native is not None:  # no float64 path: judged against its own runs (gates/native.py)
        from verify._internal.gates.native import native_equivalence

        return native_equivalence(adapter, case, device)
    gate, N = Gate.EQUIVALENCE, case.accum_steps
    batches = case.batches(adapter)
    f64, runs64 = torch.float64, {} if runs64 is None else runs64
    # The host keeps the float64 pair's parameters after every step; the fp32 runs are read for their losses and
    # step-0 gradients only, a twin as it runs (scaleplan.KEPT_BYTES_PER_PARAMETER counts what stays)
    starts = {}  # what this call's float32 runs start from (floor64.start_print); the float64 ones': runs64["starts"]

    def run(n, dtype, data=batches, keep=None, start=None):
        trainer = adapter(case.spec(accum_steps=n, dtype=dtype, device=device, adapter=adapter))
        if start is not None:
            start[n] = start_print(trainer.params())
        return drive(trainer, data, n, dtype=dtype, device=device, gate=gate,
                     last=case.last_window if n == N else None,  # the big batch: one step per window
                     keep_params=dtype == f64 if keep is None else keep)

    def kept(n):
        if ("rows", n) not in runs64:
            runs64["rows", n] = run(n, f64, start=runs64.setdefault("starts", {}))
        return runs64["rows", n]

    acc, big = run(N, torch.float32, start=starts), run(1, torch.float32, start=starts)
    runs64[case.precision, N], runs64[case.precision, 1] = acc, big  # the long window's order check reads them
    acc64, ref64 = kept(N), kept(1)
    # a reference from other weights bounds nothing; two float32 builds that differ already are unseeded (the
    # failure's re-run names that: gates/evidence.py)
    cast = AUTOCAST.get(case.precision)  # a framework may cast the model to it: the run's weights rounded there
    seeded = same_start(starts[1], starts[N], "", cast) is None
    for n, what in {1: "the big batch", **({N: f"accum_steps={N}"} if N > 1 else {})}.items():
        why = same_start(starts[1], runs64["starts"][n], what, cast) if seeded else None
        if why:
            raise GateFailure(f"[{gate}] {why}; case {case}", gate=gate, case=case)
    def measure(i: int) -> float:  # a twin is read once, as it runs, for its floor: kept is the number, not the run
        if ("floor", i) not in runs64:
            meter = TwinMeter(ref64)
            runs64["floor", i] = twin_floor(meter.diff(run(1, f64, twin(batches, TWIN_COPIES[i]), keep=meter)))
        return runs64["floor", i]

    j, doomed, floor = (Judge if case.last_window is None else _ShortJudge)(gate, case), None, None
    try:
        try:  # the float64 verdict, looked at first and raised last: a case that fails anyway computes no κ
            floor = j.float64(acc64, ref64, measure, loss_kappa(adapter, case, device, ref64, gate))
        except GateFailure as e:
            doomed = e
        kappa = (lambda: conditions(block_runs(adapter, case, device, gate), ref64)) if N > 1 else None
        j.accumulator(acc)
        j.step0(acc, big, ref64, kappa, doomed=doomed)
        j.loss_trajectory(acc, big)
        if doomed is not None:
            raise doomed
    except GateFailure as e:  # diagnose before judging: is the trainer deterministic at all?
        failure = determinism(e, lambda: run(N, torch.float32), acc)
        raise by_term(adapter, case, failure, lambda c: _equivalence(adapter, c, device)) from None
    # a step-0 check with nothing to bound it (the big batch's GradScaler skipped step 0) is said, not passed silently
    return GateResult(gate, case, j.worst, j.worst_ratio, floor64=floor, unjudged=getattr(j, "unjudged", None))


class _ShortJudge(Judge):
    """The Judge of a case with a short last window (Case.last_window): a failure in that window's step (the steps
    are judged in order, so every earlier one agreed) names it and carries the hint — set by its raiser, so the
    re-run diagnosis leaves it (docs/design/protocol.md, "Short last windows")."""

    def fail(self, msg: str, step: int = 0, *, error=None, bound=None):
        c = self.case
        if step != c.steps - 1:
            return super().fail(msg, step, error=error, bound=bound)
        try:
            super().fail(f"{msg} (step {step} is the short last window: {c.last_window} of N={c.accum_steps} "
                         f"micro-batches; its big batch: one step on its {c.rows_of(step)} row(s))", step,
                         error=error, bound=bound)
        except GateFailure as e:
            e.hint = (f"it differs in the short last window ({c.last_window} of N={c.accum_steps} micro-batches): "
                      f"normalise that window by its own count — Spec.window(k) micro-batches, or its rows or valid "
                      f"tokens — not by accum_steps")
            raise


def _bit_exact(adapter, case: Case, device: str) -> GateResult:
    gate = Gate.BIT_EXACT
    if adapter.plain is None:
        raise GateSkipped(f"{adapter.name} declares no plain (no-accumulation) step; declare "
                          f"@verify.adapter(plain=...) to prove accum_steps=1 is that step bit for bit")
    batches = case.batches(adapter)
    spec = case.spec(accum_steps=1, device=device, adapter=adapter)
    got = drive(adapter(spec), batches, 1, device=device, gate=gate)
    want = drive(adapter.plain(spec), batches, 1, device=device, gate=gate)
    Judge(gate, case).bit_exact(got, want)
    return GateResult(gate, case)


_GATES = {Gate.EQUIVALENCE: _equivalence, Gate.BIT_EXACT: _bit_exact}


def gate_job(ctx, name, adapter, case: Case):
    """On a pool rank: run one single-process gate there (a Gate of _GATES, or a module-level function
    (adapter, case, device) -> GateResult). Returns the verdict itself, pickled back to the parent: the
    GateResult, or the GateFailure (with its fields: gate, case, error, bound, hint) or GateSkipped it raised —
    a value, not a traceback."""
    try:
        return _GATES.get(name, name)(adapter, case, str(ctx.device))
    except (GateFailure, GateSkipped) as e:
        return e


def run_alone(name, adapter, case: Case, pool=None) -> GateResult:
    """One single-process gate (see gate_job) in this process, or on a one-rank pool for an adapter that
    needs a process group even alone."""
    if case.world != 1:
        raise ValueError(f"single-process gates take world-1 cases, got world {case.world}")
    if not adapter.process_group:
        try:
            return _GATES.get(name, name)(adapter, case, case.device)
        except GateFailure as e:  # the verdict, not the frames: theirs hold every run the gate kept (host memory)
            raise bare(e) from None
    from verify._internal.ranks.pool import get_pool

    verdict = (pool or get_pool(1)).run(gate_job, name, adapter, case)[0]
    if isinstance(verdict, (GateFailure, GateSkipped)):
        raise verdict  # raised here as in one process: the same message, the same fields
    return verdict


def check_equivalence(adapter, case: Case, *, pool=None) -> GateResult:
    """Big-batch equivalence: accumulation (N, B) vs one step on the N·B batch, same init and data."""
    return run_alone(Gate.EQUIVALENCE, adapter, case, pool)


def check_bit_exact(adapter, case: Case, *, pool=None) -> GateResult:
    """accum_steps=1 vs the adapter's plain step: bit-identical grads, losses, params (GateSkipped if
    the adapter declares no plain step)."""
    if adapter.plain is None:
        return _bit_exact(adapter, case, case.device)  # raises GateSkipped without starting a pool
    return run_alone(Gate.BIT_EXACT, adapter, case, pool)
