"""The metrics gate: what a trainer reports per optimizer step (metrics(), declared by verify.Metrics) against
the harness's own value of the same step, and against the trainer's own big batch; with a declared max_norm,
also the clip coefficient as the optimizer saw it applied. Judged on the float64 runs, within the float64 bound;
a bf16 / fp16 case also on its run in that precision against its own unscaled values (judge_precision; each
precision's bounds: gates/metrics_bounds.py).

    check_metrics    one process: N micro-steps vs the big batch at N = 1 (gates/single.py's runners)
    judge_run        one run (one rank of a data-parallel or mesh world too) against its expected values
Each failure names the metric, the step, the rank, both numbers and the factor between them where it is a
count of the case (×N micro-steps, ×W ranks, ...) or the loss scale. Design: docs/design/metrics.md.
"""
from __future__ import annotations

import math

import torch

from verify._internal.cases.case import Case, drive, shard
from verify._internal.gates.clipped import stepped_norm
from verify._internal.metrics import ENABLE, Observer, applied_coef, max_norm_of, norm_of
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped
from verify._internal.gates.kappa import fed, loss_kappa as loss_kappa64, loss_kappa_job
from verify._internal.gates.metrics_bounds import FLOAT64, Float64Bounds, LowBounds, loss_kappa
from verify._internal.gates.tolerance import factor_text

__all__ = ["check_metrics", "judge_run", "not_declared", "observer", "expected_counts", "MetricsTally"]

F64 = torch.float64


def not_declared(adapter) -> str:
    return f"{adapter.name} declares no reported metrics: loss, grad_norm, clip_coef, lr, tokens, rows not checked ({ENABLE})"


def observer(adapter) -> Observer | None:
    """An Observer for one run of `adapter`, or None when it declares no metrics (drive then observes nothing)."""
    return Observer(adapter.metrics, adapter.ignore_index) if adapter.metrics is not None else None


def expected_counts(adapter, batches) -> list[tuple[int, int]]:
    """(valid targets, rows) of every step's whole window, over every rank."""
    out = []
    for _, y in batches:
        valid = int((y != adapter.ignore_index).sum()) if adapter.ignore_index is not None else y.numel()
        out.append((valid, int(y.shape[0])))
    return out


class MetricsTally:
    """What one case checked: metric -> steps checked; metric -> why some step was not; clip steps."""

    def __init__(self):
        self.checked: dict[str, int] = {}
        self.unchecked: dict[str, str] = {}
        self.clipped = self.steps = 0
        self.worst, self.ratio = "", 0.0
        self.reported: set[str] = set()  # every key metrics() returned, declared or not

    def ok(self, name: str, err: float, bound: float, what: str) -> None:
        self.checked[name] = self.checked.get(name, 0) + 1
        r = err / bound if bound else 0.0
        if r >= self.ratio:
            self.worst, self.ratio = what, r

    def extra(self) -> dict:
        return dict(metrics_checked=dict(self.checked), metrics_unchecked=dict(self.unchecked),
                    clipped_steps=self.clipped, metric_steps=self.steps, metrics_reported=sorted(self.reported))


def _close(got: float, want: float, tol: float, error=None) -> tuple[bool, float]:
    """(within, relative error — or `error(got, want)`): NaN agrees only with NaN; an exact 0 wants |got| ≤ tol."""
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got), 0.0
    err = error(got, want) if error is not None else abs(got - want) / (abs(want) or 1.0)
    return err <= tol, err


