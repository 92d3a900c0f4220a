"""What a failing trainer does, measured by re-running parts of it: the leads gates/rerun.py names before its
knob-by-knob re-runs, each a fact about the trainer rather than a pattern of the error.

    built_wrong        two builds from one Spec: initial parameters that differ (not seeded from Spec.seed),
                       or not float64 from a float64 Spec (not built in Spec.dtype)
    per_rank_schedule  at W > 1, the LR after k steps is the one-process reference's after W·k (per rank)
    micro_means        a padded window's gradient is the mean of its micro-batches' own token means

In this process, or on a one-rank pool where the failing runs were pooled; float64, against bound64.
Design: docs/design/tolerance.md, "Around the policy"; tested in tests/harness/test_evidence.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verify._internal.cases.case import Case, _cpu, drive, split
from verify._internal.gates.tolerance import bound64, rel_err

__all__ = ["built_wrong", "per_rank_schedule", "micro_means", "token_mean"]

F64 = torch.float64


@dataclass
class _Here:
    """A RankContext for a job run in this process (world 1, no group)."""

    device: str
    rank: int = 0
    world: int = 1
    group: object = None


def _alone(case: Case, steps: int, lengths: tuple | None) -> Case:
    """The case's rows in one process: N micro-batches, each the W ranks' rows of one micro-step (an uneven
    window: one micro-step of its rows)."""
    n = 1 if case.rank_rows is not None else case.accum_steps
    return case.replace(world=1, accum_steps=n, micro_batch=case.effective_batch // n, rank_rows=None, mesh=None,
                        pipeline_chunks=1, steps=steps, lengths=lengths)


def _one(adapter, case: Case, pooled: bool, job, *args):
    """job(ctx, adapter, case, *args) in this process, or on a one-rank pool."""
    if not pooled:
        return job(_Here(case.device), adapter, case, *args)
    from verify._internal.ranks.pool import get_pool

    return get_pool(1).run(job, adapter, case, *args)[0]


# -- how the trainer is built ----------------------------------------------------------------------------

def build_job(ctx, adapter, case: Case) -> tuple[list[dict], set]:
    """params() of two fresh trainers built from the same float64 Spec, on the CPU, before any step, and the
    names of the first one's trainable parameters (requires_grad)."""
    spec = case.spec(accum_steps=case.accum_steps, dtype=F64, device=str(ctx.device), adapter=adapter)
    first = adapter(spec).params()
    trainable = {k for k, p in first.items() if getattr(p, "requires_grad", False)}
    return [_cpu(first), _cpu(adapter(spec).params())], trainable


def built_wrong(adapter, case: Case, pooled: bool) -> str | None:
    """The seed or dtype lead: two trainers from one Spec whose initial parameters differ, or a float64 Spec
    whose trainer holds trainable parameters in another floating dtype; None when both are as the Spec says."""
    (a, b), trainable = _one(adapter, case, pooled, build_job)
    for name, p in a.items() if set(a) == set(b) else ():  # names that differ by build: no claim on values
        q = b[name]
        if q.shape == p.shape and not bool(((p == q) | (p.isnan() & q.isnan())).all()):
            d = float((p.double() - q.double()).abs().max())
            return (f"two trainers built from the same Spec start from different parameters ({name!r}, "
                    f"max|Δ| {d:.3g}), so no two runs the gates compare start alike: the model is not seeded from "
                    f"Spec.seed — call torch.manual_seed(spec.seed) (or a generator seeded from it) right before "
                    f"building it, in the factory")
    # trainable ones only: a frozen part kept in a low precision (a quantised base) is a design, not this slip
    wrong = {name: p.dtype for name, p in a.items() if p.is_floating_point() and p.dtype != F64 and name in trainable}
    if wrong:
        name, dtype = next(iter(wrong.items()))
        return (f"built from a float64 Spec, the trainer holds {len(wrong)} of {len(trainable)} trainable parameters "
                f"in {str(dtype).removeprefix('torch.')} ({name!r}), so its float64 run and the float64 reference "
                f"are not float64 and their rounding fails the float64 bounds: build the model in Spec.dtype "
                f"(model.to(spec.device, spec.dtype)); the gates' precisions run through Spec.precision")
    return None


