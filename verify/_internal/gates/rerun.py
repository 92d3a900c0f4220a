"""Diagnose a failure by re-running it: one knob changed at a time, and the class the differences point to.

Run once, on the final (shrunk) failure only, never on a passing gate. First what the trainer does, measured
(gates/evidence.py: its seed, its dtype, at W > 1 its ranks' LR). Then the knobs K=1, W=1, N=1, `unclipped`
and, padded, unpadded (on a mesh: gates/mesh.py, padding_lead); plus the float64 runs (parameters equal to the
big batch's while grads() is c ≠ 1 × its gradient: the trainer normalises in its step) and, padded, the mean of micro-batch means. A token-mean failure
is re-run with grads_from="optimizer". Tested in tests/harness/test_rerun.py and test_evidence.py.

What each re-run shows: docs/verify-your-trainer.md (the hint tables); docs/design/tolerance.md,
"Around the policy".
"""
from __future__ import annotations

import torch

from verify._internal.cases.case import Case, drive
from verify._internal.hints import hint as pattern_hint
from verify._internal.verdict import Gate, GateFailure, GateSkipped
from verify._internal.gates.diagnose import first_difference
from verify._internal.gates.tolerance import param_scale, whole_norm
from verify._internal.gates.evidence import built_wrong, micro_means, per_rank_schedule, token_mean
from verify._internal.gates.update_dtype import low_precision_update

__all__ = ["diagnose", "diagnosed", "relation", "KNOBS"]

KNOBS = ("K=1", "W=1", "N=1", "unclipped", "unpadded")
GATES = (Gate.EQUIVALENCE, Gate.DP_EQUIVALENCE, Gate.SPLIT_INVARIANCE, Gate.LONG_WINDOW, Gate.MESH_EQUIVALENCE,
         Gate.MESH_SPLIT_INVARIANCE,  # its failure carries the failing mesh case: re-run as the mesh gate
         Gate.PARTIAL_SUMS)
COUNTING = (Gate.BOUNDARY_ONLY, Gate.BYTES_PER_STEP)  # collectives counted: neither the init nor the dtype moves them
SAME_PARAMS = 1e-12  # float64 relative: rounding of a few hundred operations, far below any real bug's update change
CONSTANT = 1e-9  # how near grads() must be to c × the big batch's gradient, float64, relative


def _lengths(case: Case, steps: int):
    return None if case.lengths is None else tuple(case.lengths[:steps * case.effective_batch])


def _knob(case: Case, knob: str, adapter) -> Case | None:
    """The failing case with one knob changed (same rows per step), or None where the knob does not apply."""
    N, B, W = case.accum_steps, case.micro_batch, case.world
    if knob == "K=1" and case.steps > 1:
        return case.replace(steps=1, lengths=_lengths(case, 1))
    if knob == "W=1" and W > 1 and case.mesh is None:
        return case.replace(world=1, micro_batch=B * W)
    if knob == "N=1" and N > 1:
        return case.replace(accum_steps=1, micro_batch=B * N, pipeline_chunks=1)
    if knob == "unclipped" and getattr(adapter, "unclipped", None) is not None:
        options = adapter.unclipped(case.options)
        return None if options == case.options else case.replace(options=options)
    if knob == "unpadded" and case.lengths is not None:
        return case.replace(lengths=None)
    return None


def _pooled(adapter, case: Case, gate=None) -> bool:
    """Whether the case's runs go through rank pools: a mesh, W > 1, a group needed alone, or a data-parallel
    gate's failure (a data-parallel trainer may need a group even at world 1)."""
    return (case.mesh is not None or case.world > 1 or adapter.process_group
            or (adapter.data_parallel and gate in (Gate.DP_EQUIVALENCE, Gate.SPLIT_INVARIANCE)))


def _check(adapter, case: Case, gate=None):
    """The numeric gate that applies to the case (mesh, data parallel or single process)."""
    if case.mesh is not None:
        from verify._internal.gates.mesh import check_mesh
        return check_mesh(adapter, case)
    if _pooled(adapter, case, gate):
        from verify._internal.gates.distributed import check_distributed
        return check_distributed(adapter, case)
    from verify._internal.gates.single import check_equivalence
    return check_equivalence(adapter, case)