def judge_run(adapter, case: Case, seen: list[dict], norms: list, counts: list, losses: list, *, who: str,
              rank: int = 0, world: int = 1, big: list[dict] | None = None, last_micro=None, tally=None,
              no_loss=frozenset(), bounds: Float64Bounds = FLOAT64) -> MetricsTally:
    """One run's reported metrics, step by step, against what the harness expects of them:

    seen     the run's Observer steps (this rank's)        norms   the harness's global pre-clip norm per step
    counts   (valid targets, rows) of each whole window     losses  the expected step loss per step (the float64
                                                                    big batch's; a low-precision run's own)
    big      the big batch's own Observer steps (its reported metrics: the same value is expected of both)
    last_micro  () -> this rank's last micro-batch's float64 loss at step 0 (Metrics(loss="last_micro"))
    no_loss  the steps whose optimizer_step() returned None on this rank (a pipeline's earlier stage, as the
             protocol allows): the rank does not know the loss, so metrics() may leave 'loss' out there
    bounds   each metric's bound and what a failure can name (FLOAT64; a bf16 / fp16 run's: LowBounds, both in
             gates/metrics_bounds.py)
    Raises GateFailure('[reported metrics] ...') naming the metric, the step, the rank and the factor."""
    m, tally, b = adapter.metrics, tally or MetricsTally(), bounds
    where = f"rank {rank}: " if world > 1 else ""
    cap = max_norm_of(m, case.options)

    def fail(msg, k, err=None, bnd=None, hint=None):
        raise GateFailure(f"[{Gate.REPORTED_METRICS}] {where}{who}, step {k}: {msg}; case {case}", gate=Gate.REPORTED_METRICS,
                          case=case, error=err, bound=bnd, hint=hint)

    def judged(name, k, s, got, want):
        """(within, error, bound): a check that fails at its κ = 1 bound is judged again with a measured κ."""
        tol = b.tol(name, k, s)
        ok, err = _close(got, want, tol, b.error(name))
        better = None if ok else b.refine(name, k)
        if better is not None:
            tol = better
            ok, err = _close(got, want, tol, b.error(name))
        return ok, err, tol

    def named(got, want, s, tol, extra=()):
        text = factor_text(got, want, case, extra, b.factors(s), max(1e-6, tol))  # within the run's own rounding
        return text, b.hint(text)

    for k, s in enumerate(seen):
        tally.steps += 1
        rep, norm = s["reported"], norms[k]
        tally.reported.update(rep)
        at_step = None  # grads_from="optimizer" (no grads() read): ‖g as stepped‖ (float64 runs, whole views)
        if norm is None and not isinstance(b, LowBounds):
            elements = lambda step: (step.get("applied") or (0.0, None))[1]  # noqa: E731  (None: not stepped)
            whole = world == 1 or big is not None and k < len(big) and elements(big[k]) == elements(s)
            at_step, pre = stepped_norm(s, m, case.options, whole)
            norm = pre  # the pre-clip norm where clipping provably did not act (clipped.stepped_norm), else None
        finite = norm is not None and math.isfinite(norm)  # not finite: an fp16 window that overflowed, skipped
        empty = counts[k][0] == 0 and adapter.ignore_index is not None
        stepped = s["stepped"]
        applied = applied_coef(s)  # ‖g as stepped‖ / ‖g pre-clip‖, this rank
        want_coef = None if cap is None or not finite else min(1.0, cap / (norm + m.clip_eps))
        if (want_coef is not None and want_coef < 1.0 or at_step is not None and norm is None and cap is not None) \
                and stepped:  # at the step: a stepped norm above max_norm − clip_eps was clipped (clipped.preclip)
            tally.clipped += 1
        # clipping as applied: the optimizer saw the pre-clip gradient × min(1, max_norm / the GLOBAL norm)
        if want_coef is not None and stepped:
            if applied is None:
                tally.unchecked.setdefault("clip (applied)" + b.label, "the optimizer holds other elements than "
                                           "grads() shows (its shards, at step 0), or grads() was not read "
                                           "(grads_from='optimizer')")
            else:
                ok, err, tol = judged("clip (applied)", k, s, applied, want_coef)
                if not ok:
                    text, hint = named(applied, want_coef, s, tol, b.extra(s, "clip_coef", cap, m.clip_eps))
                    cause = ("clipping ran on the loss-scaled gradient, before unscale_" if hint else "the coefficient "
                             "came from a partial or per-rank norm, or clipping ran before the reduction")
                    fail(f"the clip coefficient applied: the optimizer stepped ‖g‖ × {applied:.6g}, but max_norm "
                         f"{cap:g} over the global pre-clip norm {norm:.6g} gives {want_coef:.6g}{text}: {cause}",
                         k, err, tol, hint)
                tally.ok("clip (applied)" + b.label, err, tol, f"clip coefficient applied{b.label} (step {k})")
        for name in m.names:
            if name not in rep:
                if empty or (name == "loss" and k in no_loss):
                    continue  # a window without a valid target, or a rank without the loss: it may be left out
                fail(f"metrics() has no {name!r}, which Metrics(names=...) declares", k)
            got = rep[name]
            if isinstance(got, str):
                fail(f"metric {name!r} is {got}, not a number", k)
            want, extra, why = _expected(name, m, s, k, norm, counts, losses, applied, want_coef, last_micro, seen, b,
                                         at_step)
            if want is None:
                tally.unchecked.setdefault(name + b.label, why)
                if at_step is None or name not in ("grad_norm", "clip_coef"):
                    continue
                tol = b.tol(name, k, s)  # not observable after clipping: judged by what it implies, and the big batch's
                if name == "grad_norm":
                    _implies_stepped(got, at_step, cap, m.clip_eps, tol, lambda msg, e: fail(msg, k, e, tol), tally,
                                     f"{name} (step {k}): the norm it implies as stepped", case)
            else:
                ok, err, tol = judged(name, k, s, got, want)
                if not ok and name == "loss" and m.loss == "window" and k == 0 and last_micro is not None:
                    mine = last_micro()  # run only to name a failure
                    extra = () if mine is None else (("the loss of this rank's last micro-batch", mine),)
                if not ok:
                    text, hint = named(got, want, s, tol, (*extra, *b.extra(s, name, cap, m.clip_eps)))
                    fail(f"{name} reported {got!r}, expected {want!r} ({why}){text}", k, err, tol, hint)
                tally.ok(name + b.label, err, tol or 1.0, f"{name}{b.label} (step {k})")
            if big is not None and k < len(big) and name in big[k]["reported"] and _same_in_big(name, m):
                ok, err = _close(got, big[k]["reported"][name], tol)
                if not ok:
                    fail(f"{name} reported {got!r}, the big batch reported {big[k]['reported'][name]!r} for the same "
                         f"step{factor_text(got, big[k]['reported'][name], case)}", k, err, tol)
                if want is None and name == "clip_coef":  # its one judgement at the step (grads_from="optimizer")
                    tally.ok(name, err, tol or 1.0, f"{name} (step {k}) against the big batch's")
    return tally


