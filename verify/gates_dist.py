"""The data-parallel gates. A trainer under test runs on every rank of a pool (verify/pool.py) through
the same four methods as the single-process gates; the harness shards the data, drives the micro-steps,
marks a time window around every call, and counts every collective with the c10d flight recorder
(verify/comm.py). The parent process then judges:

boundary-only   micro-steps 0..N-2 issue no gradient collective; at the boundary (micro-step N-1 plus
                grads()/optimizer_step()) the floating-point elements reduced are the P gradient
                elements once, plus at most SCALARS side-channel scalars (the step loss and its row
                count), so the bytes per optimizer step do not depend on N; nothing outside the trainer's
                calls. Broadcasts and integer metadata (DDP's parameter sync at construction, its
                one-time bucket rebuild) are reported apart, not counted as gradient traffic.
equivalence     vs one process on the big batch N×B_local×W, same init and data: every rank's step-0
                boundary gradient and loss within the tolerance policy of verify/gates.py
                (err ≤ C·err(big32) + F vs a float64 reference); every step's loss within max_rel 1e-3
                of the fp32 big batch; the float64 run's parameters after every step within 1e-9 of
                the float64 big batch; parameters bitwise identical across ranks after every step.
                (No fp32 per-parameter check after AdamW steps: docs/design.md §6 says why.)

Every failure names the rank, the step, the micro-step and the collective(s) involved.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from xtrain_core.distributed import shard

from .comm import Collective, Windows, fmt_bytes
from .gates import ATOL64_PARAMS, C, FLOOR, GateFailure, rel_err
from .interface import Case, Trace
from .pool import default_backend, get_pool
from .reference import PlainTrainer

SCALARS = 8  # side-channel floats allowed to ride with the gradients (xtrain: Σ raw·B_local and N·B_local)
LOSS_MAX_REL = 1e-3
ENV_MAX_WORLD, ENV_MIN_WORLD = "XTRAIN_DIST_MAX_WORLD", "XTRAIN_DIST_MIN_WORLD"
DTYPES = (torch.float32, torch.float64)


def max_world() -> int:
    """World sizes the suite draws up to: XTRAIN_DIST_MAX_WORLD (default 4), capped by GPUs under NCCL."""
    w = int(os.environ.get(ENV_MAX_WORLD) or 4)
    if default_backend() == "nccl":
        w = min(w, torch.cuda.device_count())
    return w


def min_world() -> int:
    """The smallest world the suite draws: XTRAIN_DIST_MIN_WORLD (default 1), e.g. 8 to run only world 8."""
    return min(int(os.environ.get(ENV_MIN_WORLD) or 1), max_world())


# -- factories (top-level, so a pool can unpickle them by name) ------------------------------------

def xtrain_dist_factory(spec):
    from xtrain_core.distributed import DistAccumTrainer

    return DistAccumTrainer(spec.build_model(), spec.optim, spec.accum_steps)


def torch_ddp_factory(spec):
    from xtrain_core.distributed import TorchDDPTrainer

    return TorchDDPTrainer(spec.build_model(), spec.optim, spec.accum_steps)


def xtrain_single_factory(spec):
    from xtrain_core.trainer import AccumTrainer

    return AccumTrainer(spec.build_model(), spec.optim, spec.accum_steps)


IMPL_FACTORIES = {"xtrain": xtrain_dist_factory, "torch": torch_ddp_factory}


# -- what runs on each rank ------------------------------------------------------------------------

@dataclass
class RankRun:
    trace: Trace  # losses, step-0 grads, params after every step (CPU copies)
    comms: dict  # window label -> [Collective]; labels: ("init",), ("micro", k, m), ("boundary", k), ("after", k)
    main_thread: str


@dataclass
class RankOutcome:
    rank: int
    runs: dict  # dtype name -> RankRun
    refs: dict = field(default_factory=dict)  # "big32" (run on rank 0) / "ref64" (last rank) -> Trace


def _cpu(d: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in d.items()}


def drive(trainer, batches, case: Case, rank: int, world: int, device, windows: Windows) -> Trace:
    """The harness's loop: shard each global batch, one marked window per call."""
    N = case.accum_steps
    losses, params, grads0 = [], [], None
    for k, (idx, tgt) in enumerate(batches):
        for m, (x, y) in enumerate(shard(idx, tgt, N, rank, world)):
            x, y = x.to(device), y.to(device)
            windows.mark(("micro", k, m))
            trainer.micro_step(x, y, m)
        windows.mark(("boundary", k))
        g = trainer.grads()
        if grads0 is None:
            grads0 = _cpu(g)
        loss = float(trainer.optimizer_step())
        windows.mark(("after", k))  # the harness's own work from here on
        losses.append(loss)
        params.append(_cpu(trainer.params()))
    return Trace(losses, grads0, params)