# -- the LR schedule of a W-rank run -------------------------------------------------------------------

def lr_job(ctx, adapter, case: Case, schedule_world: int | None = None) -> list | None:
    """The LR the trainer's first stepped optimizer applies at each step k < K of `case` on this rank, then the LR
    it holds after the last (step K's; the float64 run; read by step pre-hooks, as the metrics gate does).
    `schedule_world`: the Spec's, where a one-process case stands for a W-rank run's reference."""
    import dataclasses

    from verify._internal.metrics import Metrics, Observer

    rank = ctx.rank
    if getattr(ctx, "recorder", None) is not None:
        ctx.recorder.discard()  # a pool rank's collectives are not judged here
    seen = Observer(Metrics(names=("lr",)), adapter.ignore_index)
    spec = case.spec(dtype=F64, device=str(ctx.device), adapter=adapter, group=ctx.group, rank=rank)
    trainer = adapter(spec if schedule_world is None else dataclasses.replace(spec, schedule_world=schedule_world))
    drive(trainer, case.batches(adapter), case.micro_steps(rank), dtype=F64, device=ctx.device, rank=rank,
          world=case.world, observe=seen, rank_rows=case.rank_rows)
    steps = seen.steps
    return [s["lr"] for s in steps] + [steps[-1]["lr_after"]] if steps else None


def _tiled(case: Case, steps: int) -> tuple | None:
    """The case's padding repeated window by window over `steps` windows (its own windows only: none new)."""
    if case.lengths is None:
        return None
    return tuple(case.lengths[i % len(case.lengths)] for i in range(steps * case.effective_batch))


def _same(x, y) -> bool:
    return x is not None and y is not None and abs(x - y) <= bound64() * max(abs(x), abs(y))


def per_rank_schedule(adapter, case: Case) -> str | None:
    """The per-rank scheduler's lead where the W-rank run's LR at step k is its one-process reference's at step
    W·k (+ o < W), for every k ≤ K, and not its LR at step k; None otherwise (world 1, a mesh, no LR).
    The reference runs as the gates run it: with scheduler_per_rank declared, Spec.schedule_world = W, so a
    trainer that emulates the W ranks there gets no lead."""
    W, K = case.world, case.steps
    if W < 2 or case.mesh is not None:
        return None
    from verify._internal.ranks.pool import get_pool

    got = get_pool(W, subgroups=adapter.subgroups).run(lr_job, adapter, case)[0]
    declared = getattr(adapter, "scheduler_per_rank", False)
    S = W * (K + 1)  # the reference's steps: W·k + o for every k ≤ K and offset o < W
    ref = _one(adapter, _alone(case, S, _tiled(case, S)), True, lr_job, W if declared else None)
    if not got or not ref or len(got) != K + 1 or len(ref) != S + 1 or all(_same(got[k], ref[k]) for k in range(K + 1)):
        return None
    # offset o: a scheduler stepped before the optimizer in the window's last micro-step (inside accumulate(), as
    # Accelerate's examples do) applies the LR after W·(k + 1) advances at step k, the reference's after k + 1
    o = next((o for o in range(W) if all(_same(got[k], ref[W * k + o]) for k in range(K + 1))), None)
    if o is None:
        return None
    k = next(k for k in range(K + 1) if not _same(got[k], ref[k]))
    fix = ("you declare scheduler_per_rank=True, yet in the one-process reference (Spec.schedule_world = W) it "
           "advances once per step: call the scheduler's step() Spec.scheduler_calls times per optimizer step"
           if declared else
           "declare distributed=verify.Distributed(scheduler_per_rank=True) and call the scheduler's step() Spec.scheduler_calls "
           "times per optimizer step (1 on the ranks, W in the harness's one-process reference)")
    return (f"at step {k} the {W}-rank run applies LR {got[k]:.6g}, its one-process reference {ref[k]:.6g}; at "
            f"every step k ≤ {K} the ranks' LR is the reference's at step {W}·k{f' + {o}' if o else ''}: the LR "
            f"scheduler advances once per rank, {W}× per optimizer step — Accelerate's prepared scheduler steps "
            f"num_processes times per step() call (split_batches=False); {fix}")


