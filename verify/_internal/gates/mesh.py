"""The mesh gate: a trainer on dp × pp × tp ranks vs its own 1×1×1 big batch (`check_mesh`).

Every rank runs the window through the four methods on a pool of mesh.size ranks, the same adapter at Mesh(),
pipeline_chunks=1, accum_steps=1 beside it; each dp replica is assembled from what its ranks own
(verify/_internal/ranks/mesh.py) and judged by tolerance.Judge, the replicas bit-equal after every step. The
per-axis counts (gates/mesh_counts.py) come first; the step loss is the last stage's, its tp ranks agreeing
exactly. Failures name the mesh, the chunks, the outer steps, the replica and the owning stage. Declared
Metrics are judged last, per rank, against each replica's whole-gradient norm (`mesh_norms`).

Design: docs/design/distributed.md, "Mesh axes"; docs/design/metrics.md, "On a mesh".
"""
from __future__ import annotations

import functools
import math

from verify._internal.cases.case import Case, Trace
from verify._internal.ranks.mesh import MeshError, _who, assemble, meshes, missing, unsupported
from verify._internal.ranks.pool import get_pool
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped
from verify._internal.gates.distributed import F32, F64, reference_job, run_distributed
from verify._internal.gates.kappa import kappa_job, loss_kappa_job
from verify._internal.gates.counts import declared_row
from verify._internal.gates.metrics import judge_world
from verify._internal.gates.mesh_counts import check_mesh_counts
from verify._internal.gates.tolerance import Judge, bound64, measured_floor, param_scale

__all__ = ["check_mesh", "check_mesh_splits", "assemble_traces", "mesh_norms", "where", "padding_lead"]

GATE = Gate.MESH_EQUIVALENCE


def where(case: Case) -> str:
    """'mesh dp=1 pp=2 tp=1, chunks=2, outer=2: ' — how every message of the gate opens."""
    return f"{case.mesh}, chunks={case.pipeline_chunks}, outer={case.accum_steps // case.pipeline_chunks}: "


def _fail(case: Case, msg: str):
    raise GateFailure(f"[{GATE}] {where(case)}{msg}; case {case}", gate=GATE, case=case)


def assemble_traces(traces: list[Trace], case: Case, names) -> list[Trace]:
    """Each rank's Trace -> one Trace per dp replica: gradients and parameters assembled over its pp stages
    (and checked across its tp ranks), losses from its last stage. `names`: the reference's parameter names."""
    mesh, out = case.mesh, []
    try:
        grads = assemble([t.grads0 for t in traces], mesh, "gradient (step 0)")
        params = [assemble([t.params[k] for t in traces], mesh, f"parameter after step {k}")
                  for k in range(case.steps)]
        for d in range(mesh.dp):
            missing(grads[d], names, mesh, d, "gradient (step 0)")
            for k in range(case.steps):
                missing(params[k][d], names, mesh, d, f"parameter after step {k}")
    except MeshError as e:
        _fail(case, str(e))
    for d in range(mesh.dp):
        ranks = mesh.stage_ranks(d, mesh.pp - 1)
        last = [traces[r].losses for r in ranks]
        for k in range(case.steps):
            if last[0][k] is None:
                _fail(case, f"replica {d}: the last stage (stage {mesh.pp - 1}) returned no loss from optimizer_step() "
                            f"at step {k}: the ranks that compute the loss return it")
            bad = next((i for i in range(1, len(ranks)) if last[i][k] != last[0][k]
                        and not (last[i][k] != last[i][k] and last[0][k] != last[0][k])), None)  # NaN = NaN here
            if bad is not None:
                _fail(case, f"replica {d}, stage {mesh.pp - 1}: {_who(mesh, ranks[bad])} return different losses at "
                            f"step {k} ({last[0][k]!r} vs {last[bad][k]!r})")
        out.append(Trace([last[0][k] for k in range(case.steps)], grads[d], [params[k][d] for k in range(case.steps)]))
    return out