def _passes(adapter, case: Case, gate=None) -> bool | None:
    """True / False: the knob's case passes / fails; None: it could not run (a skip, a crash)."""
    try:
        _check(adapter, case, gate)
        return True
    except GateFailure:
        return False
    except (GateSkipped, Exception):  # noqa: BLE001  (a diagnosis never replaces the verdict it explains)
        return None


def _f64_traces(adapter, case: Case, gate=None):
    """(the trainer's float64 Trace, the float64 big batch's) of the case: rank 0's / replica 0's."""
    if _pooled(adapter, case, gate):
        from verify._internal.gates.distributed import F64, run_distributed
        out = run_distributed(adapter, case, gate=Gate.DP_EQUIVALENCE)
        if case.mesh is not None:
            from verify._internal.gates.mesh import assemble_traces
            got = assemble_traces([o.runs[F64].trace for o in out], case, out[0].refs["ref64"].grads0)[0]
        else:
            got = out[0].runs[F64].trace
        return got, out[0].refs["ref64"]
    f64, batches = torch.float64, case.batches(adapter)
    run = lambda n: drive(adapter(case.spec(accum_steps=n, dtype=f64, device=case.device, adapter=adapter)),  # noqa: E731
                          batches, n, dtype=f64, device=case.device)
    return run(case.accum_steps), run(1)


def relation(got, ref) -> tuple[float | None, bool]:
    """(c where got's step-0 gradient is c × ref's for every parameter, else None; whether the parameters
    after every step equal ref's), both in float64 and far below any real bug's size."""
    num = den = 0.0
    for k, r in ref.grads0.items():
        g = got.grads0.get(k)
        if g is None or g.shape != r.shape:
            return None, False
        num, den = num + float((g.double() * r.double()).sum()), den + float((r.double() ** 2).sum())
    c, whole = (num / den if den else None), whole_norm(ref.grads0)
    for k, r in ref.grads0.items():  # a gradient zero at the run's resolution: relative to the whole (param_scale)
        if c is not None and float((got.grads0[k].double() - c * r.double()).norm()) > CONSTANT * abs(c) * param_scale(
                r, whole):
            c = None
    same = bool(got.params) and len(got.params) == len(ref.params) and all(
        k in pg and float((pg[k].double() - r.double()).abs().max()) <= SAME_PARAMS * max(float(r.abs().max()), 1.0)
        for pg, pr in zip(got.params, ref.params) for k, r in pr.items())
    return c, same


def _deterministic(adapter, case: Case, gate=None) -> bool:
    """Two identical runs of the case agree bit for bit (every rank; float64 and fp32 as the gates run them)."""
    if not _pooled(adapter, case, gate):
        run = lambda: drive(adapter(case.spec(device=case.device, adapter=adapter)), case.batches(adapter),  # noqa: E731
                            case.accum_steps, device=case.device)
        return first_difference(run(), run()) is None
    from verify._internal.gates.distributed import run_distributed
    a, b = (run_distributed(adapter, case) for _ in range(2))
    return all(first_difference(x.runs[d].trace, y.runs[d].trace) is None for x, y in zip(a, b) for d in x.runs)