def rank_job(ctx, factory, case: Case, *, dtypes=DTYPES, references: bool = True) -> RankOutcome:
    """On every rank: the trainer in each dtype, windows marked, collectives read; rank 0 also runs the
    single-process references (plain step on the big batch, fp32 and float64) on its device."""
    batches = case.batches()
    out = RankOutcome(ctx.rank, {})
    for dtype in dtypes:
        ctx.recorder.read()  # forget anything before this run
        win = Windows()
        win.mark(("init",))
        trainer = factory(case.spec(dtype=dtype, device=str(ctx.device)))
        trace = drive(trainer, batches, case, ctx.rank, ctx.world, ctx.device, win)
        del trainer
        out.runs[str(dtype)] = RankRun(trace, win.attribute(ctx.recorder.read()), ctx.recorder.main_thread)
    if references:  # the single-process big batch: fp32 on rank 0, float64 on the last rank (in parallel)
        from .interface import run

        for name, dtype, rank in (("big32", torch.float32, 0), ("ref64", torch.float64, ctx.world - 1)):
            if ctx.rank == rank:
                on_dev = [(i.to(ctx.device), t.to(ctx.device)) for i, t in batches]
                t = run(PlainTrainer(case.spec(accum_steps=1, dtype=dtype, device=str(ctx.device))), on_dev, 1)
                out.refs[name] = Trace(t.losses, _cpu(t.grads0), [_cpu(p) for p in t.params])
    return out


def run_distributed(factory, case: Case, *, pool=None, **kw) -> list[RankOutcome]:
    pool = pool or get_pool(case.world)
    if pool.world != case.world:
        raise ValueError(f"case needs world {case.world}, pool has {pool.world}")
    outcomes = pool.run(rank_job, factory, case, **kw)
    refs = {k: v for o in outcomes for k, v in o.refs.items()}
    for o in outcomes:
        o.refs = refs
    return outcomes


# -- the counter's verdict -------------------------------------------------------------------------

@dataclass
class StepComm:
    """Per rank, per dtype, per optimizer step: what the counter saw."""

    micro: list  # per micro-step: [Collective] of kind 'gradient'
    boundary: list  # gradient collectives at micro-step N-1 + grads()/optimizer_step()
    other: list  # broadcasts / metadata / barriers in the step (reported, not gradient traffic)

    @property
    def boundary_elements(self) -> int:
        return sum(c.numel for c in self.boundary)

    @property
    def boundary_bytes(self) -> int:
        return sum(c.nbytes for c in self.boundary)

    @property
    def gradient_collectives(self) -> int:
        return len(self.boundary) + sum(len(m) for m in self.micro)


@dataclass
class CommReport:
    case: Case
    grad_elements: int  # P
    steps: dict  # (rank, dtype) -> [StepComm]
    init: dict  # (rank, dtype) -> [Collective] at construction

    def per_step(self, rank=0, dtype="torch.float32") -> list[dict]:
        return [dict(gradient_collectives=s.gradient_collectives, boundary_bytes=s.boundary_bytes,
                     boundary_elements=s.boundary_elements, ops=[f"{c.backend}:{c.op}" for c in s.boundary],
                     micro_collectives=[len(m) for m in s.micro], other=[f"{c.backend}:{c.op} {c.kind}" for c in s.other])
                for s in self.steps[(rank, dtype)]]


def _split(run: RankRun, case: Case) -> tuple[list[StepComm], list[Collective], list[tuple[str, Collective]]]:
    """Group a run's collectives by optimizer step; also return gradient traffic outside any trainer call."""
    N, K = case.accum_steps, case.steps
    steps = [StepComm([[] for _ in range(N)], [], []) for _ in range(K)]
    init, stray = [], []
    for label, cs in run.comms.items():
        for c in cs:
            grad = c.kind == "gradient"
            if label == ("init",):
                init.append(c)
            elif label is not None and label[0] == "micro":
                _, k, m = label
                if not grad:
                    steps[k].other.append(c)
                elif m == N - 1:
                    steps[k].boundary.append(c)
                else:
                    steps[k].micro[m].append(c)
            elif label is not None and label[0] == "boundary":
                (steps[label[1]].boundary if grad else steps[label[1]].other).append(c)
            elif grad:
                where = (f"after optimizer_step() of step {label[1]}, outside any trainer call" if label else
                         "before the run started")
                stray.append((where, c))
    return steps, init, stray