def mesh_norms(traces: list[Trace], case: Case) -> dict[int, list]:
    """rank -> the harness's pre-clip norm of its replica's whole gradient, per step (what grad_norm must be).
    Each rank's Observer holds Σ g² per name of what its grads() returned (a DTensor gathered whole): pp stages
    own disjoint names and a stage's tp ranks the same ones, so the replica's sums merge by name, each name
    once (its copies must agree), and the norm is the square root of the total. None: a step without the
    pre-clip gradient (grads_from='optimizer')."""
    mesh, out, tol = case.mesh, {}, bound64()
    for d in range(mesh.dp):
        ranks = [r for s in range(mesh.pp) for r in mesh.stage_ranks(d, s)]
        norms = []
        for k in range(case.steps):
            sums = [traces[r].seen[k].get("sumsq") for r in ranks]
            if any(s is None for s in sums):
                norms.append(None)
                continue
            merged, by = {}, {}
            whole = math.sqrt(max(sum(s.values()) for s in sums))  # a copy zero at that resolution: judged against it
            for r, s in zip(ranks, sums):
                for name, v in s.items():
                    if name in merged and abs(v - merged[name]) > tol * param_scale(
                            math.sqrt(max(abs(v), abs(merged[name]))), whole) ** 2:
                        _fail(case, f"replica {d}: ranks {by[name]} and {r} hold different gradients of {name!r} at "
                                    f"step {k} (Σg² {merged[name]!r} vs {v!r}): a parameter's copies on its stage's "
                                    f"tp ranks must be one tensor")
                    merged.setdefault(name, v)
                    by.setdefault(name, r)
            norms.append(math.sqrt(sum(merged.values())))
        out.update({r: norms for r in ranks})
    return out


def _stage_of(traces: list[Trace], case: Case):
    """name -> 'stage s' (from replica 0's tp rank 0): for messages."""
    mesh, by = case.mesh, {}
    for s in range(mesh.pp):
        for name in traces[mesh.rank(0, s, 0)].grads0:
            by.setdefault(name, f"stage {s}")
    return by


def _name_stage(e: GateFailure, stages: dict, pp: int) -> GateFailure:
    """The failure with the parameter it names followed by its pipeline stage (pp > 1)."""
    msg = str(e)
    if pp > 1:
        for name, s in stages.items():
            if repr(name) in msg:
                msg = msg.replace(repr(name), f"{name!r} ({s})", 1)
                break
    return GateFailure(msg, gate=e.gate, case=e.case, error=e.error, bound=e.bound, hint=e.hint)


def check_mesh(adapter, case: Case, *, pool=None, ref_pool=None) -> GateResult:
    """The mesh gate on one case (case.mesh set, case.world its dp). GateSkipped for an adapter that
    declares no mesh_axes; ValueError for a mesh wider than the adapter declares."""
    if not adapter.mesh_axes:
        raise GateSkipped(f"{adapter.name} declares no mesh axes (distributed=verify.Distributed(mesh_axes=('pp',) | ('tp',) | ...))")
    if case.mesh is None:
        raise ValueError("check_mesh needs a case with a mesh (Case(mesh=verify.Mesh(...), world=mesh.dp))")
    extra = [a for a in case.mesh.axes() if a not in adapter.mesh_axes]
    if extra:
        raise ValueError(f"{case.mesh} uses axes {extra} that {adapter.name} does not declare ({adapter.mesh_axes})")
    why = unsupported(case.mesh, adapter.mesh_sizes)
    if why:  # a size the model cannot shard (hidden 16 over tp=3) is no failure of the trainer
        raise GateSkipped(f"{adapter.name} on {case.mesh}: {why}")
    outcomes = run_distributed(adapter, case, pool=pool, ref_pool=ref_pool, gate=GATE)
    counted = check_mesh_counts(outcomes, case, declared_row(adapter, case))
    big, ref = outcomes[0].refs["big32"], outcomes[0].refs["ref64"]
    runs = {dt: assemble_traces([o.runs[dt].trace for o in outcomes], case, ref.grads0) for dt in (F32, F64)}
    stages = _stage_of([o.runs[F32].trace for o in outcomes], case)
    kpool = (pool if case.ranks == 1 else ref_pool) or get_pool(1)  # where the reference ran
    measure = functools.cache(lambda i: measured_floor(
        ref, kpool.run(reference_job, adapter, case, i)[0]["ref64"]))
    kappa = functools.cache(lambda: kpool.run(kappa_job, adapter, case, ref)[0])
    lazy = kappa if case.accum_steps * case.world > 1 else None
    loss_kappa = functools.cache(lambda k: kpool.run(loss_kappa_job, adapter, case, k, ref.losses[k])[0]) if lazy else None
    worst, used, unjudged = ("", 0.0), None, None
    for d in range(case.mesh.dp):
        j = Judge(GATE, case, where(case) + (f"replica {d}: " if case.mesh.dp > 1 else ""))
        doomed = None
        try:
            try:  # looked at first, raised last (as in gates/distributed.py): a doomed case computes no κ
                f = j.float64(runs[F64][d], ref, measure, loss_kappa)
                used = f if used is None or (f or 0.0) > used else used
            except GateFailure as e:
                doomed = e
            j.step0(runs[F32][d], big, ref, lazy, doomed=doomed)
            j.loss_trajectory(runs[F32][d], big)
            if doomed is not None:
                raise doomed
        except GateFailure as e:
            raise _name_stage(e, stages, case.mesh.pp) from None
        unjudged = unjudged or getattr(j, "unjudged", None)  # the big batch is every replica's: one note
        if j.worst_ratio >= worst[1]:
            worst = (f"replica {d}: {j.worst}", j.worst_ratio)
    for dt, replicas in runs.items():  # every dp replica holds the same parameters, bit for bit
        for d in range(1, case.mesh.dp):
            j = Judge(GATE, case, where(case) + f"replica {d}: ")
            for k, (pa, pb) in enumerate(zip(replicas[d].params, replicas[0].params)):
                for name, p in pb.items():
                    try:
                        j.equal(pa[name], p, f"parameter {name!r} after step {k} vs replica 0's "
                                f"({dt.replace('torch.', '')} run): replicas diverged", k)
                    except GateFailure as e:
                        raise _name_stage(e, stages, case.mesh.pp) from None
    metrics = {}
    if adapter.metrics is not None:  # last, as in gates/distributed.py: every rank's float64 run vs the big batch's
        f64 = {o.rank: o.runs[F64].trace for o in outcomes}
        metrics = judge_world(adapter, case, f64, ref, norms=mesh_norms([f64[r] for r in sorted(f64)], case),
                              pool=kpool)
    return GateResult(GATE, case, worst[0], worst[1], floor64=used, counts=counted, metrics=metrics, unjudged=unjudged)