def _implies_stepped(got: float, at_step: float, cap, clip_eps: float, tol: float, fail, tally, what: str,
                     case) -> None:
    """grads_from="optimizer", a step whose pre-clip norm is not observable: a reported pre-clip norm n must give the
    norm the optimizer stepped, n·min(1, max_norm / (n + clip_eps)) — without max_norm at least it (clipping never
    enlarges a gradient). Exact where nothing clipped; where clipping acted, it bounds n below only."""
    implied = got * min(1.0, cap / (got + clip_eps)) if cap is not None else min(got, at_step)
    ok, err = _close(implied, at_step, tol)
    if not ok:
        how = f"clipping it at max_norm {cap:g} gives {implied!r}" if cap is not None else "clipping never enlarges a gradient"
        fail(f"grad_norm reported {got!r}, but the optimizer stepped a gradient of norm {at_step!r} (read as its step "
             f"began; grads_from='optimizer'): {how}{factor_text(got, at_step, case)}", err)
    tally.ok("grad_norm", err, tol or 1.0, what)


def _same_in_big(name: str, m) -> bool:
    """Whether the big batch's own report of `name` is the value expected of every split."""
    return not ((name == "loss" and m.loss == "last_micro") or (name in ("tokens", "rows") and m.counts == "rank"))