# -- a padded token mean: the mean of micro-batch means? ------------------------------------------------

def grads_job(ctx, adapter, case: Case, parts: list) -> list:
    """The float64 step-0 gradient of a fresh trainer on each (rows, accum_steps) of `parts`, one step."""
    out = []
    for (x, y), n in parts:
        t = adapter(case.spec(accum_steps=n, dtype=F64, device=str(ctx.device), adapter=adapter))
        out.append(drive(t, [(x, y)], n, dtype=F64, device=ctx.device).grads0)
    return out


def micro_means(adapter, case: Case, pooled: bool) -> str | None:
    """The per-micro-batch count's lead where a window's float64 step-0 gradient (in one process, each
    micro-batch the ranks' rows of one micro-step) is the mean over its N micro-batches of each one's own
    gradient alone — an empty micro-batch adding 0 and counting 1 — and not the window's; None otherwise. The
    first window of the case where that can show: ≥ 2 micro-batches with valid targets, in unequal numbers."""
    if adapter.ignore_index is None or case.lengths is None or not token_mean(adapter, case):
        return None
    E, ignore = case.effective_batch, adapter.ignore_index
    for k in range(case.steps):
        one = _alone(case, 1, tuple(case.lengths[k * E:(k + 1) * E]))
        N = one.accum_steps
        x, y = _window(adapter, case, k)
        counts = [int((m[1] != ignore).sum()) for m in split(x, y, N)] if N > 1 else []
        if sum(c > 0 for c in counts) >= 2 and len(set(counts)) > 1:
            return _micro_means(adapter, one, pooled, x, y, counts)
    return None


def token_mean(adapter, case: Case) -> bool:
    """Every term the case's runs compute is a token mean (a trainer alone on one micro-batch: its token mean)."""
    from verify._internal.objective import objective_of

    obj = objective_of(adapter)
    return obj is not None and all(obj.terms.get(t) == "token_mean" for t in (case.terms or obj.terms))


def _window(adapter, case: Case, k: int):
    """Window k of the case's data (its data seed and padding), as one process holds it."""
    return case.replace(steps=k + 1, lengths=tuple(case.lengths[:(k + 1) * case.effective_batch])).batches(adapter)[k]


def _micro_means(adapter, one: Case, pooled: bool, x, y, counts: list) -> str | None:
    N = one.accum_steps
    micro = [(xy, 1) for xy, n in zip(split(x, y, N), counts) if n]
    at_n, big, *alone = _one(adapter, one, pooled, grads_job, [((x, y), N), ((x, y), 1), *micro])
    names = sorted(big)
    if any(set(g) != set(names) for g in (at_n, *alone)):
        return None
    flat = lambda g: torch.cat([g[k].double().flatten() for k in names])  # noqa: E731
    terms = [flat(g) / N for g in alone]
    mean = sum(terms)
    kappa = sum(float(t.norm()) for t in terms) / (float(mean.norm()) or 1.0)
    if not rel_err(flat(at_n), mean) <= bound64(kappa=kappa) or rel_err(flat(at_n), flat(big)) <= bound64():
        return None
    return (f"a window's step-0 gradient is the mean of its {N} micro-batches' own token means (valid targets per "
            f"micro-batch {counts}), not the window's token mean: each micro-batch is divided by its own count, "
            f"then by N — divide the window's summed loss by the window's count of valid targets, over every "
            f"micro-step and rank (equal counts hide it, so unpadded windows pass)")