def check_mesh_splits(adapter, case: Case, world: int) -> GateResult:
    """Split invariance over mesh shapes: `case`'s window (E = N·B·dp rows, its seeds) on every mesh of
    `world` ranks over the adapter's axes whose dp divides the window's rows per micro-step (B per replica =
    N·B·dp / (N·dp')), with case's chunks where pp > 1, each through the mesh gate against the same 1×1×1
    reference: every factorisation gives the big batch's step. A failure names the mesh."""
    E, worst, n = case.effective_batch, ("", 0.0), 0
    for m in meshes(adapter.mesh_axes, world, adapter.mesh_sizes):
        if E % (case.accum_steps * m.dp):
            continue
        c = case.replace(mesh=m, world=m.dp, micro_batch=E // (case.accum_steps * m.dp),
                         pipeline_chunks=case.pipeline_chunks if m.pp > 1 else 1)
        try:
            r = check_mesh(adapter, c)
        except GateFailure as e:
            raise GateFailure(f"[{Gate.MESH_SPLIT_INVARIANCE}] {m} of a window of {E} rows: {e}",
                              gate=Gate.MESH_SPLIT_INVARIANCE,
                              case=c, error=e.error, bound=e.bound, hint=e.hint) from None
        n += 1
        if r.ratio >= worst[1]:
            worst = (f"{m}: {r.worst}", r.ratio)
    return GateResult(Gate.MESH_SPLIT_INVARIANCE, case, worst[0], worst[1], splits=n)


def _uneven_counts(case: Case, seq_len: int) -> list[str]:
    """The axes (cp, dp) along which some window's valid-target counts differ between ranks: a cp rank's are its
    tokens [c·S/cp, (c+1)·S/cp) of each row of its replica (right padding), a replica's its rows'."""
    m, E, B, n = case.mesh, case.effective_batch, case.micro_batch, seq_len // case.mesh.cp
    out = set()
    for k in range(case.steps):
        rows = case.lengths[k * E:(k + 1) * E]  # (micro-step, replica, row) order
        replica = [[rows[(j * m.dp + d) * B + b] for j in range(case.accum_steps) for b in range(B)] for d in range(m.dp)]
        if len({sum(r) for r in replica}) > 1:
            out.add("dp")
        if m.cp > 1 and any(len({sum(min(max(v - c * n, 0), n) for v in r) for c in range(m.cp)}) > 1 for r in replica):
            out.add("cp")
    return [a for a in ("cp", "dp") if a in out]


def padding_lead(adapter, case: Case) -> str | None:
    """The cause a padded mesh failure that passes on the same rows unpadded points to: a token count taken per rank
    on the axis along which the ranks' counts differ (cp: the last cp rank holds a right-padded row's padding)."""
    if case.mesh is None or case.lengths is None:
        return None
    axes = _uneven_counts(case, int(case.batches(adapter)[0][1].shape[1]))
    if not axes:
        return None
    what = {"cp": "a per-rank token count on the cp axis (each cp rank divides by its own tokens' count, then the cp "
                  "ranks average; a right-padded row's padding lands on the last cp rank)",
            "dp": "a per-replica token count on the dp axis (each dp replica divides by its own count, then the "
                  "replicas average)"}
    return (f"it passes on the same rows unpadded and fails where the ranks' valid-target counts differ: "
            f"{' or '.join(what[a] for a in axes)} — sum the loss and the count over every rank (dp × cp) once at "
            f"the boundary, then divide")