def _expected(name, m, s, k, norm, counts, losses, applied, want_coef, last_micro, seen, b=FLOAT64, at_step=None):
    """(value the harness expects, [(name, value) a wrong report may equal], what it is) — value None: this step
    cannot be checked, and the third item says why. `at_step`: ‖g as stepped‖ where no grads() was read."""
    if name == "loss":
        if m.loss == "window":
            return losses[k], (), b.loss_what
        if b.own_loss:
            return None, (), "loss='last_micro' is judged on the float64 runs (at step 0), not in low precision"
        if k > 0 or last_micro is None:
            return None, (), "loss='last_micro' is known to the harness at step 0 only (the initial parameters)"
        mine = last_micro()
        if mine is None:
            return None, (), ("loss='last_micro': this rank's last micro-batch of step 0 holds no valid target, and the "
                              "adapter is never fed such a window alone (empty_windows=False)")
        return mine, (("the window's loss", losses[0]),), "the loss of this rank's last micro-batch at step 0"
    if name == "grad_norm" and norm is None and at_step is not None and m.grad_norm == "post_clip":
        return at_step, (), "‖the gradient as the optimizer stepped it‖, read as its step began"
    if name in ("grad_norm", "clip_coef") and norm is None:
        return None, (), ("the harness has no pre-clip gradient (grads_from='optimizer' reads it after clipping)" +
                          ("" if at_step is None else ": judged against the big batch's report" +
                           (" and as giving the norm stepped" if name == "grad_norm" else "")))
    if name in ("grad_norm", "clip_coef") and not math.isfinite(norm):
        return None, (), "a window whose unscaled gradient is not finite (fp16 overflow: the scaler skips its step)"
    if name == "grad_norm":
        after = norm * applied if applied is not None else (norm * want_coef if want_coef is not None else None)
        if m.grad_norm == "pre_clip":
            return norm, (("the norm after clipping", after if after != norm else None),), (
                "‖the boundary gradient‖, every element once")
        if after is None:
            return None, (), "grad_norm='post_clip' needs max_norm, or the optimizer's view of the step"
        return after, (("the norm before clipping", norm if after != norm else None),), "‖the gradient as stepped‖"
    if name == "clip_coef":
        if want_coef is None:
            if applied is None:
                return None, (), "no max_norm declared and the optimizer's gradients were not seen"
            return applied, (), "the coefficient the optimizer saw applied"
        return want_coef, (), "min(1, max_norm / (the global pre-clip norm + clip_eps))"
    if name == "lr":
        if not s["stepped"]:
            return None, (), "no optimizer step ran in some window (skipped), so no LR was applied"
        want = s["lr"] if m.lr == "applied" else s["lr_after"]
        other = s["lr_after"] if m.lr == "applied" else s["lr"]
        prev = seen[k - 1]["lr"] if k > 0 else None
        return want, (("the LR after the scheduler's step (the next step's)" if m.lr == "applied" else
                       "the LR applied, read before the scheduler's step", other if other != want else None),
                      ("the previous step's LR", prev if prev != want else None)), (
            "the LR the optimizer applied" if m.lr == "applied" else "the LR after the scheduler's step")
    # tokens, rows
    i = 0 if name == "tokens" else 1
    micro = s["micro_tokens"] if name == "tokens" else s["micro_rows"]
    local = sum(micro)
    want = counts[k][i] if m.counts == "global" else local
    extra = [(f"micro-step {n}'s count on this rank", float(c)) for n, c in enumerate(micro) if c != want]
    if local != want:
        extra.insert(0, ("this rank's count", float(local)))
    return float(want), tuple(extra), ("the window's, over every rank" if m.counts == "global" else "this rank's")


def check_metrics(adapter, case: Case, *, pool=None) -> GateResult:
    """One process: the float64 accumulation run and the float64 big batch, each against the harness's own
    values, and against each other (GateSkipped, with how to enable it, for an adapter without metrics); a
    bf16 / fp16 case also its accumulation run in that precision, against that run's own values
    (judge_precision)."""
    from verify._internal.gates.single import run_alone

    if adapter.metrics is None:
        raise GateSkipped(not_declared(adapter))
    if case.world != 1:
        raise ValueError(f"check_metrics takes world-1 cases, got world {case.world}")
    return run_alone(metrics_gate, adapter, case, pool)


def metrics_gate(adapter, case: Case, device: str) -> GateResult:
    N = case.accum_steps
    batches = case.batches(adapter)

    def run(n, data=batches):
        t = adapter(case.spec(accum_steps=n, dtype=F64, device=device, adapter=adapter))
        return drive(t, data, n, dtype=F64, device=device, gate=Gate.REPORTED_METRICS, observe=observer(adapter),
                     keep_params=False)  # judged by what was reported and seen, never the parameters

    acc, big = run(N), run(1)
    counts = expected_counts(adapter, batches)
    tally = MetricsTally()
    bounds = Float64Bounds(loss_kappa64(adapter, case, device, big, Gate.REPORTED_METRICS))  # a loss's κ, where needed

    def last_micro(n):
        def value():  # at N = 1 the last micro-batch is the whole window
            if n == 1:
                return big.losses[0]
            x, y = shard(*batches[0], n, 0, 1)[n - 1]
            return run(1, [(x, y)]).losses[0] if fed(adapter, y) else None
        return value

    for who, tr, n, other in (("the big batch", big, 1, None), ("the accumulation run", acc, N, big)):
        judge_run(adapter, case, tr.seen, [norm_of(s) for s in tr.seen], counts, big.losses, who=who,
                  big=None if other is None else other.seen, last_micro=last_micro(n), tally=tally, bounds=bounds)
    if case.precision != "fp32":  # the case's autocast precision: that run's reports against its own values
        judge_precision(adapter, case, device, batches, counts, big, tally)
    return GateResult(Gate.REPORTED_METRICS, case, tally.worst, tally.ratio, **tally.extra())