def diagnose(adapter, failure: GateFailure) -> tuple[str | None, dict]:
    """(the one-line diagnosis of a failure from re-runs, or None; {knob: passes}). The measured leads (seed,
    dtype, a per-rank schedule) for any gate but the counting ones; the knobs for numeric gates only, and not
    where the raiser set its own hint (a determinism diagnosis)."""
    case, gate = getattr(failure, "case", None), getattr(failure, "gate", None)
    if case is None or gate is None or getattr(adapter, "native", None) is not None:
        return None, {}  # every re-run lead runs float64 (a native trainer has no such path): its verdict says it
    built = None if gate in COUNTING else _try(built_wrong, adapter, case, _pooled(adapter, case, gate))
    if built:  # every run the gates compare rests on the trainer's init and dtype: this lead comes first
        return "re-run: " + built, {}
    if gate in (*GATES, Gate.REPORTED_METRICS) and case.world > 1:
        schedule = _try(per_rank_schedule, adapter, case)
        if schedule:
            return "re-run: " + schedule, {}
    low = _try(low_precision_update, adapter, case, _pooled(adapter, case, gate)) if gate in GATES else None
    if low:  # a float64 run whose update is bf16: no float64 check can judge it, whatever else is wrong
        return "re-run: " + low, {}
    if gate == Gate.NORMALISER:  # judged against the harness's counts, not a big batch
        c = _at_optimizer(adapter, case)
        if c is None:
            micro = _try(micro_means, adapter, case, _pooled(adapter, case, gate))
            return (None if micro is None else "re-run: " + micro), {}
        return _normalises(c, "the gradient the optimizer steps with") + "; read where the optimizer reads it, the " \
            "token mean holds", {}
    if gate not in GATES or failure.hint:
        return None, {}
    try:
        c, same = relation(*_f64_traces(adapter, case, gate))
    except Exception:  # noqa: BLE001  (the float64 look could not run: the knobs still can)
        c, same = None, True
    if c is not None and abs(c - 1) >= 1e-6 and same:  # the updates right, grads() read before the normalisation
        return "re-run: the parameters after every step equal the big batch's while " + _normalises(c, "its gradient"), {}
    seen = {}
    for knob in KNOBS:
        k = _knob(case, knob, adapter)
        if k is not None:
            seen[knob] = _passes(adapter, k, gate)
    step_wrong = c is not None and abs(c - 1) < 1e-6 and not same  # the gradient right, the step not
    micro = _try(micro_means, adapter, case, _pooled(adapter, case, gate))
    return _classify(adapter, failure, seen, step_wrong, micro), seen


def _try(evidence, *args) -> str | None:
    """An evidence's lead, or None where it could not run (a diagnosis never replaces the verdict it explains)."""
    try:
        return evidence(*args)
    except Exception:  # noqa: BLE001
        return None


def _normalises(c: float, of: str) -> str:
    return (f"grads() is {c:.6g}× {of}: the trainer normalises inside optimizer_step(), after grads() is read. Its "
            f"updates may well be right; meet the contract (grads() returns the gradient the optimizer steps with: "
            f"divide before grads()) or declare @verify.adapter(grads_from=\"optimizer\")")


def _at_optimizer(adapter, case: Case) -> float | None:
    """A token-mean failure re-run with the gradient read where the optimizer reads it (grads_from="optimizer"):
    c where it then passes and grads() is c × that gradient; None otherwise. In this process only (a replaced
    adapter is no module-level name a rank pool could import)."""
    if adapter.grads_from != "grads" or _pooled(adapter, case):
        return None
    from verify._internal.gates.objective import check_normaliser

    alt = adapter.replace(grads_from="optimizer", name=adapter.name)
    try:
        check_normaliser(alt, case)
    except Exception:  # noqa: BLE001  (a failure, a skip or a crash: no lead)
        return None
    one = case.replace(steps=1, lengths=_lengths(case, 1))
    run = lambda a: drive(a(one.spec(dtype=torch.float64, device=one.device, adapter=a)), one.batches(a),  # noqa: E731
                          one.accum_steps, dtype=torch.float64, device=one.device)
    c, _ = relation(run(adapter), run(alt))
    return None if c is None or abs(c - 1) < 1e-6 else c


def _said(seen: dict) -> str:
    return "re-run " + ", ".join(f"{k} {'passes' if v else 'fails' if v is False else 'could not run'}"
                                 for k, v in seen.items()) + ": "