def check_boundary_only(outcomes: list[RankOutcome], case: Case) -> CommReport:
    """Raises GateFailure naming the rank, step, micro-step and collective on the first violation."""
    gate, N, W = "boundary-only", case.accum_steps, case.world
    P = case.model.n_params
    report = CommReport(case, P, {}, {})
    for o in outcomes:
        for dt, run in o.runs.items():
            steps, init, stray = _split(run, case)
            report.steps[(o.rank, dt)], report.init[(o.rank, dt)] = steps, init
            who = f"rank {o.rank} ({dt.replace('torch.', '')} run)"
            for where, c in stray[:1]:
                raise GateFailure(f"[{gate}] {who}: gradient collective {where}: {c.describe(run.main_thread)}; "
                                  f"case {case}")
            for k, s in enumerate(steps):
                for m, cs in enumerate(s.micro):
                    if cs:
                        listed = "; ".join(c.describe(run.main_thread) for c in cs[:3])
                        more = f" (+{len(cs) - 3} more)" if len(cs) > 3 else ""
                        raise GateFailure(
                            f"[{gate}] {who}, step {k}, micro-step {m} of {N}: {len(cs)} gradient collective(s) "
                            f"before the boundary: {listed}{more} — micro-steps 0..{N - 2} must not "
                            f"communicate; case {case}")
                E = s.boundary_elements
                listed = "; ".join(c.describe(run.main_thread) for c in s.boundary[:4]) or "none"
                at = f"step {k}, boundary (micro-step {N - 1} of {N}, grads(), optimizer_step())"
                if E == 0 and W == 1:
                    continue  # one rank has nobody to reduce with: the single-process path
                if E == 0:
                    raise GateFailure(
                        f"[{gate}] {who}, {at}: no gradient all-reduce — expected the {P} gradient elements "
                        f"reduced once across {W} ranks, saw no gradient collective; case {case}")
                if E < P:
                    raise GateFailure(
                        f"[{gate}] {who}, {at}: gradient collectives cover {E} of {P} gradient elements "
                        f"(some parameters not reduced): {listed}; case {case}")
                if E > P + SCALARS:
                    raise GateFailure(
                        f"[{gate}] {who}, {at}: {E} elements reduced for {P} gradient elements "
                        f"(+ ≤ {SCALARS} scalars): gradients reduced more than once: {listed}; case {case}")
    return report


def boundary_summary(report: CommReport | None, rank: int, dtype: str, step: int) -> str:
    if report is None or (rank, dtype) not in report.steps:
        return ""
    s = report.steps[(rank, dtype)][step]
    N = report.case.accum_steps
    cs = "; ".join(c.describe() for c in s.boundary[:4]) or "no gradient collective"
    return f"; the boundary's collectives (step {step}, micro-step {N - 1} of {N} and optimizer_step()): {cs}"


# -- the numbers' verdict --------------------------------------------------------------------------

def check_dist_equivalence(outcomes: list[RankOutcome], case: Case, report: CommReport | None = None) -> float:
    """Every rank vs the single process on the big batch; returns the worst ratio to the bound."""
    gate = "distributed equivalence"
    big, ref = outcomes[0].refs["big32"], outcomes[0].refs["ref64"]
    f32, f64 = str(torch.float32), str(torch.float64)
    worst = 0.0

    def fail(msg, rank, dt, step):
        raise GateFailure(f"[{gate}] rank {rank}: {msg}{boundary_summary(report, rank, dt, step)}; case {case}")

    def within(acc_err, big_err, what, rank, step):  # the policy of verify/gates.py, C and FLOOR included
        nonlocal worst
        bound = C * big_err + FLOOR
        if not acc_err <= bound:  # also catches NaN
            fail(f"{what}: error {acc_err:.3e} > {C:g}·{big_err:.3e} (fp32 big-batch error) + {FLOOR:.1e}",
                 rank, f32, step)
        worst = max(worst, acc_err / bound)

    for o in outcomes:
        acc = o.runs[f32].trace
        # fp32, what accumulation itself computes: the step-0 boundary gradient and loss, under the policy
        for name, g in ref.grads0.items():
            if name not in acc.grads0:
                fail(f"no boundary gradient for {name!r}", o.rank, f32, 0)
            within(rel_err(acc.grads0[name], g), rel_err(big.grads0[name], g), f"gradient (step 0) of {name!r}",
                   o.rank, 0)
        la, lb, lr = acc.losses[0], big.losses[0], ref.losses[0]
        within(abs(la - lr) / abs(lr), abs(lb - lr) / abs(lr), "loss of step 0", o.rank, 0)
        # fp32 trajectory: every step's loss within max_rel 1e-3 of the fp32 big batch (the bound;
        # later steps pass through AdamW, whose ~lr·sign(g) first update turns rounding into sign flips)
        for k, (la, lb) in enumerate(zip(acc.losses, big.losses)):
            mr = abs(la - lb) / abs(lb)
            if not mr < LOSS_MAX_REL:
                fail(f"step-{k} loss {la!r} vs the big batch's {lb!r}: rel {mr:.3e} ≥ {LOSS_MAX_REL:g}", o.rank, f32, k)
        # float64: parameters after every step within 1e-9 of the float64 big batch
        if f64 in o.runs:
            for k, (pa, pr) in enumerate(zip(o.runs[f64].trace.params, ref.params)):
                for name, p in pr.items():
                    d = (pa[name] - p).abs().max().item()
                    if not d <= ATOL64_PARAMS:
                        fail(f"float64 parameter {name!r} after step {k}: max|Δ| = {d:.3e} > {ATOL64_PARAMS:.0e} "
                             f"vs the float64 big batch", o.rank, f64, k)
    # all ranks hold the same parameters, bit for bit, after every step
    for dt in outcomes[0].runs:
        p0 = outcomes[0].runs[dt].trace.params
        for o in outcomes[1:]:
            for k, (pa, pb) in enumerate(zip(o.runs[dt].trace.params, p0)):
                for name, p in pb.items():
                    if not torch.equal(pa[name], p):
                        d = (pa[name].double() - p.double()).abs().max().item()
                        fail(f"parameter {name!r} after step {k} differs from rank 0's "
                             f"({dt.replace('torch.', '')} run, max|Δ| = {d:.3e}): ranks diverged", o.rank, dt, k)
    return worst