def judge_precision(adapter, case: Case, device: str, batches, counts, big, tally) -> None:
    """The case's accumulation run in its autocast precision (parameters fp32), each report against that run's
    own values — grads()' norm (unscaled, as the protocol defines it), the loss optimizer_step() returned —
    within LowBounds (gates/metrics_bounds.py). `big`: the float64 big batch's Trace (step 0's loss, for κ)."""
    N, p = case.accum_steps, case.precision
    t = adapter(case.spec(accum_steps=N, device=device, adapter=adapter))
    observe = Observer(adapter.metrics, adapter.ignore_index, scaled=True)
    tr = drive(t, batches, N, device=device, gate=Gate.REPORTED_METRICS, observe=observe)
    bounds = LowBounds(p, adapter.metrics, lambda k: loss_kappa(adapter, case, device, batches, k, big))
    judge_run(adapter, case, tr.seen, [norm_of(s) for s in tr.seen], counts, tr.losses,
              who=f"the {p} accumulation run", tally=tally, bounds=bounds)


def block_loss_job(ctx, adapter, case: Case, rank: int) -> float | None:
    """On a one-rank pool: the float64 step loss of rank `rank`'s last micro-batch of step 0 alone (the adapter
    at N = 1 on those rows, the initial parameters): what Metrics(loss="last_micro") reports at step 0."""
    x, y = shard(*case.batches(adapter)[0], case.accum_steps, rank, case.world)[-1]
    if not fed(adapter, y):  # never fed alone (empty_windows=False): no value to expect
        return None
    t = adapter(case.spec(accum_steps=1, dtype=F64, device=str(ctx.device), adapter=adapter))
    return drive(t, [(x, y)], 1, dtype=F64, device=ctx.device, gate=Gate.REPORTED_METRICS).losses[0]


def judge_world(adapter, case: Case, runs: dict, ref, norms: dict | None = None, pool=None) -> dict:
    """Every rank's float64 run (runs: rank -> Trace, each with its Observer steps) against the one-rank float64
    big batch `ref` (a Trace with its own): each rank that reports must report the global values. `norms`:
    rank -> the global pre-clip norm per step (default: the rank's own boundary gradient, which data parallelism
    replicates). `pool`: where a last-micro-batch reference runs (loss='last_micro'). A mesh case's rank is named
    with its coordinates; its rows are its dp replica's. Returns the tally's extra."""
    if adapter.metrics is None:
        return {}
    counts = expected_counts(adapter, case.batches(adapter))
    tally = MetricsTally()
    def kappa(k):  # a loss's κ where its check fails at κ = 1, on the reference's pool (as Judge.float64's)
        if pool is None:
            return loss_kappa_job(_Here(case.device), adapter, case, k, ref.losses[k])
        return pool.run(loss_kappa_job, adapter, case, k, ref.losses[k])[0]
    bounds = Float64Bounds(kappa if case.micro_blocks > 1 else None)
    for rank, tr in sorted(runs.items()):
        who, rows = f"{case.world}-rank run", rank
        if case.mesh is not None:
            rows, stage, t = case.mesh.coords(rank)
            who = f"{case.mesh} run (replica {rows}, stage {stage}, tp rank {t})"

        def last_micro(rows=rows):
            if pool is None:
                return block_loss_job(_Here(case.device), adapter, case, rows)
            return pool.run(block_loss_job, adapter, case, rows)[0]
        mine = norms[rank] if norms is not None else [norm_of(s) for s in tr.seen]
        judge_run(adapter, case, tr.seen, mine, counts, ref.losses, who=who, rank=rank, world=case.ranks,
                  big=ref.seen, last_micro=last_micro, tally=tally, bounds=bounds,
                  no_loss={k for k, loss in enumerate(tr.losses) if loss is None})
    return tally.extra()


class _Here:
    def __init__(self, device):
        self.device = device