def _classify(adapter, failure: GateFailure, seen: dict, step_wrong: bool = False, micro: str | None = None
              ) -> str | None:
    case, said = failure.case, _said(seen) if seen else ""
    if micro:  # measured: the per-micro-batch count, named before any pattern of the error (a 1 − 1/N included)
        return (said or "re-run: ") + micro
    if seen.get("unclipped"):
        return (said + "without clipping it passes: clipping acts where the big batch's does not — clip once, on the "
                "window's whole gradient, in optimizer_step() (not inside each micro-step, not per rank before the "
                "reduction)")
    if seen.get("unpadded"):  # padding alone breaks it: a count taken where the ranks' counts differ
        from verify._internal.gates.mesh import padding_lead
        lead = padding_lead(adapter, case)
        if lead:
            return said + lead
    if seen.get("unpadded") and token_mean(adapter, case):  # a factor of N or W would survive unpadding
        ranks = " and rank" if case.world > 1 else ""
        rank = "each rank divided by its own valid count (a per-rank token mean), " if ranks else ""
        micro = "each micro-batch divided by its own valid count, then by N (a per-micro-batch token mean)"
        first = rank + micro if seen.get("W=1") else micro + (", " + rank.rstrip(", ") if rank else "")
        return (said + f"unpadded, every micro-batch{ranks} holding as many valid targets, it passes: the count "
                f"depends on where the padding falls — {first}, a count taken from one micro-step, or padding counted "
                f"as targets; divide by the window's count of valid targets, over every micro-step and rank")
    if seen.get("K=1") and seen.get("W=1"):
        return (said + "step 0 agrees, a later step differs, only at W > 1: state that advances per step differs "
                f"across ranks — an LR scheduler stepped once per rank (Accelerate's prepared scheduler steps it "
                f"num_processes times: declare distributed=verify.Distributed(scheduler_per_rank=True))")
    if seen.get("K=1") or step_wrong:
        what = ("step 0 agrees, a later step differs" if seen.get("K=1") else
                "the step-0 gradient equals the big batch's, the update does not")
        return (said + what + ": state that should advance once per optimizer step advances per micro-step — an LR "
                "scheduler or optimizer stepped inside the micro-step loop, or a counter of micro-steps where one of "
                "steps belongs")
    if (seen.get("N=1") is False or case.accum_steps == 1) and case.world == 1:  # a mesh at N=1 too (issue 26)
        if not _deterministic(adapter, case, failure.gate):
            return (said + "it fails at N=1 too, and two identical runs differ: nondeterminism (train-mode dropout, "
                    "random numbers drawn per micro-step, nondeterministic kernels)")
    lead = pattern_hint(_without_n1(failure))  # the gate or the re-run above ruled nondeterminism out
    if seen.get("N=1") is False and case.world > 1 and lead is None:
        lead = ("it fails at N=1 too, where accumulation does nothing: the ranks' reduction differs from one process's "
                "big batch (the ÷ W, a per-rank normaliser, state kept per rank)")
    if lead is not None and "something acts per micro-batch" in lead and seen.get("N=1") is False:
        lead = None  # a per-micro-batch effect cannot survive N=1: the pattern is wrong here
    if lead is None:
        return said.rstrip(": ") or None
    return f"{lead} ({said.rstrip(': ')})" if said else lead  # today's hint first, what the re-runs showed after


def _without_n1(failure: GateFailure) -> GateFailure:
    """The failure as hints.py reads it, with its N=1 nondeterminism lead ruled out (the re-run decided that)."""
    f = GateFailure(str(failure), gate=failure.gate, case=failure.case, error=failure.error, bound=failure.bound)
    f.deterministic = True
    return f


def diagnosed(adapter, failure):
    """`failure` with its hint from the re-runs (GateFailure.hint, which hints.hint returns first), or itself
    unchanged where the re-runs say nothing or could not run."""
    if adapter is None or not isinstance(failure, GateFailure):
        return failure
    from verify._internal.cases.strategies import scale_profile

    if scale_profile():  # each re-run is a production-size trainer's whole case, held beside the failure's own runs:
        return failure  # at 1.1B the host could not (SIGKILL); the hint comes from the failure's numbers alone
    try:
        line, _ = diagnose(adapter, failure)
    except Exception:  # noqa: BLE001  (the verdict stands whatever the diagnosis does)
        return failure
    if line:
        failure.hint = line
    return failure