def world1_job(ctx, case: Case) -> tuple[Trace, Trace, int]:
    """World 1: DistAccumTrainer and the single-process AccumTrainer, same process, same data."""
    from .interface import run

    batches = case.batches()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # CUDA: no atomics-order differences
    try:
        ctx.recorder.read()
        win = Windows()
        win.mark(("init",))
        dist_trace = drive(xtrain_dist_factory(case.spec(device=str(ctx.device))), batches, case, 0, 1, ctx.device, win)
        n_collectives = len(ctx.recorder.read())
        on_dev = [(i.to(ctx.device), t.to(ctx.device)) for i, t in batches]
        single = run(xtrain_single_factory(case.spec(device=str(ctx.device))), on_dev, case.accum_steps)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    cpu = lambda t: Trace(t.losses, _cpu(t.grads0), [_cpu(p) for p in t.params])  # noqa: E731
    return cpu(dist_trace), cpu(single), n_collectives


def check_world1_single_process(case: Case, *, pool=None) -> None:
    """World 1 is the single-process path: no collective, and every loss, step-0 gradient and parameter
    after every step bit-identical (torch.equal) to AccumTrainer's."""
    gate = "world 1 = single process"
    if case.world != 1:
        raise ValueError("check_world1_single_process needs a world-1 case")
    got, want, n = (pool or get_pool(1)).run(world1_job, case)[0]
    if n:
        raise GateFailure(f"[{gate}] {n} collective(s) issued with nobody to talk to; case {case}")
    for name, g in want.grads0.items():
        if not torch.equal(got.grads0[name], g):
            raise GateFailure(f"[{gate}] gradient (step 0) of {name!r}: not bit-identical, max|Δ| = "
                              f"{(got.grads0[name].double() - g.double()).abs().max().item():.3e}; case {case}")
    for k, (a, b) in enumerate(zip(got.losses, want.losses)):
        if a != b:
            raise GateFailure(f"[{gate}] loss at step {k}: {a!r} != {b!r}; case {case}")
    for k, (pa, pb) in enumerate(zip(got.params, want.params)):
        for name, p in pb.items():
            if not torch.equal(pa[name], p):
                raise GateFailure(f"[{gate}] parameter {name!r} after step {k}: not bit-identical, max|Δ| = "
                                  f"{(pa[name].double() - p.double()).abs().max().item():.3e}; case {case}")


def check_distributed(factory, case: Case, *, pool=None) -> CommReport:
    """Both gates on one run: the counter first (its message names the offending collective), then the
    numbers."""
    outcomes = run_distributed(factory, case, pool=pool)
    report = check_boundary_only(outcomes, case)
    check_dist_equivalence(outcomes, case, report)
    return report


__all__ = ["check_distributed", "check_boundary_only", "check_dist_equivalence", "run_distributed", "rank_job",
           "xtrain_dist_factory", "torch_ddp_factory", "IMPL_FACTORIES", "max_world", "min_world", "GateFailure", "C", "FLOOR",
           "fmt_bytes"]
