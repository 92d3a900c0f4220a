"""The data-parallel gates, for any adapter that declares data parallelism.

The trainer runs on every rank of a pool (verify/_internal/ranks/pool.py); the harness shards the data, marks
a window before every call and counts every collective (verify/_internal/ranks/comm.py). The reference is the
same adapter at accum_steps=1, world 1, on a one-rank pool. Judged: boundary-only (the count row of
counts.py, or the default row: nothing before the boundary, every gradient element once at it) and
equivalence (every rank vs the reference under tolerance.py; parameters bitwise identical across ranks).
Every failure names the rank, the step, the micro-step and the collective(s).

Design: docs/design/distributed.md, "The data-parallel gates".
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field

import torch

from verify._internal.cases.case import TWIN_COPIES, Case, Trace, drive, twin
from verify._internal.ranks.comm import INTER, INTRA, Collective, Windows, family, group_links, link_of
from verify._internal.ranks.pool import DistTimeout, get_pool
from verify._internal.ranks.mesh import cp_slice
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped
from verify._internal.gates.counts import SCALARS, CountRow, check_step, declared_row, excused
from verify._internal.gates.diagnose import by_term, determinism
from verify._internal.gates.metrics import judge_world, observer
from verify._internal.gates.kappa import kappa_job, loss_kappa_job
from verify._internal.gates.tolerance import Judge, measured_floor
from verify._internal.gates.uneven import equal_weights

__all__ = ["check_same_bytes", "check_distributed", "check_boundary_only", "check_dist_equivalence", "run_distributed",
           "SCALARS"]

DTYPES = (torch.float32, torch.float64)
F64_DTYPE = torch.float64  # the run whose reported metrics are judged (gates/metrics.py)
F32, F64 = str(torch.float32), str(torch.float64)


# -- what runs on the ranks ----------------------------------------------------------------------------

@dataclass
class RankRun:
    trace: Trace
    comms: dict  # window label -> [Collective]; ("init",), ("micro", k, m), ("boundary", k), ("params", k), ("after", k)
    main_thread: str
    n_params: int  # elements of params() after the run (all of them, used or not)
    links: dict = field(default_factory=dict)  # process group (c10d name) -> comm.INTRA / comm.INTER


@dataclass
class RankOutcome:
    rank: int
    runs: dict  # dtype name -> RankRun
    refs: dict = field(default_factory=dict)  # "big32" / "ref64" -> Trace (the one-rank reference)


def rank_job(ctx, adapter, case: Case, *, dtypes=DTYPES, gate=Gate.DP_EQUIVALENCE) -> RankOutcome:
    """On every rank: the trainer in each dtype, windows marked, collectives read. On a mesh the rows are
    the rank's dp replica's (every pp stage and tp rank of a replica gets the same; a cp rank its tokens of them)."""
    batches = case.batches(adapter)
    rank, world = (case.mesh.coords(ctx.rank)[0], case.mesh.dp) if case.mesh is not None else (ctx.rank, ctx.world)
    if case.mesh is not None and case.mesh.cp > 1:  # the harness owns the split of each sequence's tokens over cp
        batches = [cp_slice(x, y, case.mesh, ctx.rank) for x, y in batches]
    out = RankOutcome(ctx.rank, {})
    for dtype in dtypes:
        ctx.recorder.discard()  # forget anything before this run (a reference job may have filled the ring)
        win = Windows(ctx.recorder)
        win.mark(("init",))
        trainer = adapter(case.spec(dtype=dtype, device=str(ctx.device), adapter=adapter, group=ctx.group, rank=rank))
        trace = drive(trainer, batches, case.micro_steps(rank), dtype=dtype, device=ctx.device, rank=rank,
                      world=world, windows=win, gate=gate, observe=observer(adapter) if dtype == F64_DTYPE else None,
                      rank_rows=case.rank_rows)
        del trainer
        comms = win.attribute(win.collected())
        out.runs[str(dtype)] = RankRun(trace, comms, ctx.recorder.main_thread,
                                       sum(p.numel() for p in trace.params[-1].values()) if trace.params else 0,
                                       group_links())
    return out


def reference_job(ctx, adapter, case: Case, twin_of: int | None = None) -> dict:
    """On a one-rank pool: the same adapter at accum_steps=1 on the whole big batch, fp32 and float64 (or,
    given `twin_of` i, only the float64 big batch's twin i: case.twin, TWIN_COPIES[i] copies)."""
    batches = case.batches(adapter) if twin_of is None else twin(case.batches(adapter), TWIN_COPIES[twin_of])
    refs = {}
    for name, dtype in (() if twin_of is not None else (("big32", torch.float32),)) + (("ref64", torch.float64),):
        trainer = adapter(case.spec(accum_steps=1, dtype=dtype, device=str(ctx.device), adapter=adapter))
        refs[name] = drive(trainer, batches, 1, dtype=dtype, device=ctx.device, gate=Gate.DP_EQUIVALENCE,
                           observe=observer(adapter) if dtype == F64_DTYPE and twin_of is None else None)
    return refs


def run_distributed(adapter, case: Case, *, pool=None, ref_pool=None, gate=Gate.DP_EQUIVALENCE) -> list[RankOutcome]:
    """The world-W (or mesh.size) run and the one-rank reference, side by side on two pools."""
    pool = pool or get_pool(case.ranks, subgroups=adapter.subgroups)
    if pool.world != case.ranks:
        raise ValueError(f"case needs world {case.ranks}, pool has {pool.world}")
    if case.ranks == 1:
        outcomes = pool.run(rank_job, adapter, case, gate=gate)
        refs = pool.run(reference_job, adapter, case)[0]
    else:
        ref_pool = ref_pool or get_pool(1)
        ref_pool.submit(reference_job, adapter, case)
        failure = None
        try:
            outcomes = pool.run(rank_job, adapter, case, gate=gate)
        except DistTimeout as e:  # a rank waits in a collective nobody else joined: a boundary-only verdict;
            if not in_collective(e):  # a rank stuck in its own code (a sleep, a loader) is an error, not a verdict
                raise
            failure = hung(e, case, Gate.BOUNDARY_ONLY if gate is Gate.DP_EQUIVALENCE else gate)
        finally:
            refs = ref_pool.result()[0]
        if failure is not None:
            raise failure
    for o in outcomes:
        o.refs = refs
    return outcomes


# -- the counter's verdict -------------------------------------------------------------------------

def _reduces(c: Collective) -> bool:  # floating data that is not a broadcast or barrier: gradient-like traffic
    return c.kind == "gradient"


@dataclass
class StepComm:
    """Per rank, per dtype, per optimizer step: what the counter saw."""

    micro: list  # per micro-step 0..N-2: [Collective]
    boundary: list  # every collective at micro-step N-1 + optimizer_step()
    params: list  # inside grads() and params(): the harness reading state (reported only)
    side: list = field(default_factory=list)  # of `boundary`: the declared row's side traffic (metrics), no gradient

    @property
    def reduced(self) -> list:
        side = {id(c) for c in self.side}
        return [c for c in self.boundary if _reduces(c) and id(c) not in side]

    @property
    def boundary_elements(self) -> int:
        return sum(c.numel for c in self.reduced)

    @property
    def boundary_bytes(self) -> int:
        return sum(c.nbytes for c in self.reduced)

    def bytes_by_link(self, links: dict) -> dict:
        """The boundary's gradient bytes split by the link its group spans (comm.link_of)."""
        out = {INTRA: 0, INTER: 0}
        for c in self.reduced:
            out[link_of(c, links)] += c.nbytes
        return out


@dataclass
class CommReport:
    case: Case
    grad_elements: int  # P: the reference's gradient elements
    steps: dict  # (rank, dtype) -> [StepComm]
    init: dict  # (rank, dtype) -> [Collective] at construction
    expected_used: list = field(default_factory=list)  # (rank, dtype, step, micro, Expected.why, Collective)

    def per_step(self, rank=0, dtype=F32) -> list[dict]:
        return [dict(boundary_collectives=len(s.reduced), boundary_bytes=s.boundary_bytes,
                     boundary_elements=s.boundary_elements, ops=[f"{c.backend}:{c.op}" for c in s.boundary],
                     before_boundary=[len(m) for m in s.micro])
                for s in self.steps[(rank, dtype)]]


def hung(e, case: Case, gate) -> GateFailure:
    """A W-rank job that timed out (pool.DistTimeout): the failure names the rank(s) that hung, with their
    micro-steps per window (an uneven window: a lighter rank must still join the boundary), and their stacks."""
    ranks = getattr(e, "hung", [])
    n = lambda r: f"{case.micro_steps(r)} micro-step(s) per window"  # noqa: E731
    who = "; ".join(f"rank {r} ({n(r)}{_waits_in(str(e), r)})" for r in ranks) or "some rank"
    done = [r for r in range(case.world) if r not in ranks] if case.mesh is None else []
    rest = f"; rank(s) {', '.join(f'{r} ({n(r)})' for r in done)} finished" if done else ""
    return GateFailure(f"[{gate}] {who} hung: waiting in a collective no other rank joined{rest} — every rank must "
                       f"call its boundary reduction on its own last micro-step (micro-step N_r-1), however few it "
                       f"has; case {case}\n{e}", gate=gate, case=case)


def _stack(text: str, rank: int) -> list[tuple[str, str, str]]:
    """(file, line, function) of `rank`'s dumped stack in a pool's timeout message, innermost first."""
    block = text.partition(f"--- rank {rank} did not finish")[2].split("\n--- rank ")[0]
    frames = (re.match(r'\s*File "(.+)", line (\d+) in (\S+)', line) for line in block.splitlines())
    return [m.groups() for m in frames if m]


def in_collective(e: DistTimeout) -> bool:
    """Every hung rank's innermost frame is in torch.distributed or autograd (where DDP's reducer waits)."""
    waits = [os.sep.join(("torch", d, "")) for d in ("distributed", "autograd")]
    stacks = [_stack(str(e), r) for r in e.hung]
    return bool(stacks) and all(s and any(w in s[0][0] for w in waits) for s in stacks)


def _waits_in(text: str, rank: int) -> str:
    """', in FILE:LINE (FUNCTION)': the innermost frame of `rank`'s dumped stacks outside torch and the harness."""
    for path, line, fn in _stack(text, rank):
        if not any(p in path for p in ("site-packages", f"{os.sep}verify{os.sep}_internal{os.sep}")):
            return f", in {path}:{line} ({fn})"
    return ""


def _split(run: RankRun, case: Case, rank: int = 0):
    """Group a run's collectives by optimizer step; also return reductions outside any trainer call."""
    N, K = case.micro_steps(rank), case.steps
    steps = [StepComm([[] for _ in range(N - 1)], [], []) for _ in range(K)]
    init, stray = [], []
    for label, cs in run.comms.items():
        for c in cs:
            if label == ("init",):
                init.append(c)
            elif label is not None and label[0] == "micro":
                _, k, m = label
                (steps[k].boundary if m == N - 1 else steps[k].micro[m]).append(c)
            elif label is not None and label[0] == "boundary":
                steps[label[1]].boundary.append(c)
            elif label is not None and label[0] in ("params", "grads"):
                steps[label[1]].params.append(c)
            elif _reduces(c):
                where = (f"after step {label[1]}, outside any trainer call" if label else "before the run started")
                stray.append((where, c))
    return steps, init, stray


def check_boundary_only(outcomes: list[RankOutcome], case: Case, *, expected=(), row=None, row64=None) -> CommReport:
    """Raises GateFailure naming the rank, step, micro-step and collective on the first violation of the
    boundary rule (counts.check_step): `row` (a counts.CountRow), the exact collectives of the trainer's sync
    mode, or else the default row built from the gradient size (CountRow.default); `row64` the float64 run's
    (the row of the case at fp32; default `row`)."""
    gate, W = Gate.BOUNDARY_ONLY, case.world
    ref = outcomes[0].refs["ref64"]
    P = sum(g.numel() for g in ref.grads0.values())
    report = CommReport(case, P, {}, {})
    declared = row
    for o in outcomes:
        for dt, run in o.runs.items():
            row = row64 if dt == F64 and row64 is not None else declared
            steps, init, stray = _split(run, case, o.rank if case.mesh is None else 0)
            report.steps[(o.rank, dt)], report.init[(o.rank, dt)] = steps, init
            who = f"rank {o.rank} ({dt.replace('torch.', '')} run)"

            def fail(msg):
                raise GateFailure(f"[{gate}] {who}, {msg}; case {case}", gate=gate, case=case)

            for where, c in stray[:1]:
                fail(f"gradient-like collective {where}: {c.describe(run.main_thread)}")
            for k, s in enumerate(steps):  # what the row declares as side traffic carries no gradient bytes
                s.side = [c for _, c in excused(s.boundary, row.side if row else (), k, case.micro_steps(o.rank) - 1, W)[0]]
            if row is not None and W == 1:
                continue  # alone there is nothing to count against a data-parallel row (world 1 = the plain path)
            rule, empty = row or CountRow.default(P, run.n_params), case.empty_steps()
            for k, s in enumerate(steps):
                used, msg = check_step(rule, s.micro, s.boundary, k, W, expected,
                                       lambda c: c.describe(run.main_thread), skipped=k in empty, links=run.links)
                report.expected_used += [(o.rank, dt, k, m, e.why or e.op, c) for m, e, c in used]
                if msg:
                    fail(msg)
    return report


def boundary_summary(report: CommReport | None, rank: int, dtype: str, step: int) -> str:
    if report is None or (rank, dtype) not in report.steps:
        return ""
    s = report.steps[(rank, dtype)][step]
    N = report.case.micro_steps(rank)
    cs = "; ".join(c.describe() for c in s.reduced[:4]) or "no gradient collective"
    return f"; the boundary's collectives (step {step}, micro-step {N - 1} of {N} and optimizer_step()): {cs}"


# -- the numbers' verdict --------------------------------------------------------------------------

def check_dist_equivalence(outcomes: list[RankOutcome], case: Case, report: CommReport | None = None,
                           kappa=None, measure=None, loss_kappa=None) -> tuple[str, float, float | None, str | None]:
    """Every rank vs the one-rank reference on the big batch; returns (the check closest to its bound,
    its error / bound, the float64 floor judged with, what the step-0 checks could not judge or None). kappa: name -> κ, or a function returning it when a
    check needs it (Judge.step0); measure: a function measuring the case's own float64 floor on its twin when
    a float64 check needs it, loss_kappa: k -> κ of step k's loss, where a float64 loss check needs it (Judge.float64)."""
    big, ref = outcomes[0].refs["big32"], outcomes[0].refs["ref64"]
    worst, used, unjudged = ("", 0.0), None, None
    kappa = functools.cache(kappa) if callable(kappa) else kappa  # one function for every rank: computed once
    measure = functools.cache(measure) if callable(measure) else measure
    loss_kappa = functools.cache(loss_kappa) if callable(loss_kappa) else loss_kappa
    for o in outcomes:
        j = Judge(Gate.DP_EQUIVALENCE, case, f"rank {o.rank}: ",
                  lambda step, o=o: boundary_summary(report, o.rank, F32, step))
        acc = o.runs[F32].trace
        doomed = None
        if F64 in o.runs:  # looked at first, raised last: a case that fails anyway computes no κ
            try:
                f = j.float64(o.runs[F64].trace, ref, measure, loss_kappa)
                used = f if used is None or (f or 0.0) > used else used
            except GateFailure as e:
                doomed = e
        j.step0(acc, big, ref, kappa, doomed=doomed)
        j.loss_trajectory(acc, big)
        if doomed is not None:
            raise doomed
        unjudged = unjudged or getattr(j, "unjudged", None)  # the big batch is every rank's: one note
        if j.worst_ratio >= worst[1]:
            worst = (f"rank {o.rank}: {j.worst}", j.worst_ratio)
    for dt in outcomes[0].runs:  # all ranks hold the same parameters, bit for bit, after every step
        p0 = outcomes[0].runs[dt].trace.params
        for o in outcomes[1:]:
            j = Judge(Gate.DP_EQUIVALENCE, case, f"rank {o.rank}: ")
            for k, (pa, pb) in enumerate(zip(o.runs[dt].trace.params, p0)):
                for name, p in pb.items():
                    j.equal(pa.get(name, torch.empty(0)), p,
                            f"parameter {name!r} after step {k} vs rank 0's ({dt.replace('torch.', '')} run): ranks diverged", k)
    return worst[0], worst[1], used, unjudged


def check_distributed(adapter, case: Case, *, pool=None, ref_pool=None) -> GateResult:
    """Both gates on one run: the counter first (its message names the collective), then the numbers."""
    if not adapter.data_parallel:
        raise GateSkipped(f"{adapter.name} does not declare data parallelism (distributed=verify.Distributed(data_parallel=True))")
    outcomes = run_distributed(adapter, case, pool=pool, ref_pool=ref_pool)
    row = declared_row(adapter, case)
    # the float64 reference run has no autocast (precision fp32): a framework's collectives follow its precision,
    # and its mode where the framework runs float64 in another (Distributed.counts64)
    row64 = declared_row(adapter, case.replace(precision="fp32"), reference=True)
    report = check_boundary_only(outcomes, case, expected=adapter.expected, row=row, row64=row64)
    kpool = (pool if case.world == 1 else ref_pool) or get_pool(1)  # where the reference ran
    ref64 = outcomes[0].refs["ref64"]
    measure = lambda i: measured_floor(  # noqa: E731
        ref64, kpool.run(reference_job, adapter, case, i)[0]["ref64"])
    lazy = ((lambda: kpool.run(kappa_job, adapter, case, ref64)[0])  # noqa: E731
            if case.micro_blocks > 1 else None)
    loss_kappa = ((lambda k: kpool.run(loss_kappa_job, adapter, case, k, ref64.losses[k])[0])  # noqa: E731
                  if case.micro_blocks > 1 else None)
    try:
        worst, ratio, floor, unjudged = check_dist_equivalence(outcomes, case, report, lazy, measure, loss_kappa)
    except GateFailure as e:  # diagnose before judging: do two identical W-rank runs agree?
        rerun = lambda: run_distributed(adapter, case, pool=pool, ref_pool=ref_pool)[0].runs[F32].trace  # noqa: E731
        failure = determinism(e, rerun, outcomes[0].runs[F32].trace)
        failure = equal_weights(adapter, case, failure, outcomes[0].runs[F64 if F64 in outcomes[0].runs else F32]
                                .trace.grads0, kpool)
        raise by_term(adapter, case, failure, lambda c: check_distributed(adapter, c, pool=pool, ref_pool=ref_pool)) from None
    metrics = judge_world(adapter, case, {o.rank: o.runs[F64].trace for o in outcomes if F64 in o.runs}, ref64,
                          pool=kpool) if adapter.metrics is not None else {}
    steps = report.steps[(0, F32)]
    return GateResult(Gate.DP_EQUIVALENCE, case, worst, ratio, comm=report, floor64=floor, metrics=metrics, unjudged=unjudged,
                      boundary_bytes=[s.boundary_bytes for s in steps],
                      boundary_collectives=[len(s.reduced) for s in steps],
                      boundary_bytes_by_link=[s.bytes_by_link(outcomes[0].runs[F32].links) for s in steps],
                      gradient_bytes=4 * report.grad_elements,
                      declared_side_traffic=sum(len(s.side) for ss in report.steps.values() for s in ss))


def check_same_bytes(adapter, case: Case, *, pool=None, ref_pool=None) -> GateResult:
    """Bytes per step independent of N: the case at N, and the SAME global window at N=1 (one micro-step
    of N·B rows per rank; padded lengths apply to the same rows), must issue the same gradient-like
    collectives at every boundary, carrying the same bytes. Returns the N run's result."""
    got = check_distributed(adapter, case, pool=pool, ref_pool=ref_pool)
    one_case = (case.replace(rank_rows=tuple((sum(r),) for r in case.rank_rows)) if case.uneven else
                case.replace(accum_steps=1, micro_batch=case.accum_steps * case.micro_batch))
    one = check_distributed(adapter, one_case, pool=pool, ref_pool=ref_pool)
    row = declared_row(adapter, case)  # its carriers: a sharded engine's boundary all-gathers carry parameters
    carriers = row.carriers if row is not None else None  # (ZeRO-3's follow its prefetch trace: they vary with N)

    def carried(s):  # (bytes, collectives) of the boundary's gradient families
        cs = [c for c in s.reduced if carriers is None or family(c.op) in carriers]
        return sum(c.nbytes for c in cs), len(cs)

    for (rank, dt), steps in one.extra["comm"].steps.items():
        a = [carried(s) for s in got.extra["comm"].steps[(rank, dt)]]
        b = [carried(s) for s in steps]
        if a != b:
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            raise GateFailure(
                f"[{Gate.BYTES_PER_STEP}] rank {rank} ({dt.replace('torch.', '')} run), step {k}: the boundary moves "
                f"{a[k][0]} B in {a[k][1]} gradient collective(s) at N={case.accum_steps}, {b[k][0]} B in {b[k][1]} "
                f"at N=1 over the same window ({one_case}) — a step's boundary must reduce the gradient once, "
                f"whatever N; case {case}", gate=Gate.BYTES_PER_STEP, case=case)
    return got
