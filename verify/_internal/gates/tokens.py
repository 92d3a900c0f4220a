"""The token-mean claim, checked against the valid counts the harness knows (adapters with an ignore_index).

Split invariance compares a trainer with itself, so a count every split keeps (every position, count + 1,
sequences) passes it. Here fresh float64 trainers at the same parameters run whole windows:
token mean    additivity over disjoint windows A, B and A∪B (n·L and n·g add up), and A padded with rows
              that hold no valid target gives A's loss and gradients;
empty window  a window without a valid target leaves every parameter bit-unchanged and the next window as
              without it (skipped where the adapter declares empty_windows=False).
Bounds: tolerance.bound64 (twin floor × κ of the two-window sum); the empty window torch.equal.
Design: docs/design/numerics.md ("Token mean", "Empty windows").
"""
from __future__ import annotations

import math

import torch

from verify._internal.cases.case import Case, Trace, drive
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped
from verify._internal.gates.single import run_alone
from verify._internal.gates.tolerance import Judge, bound64, rel_err, twin_floor

__all__ = ["check_token_mean", "check_empty_window", "windows_case"]

GATE, EMPTY = Gate.TOKEN_MEAN, Gate.EMPTY_WINDOW
F64 = torch.float64


def windows_case(adapter, case: Case) -> Case:
    """`case` as this gate's two windows A and B: world 1 (the same E rows per window), two steps (B's
    padding: A's reversed where the case drew one step), float64 (precision fp32)."""
    E = case.effective_batch
    lengths = case.lengths
    if lengths is None:  # unpadded: every target valid
        lengths = (int(adapter.batch(1, 0, case.options)[1].reshape(1, -1).shape[1]),) * E
    if len(lengths) < 2 * E:
        lengths = tuple(lengths[:E]) + tuple(reversed(lengths[:E]))
    return case.replace(world=1, micro_batch=case.micro_batch * case.world, steps=2, precision="fp32",
                        lengths=tuple(lengths[:2 * E]))


def _skip_unless_tokens(adapter) -> None:
    if adapter.ignore_index is None:
        raise GateSkipped(f"{adapter.name} declares no ignore_index: it claims no token mean (declare "
                          f"@verify.adapter(ignore_index=-100) for a token-weighted trainer)")


def check_token_mean(adapter, case: Case, *, pool=None) -> GateResult:
    """Additivity over disjoint windows and padding that changes nothing (module docstring); GateFailure
    naming the check, GateSkipped for an adapter without an ignore_index."""
    _skip_unless_tokens(adapter)
    return run_alone(token_mean_job, adapter, windows_case(adapter, case), pool)


def check_empty_window(adapter, case: Case, *, pool=None) -> GateResult:
    """A window without a valid target is no step at all (module docstring); GateSkipped where the adapter
    declares no ignore_index or empty_windows=False."""
    _skip_unless_tokens(adapter)
    if not adapter.empty_windows:
        raise GateSkipped(f"{adapter.name} declares empty_windows=False (never fed a window without a valid "
                          f"target): what it does on one is not checked, and no gate draws one")
    return run_alone(empty_window_job, adapter, windows_case(adapter, case), pool)


# -- the runs --------------------------------------------------------------------------------------------

class _Runs:
    def __init__(self, adapter, case: Case, device: str):
        self.adapter, self.case, self.device = adapter, case, device
        (self.xa, self.ya), (self.xb, self.yb) = case.batches(adapter)
        self.ign = adapter.ignore_index

    def count(self, y: torch.Tensor) -> int:
        return int((y != self.ign).sum())

    def run(self, windows, n: int, gate: Gate) -> Trace:
        trainer = self.adapter(self.case.spec(accum_steps=n, dtype=F64, device=self.device, adapter=self.adapter))
        return drive(trainer, windows, n, dtype=F64, device=self.device, gate=gate)

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """B's inputs, every target padding: a window without a valid target."""
        return self.xb, torch.full_like(self.yb, self.ign)

    def padded(self) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """A plus E rows without a valid target, B of them inside each of A's N micro-batches (B doubled)."""
        N, B = self.case.accum_steps, self.case.micro_batch
        xp, yp = self.empty()
        xs, ys = [], []
        for m in range(N):
            a, p = slice(m * B, (m + 1) * B), slice(m * B, (m + 1) * B)
            xs += [self.xa[a], xp[p]]
            ys += [self.ya[a], yp[p]]
        return (torch.cat(xs), torch.cat(ys)), N


def _flip(batch):
    return batch[0].flip(0), batch[1].flip(0)


def _floors(pairs) -> tuple[float, dict]:
    """(floor, name -> parameter floor) from (run, twin) pairs, equal in exact arithmetic: twin_floor of the
    largest twin_diff, and for each parameter at least its own largest relative |Δ| (a tensor whose terms
    cancel rounds more than the whole)."""
    from verify._internal.gates.tolerance import twin_diff

    measured = max(twin_diff(a, b) for a, b in pairs)
    params = {}
    for a, b in pairs:
        for name, g in b.grads0.items():
            if name in a.grads0:
                params[name] = max(params.get(name, measured), rel_err(a.grads0[name], g))
    return twin_floor(measured), {k: twin_floor(v) for k, v in params.items()}


class _Verdicts:
    """Judges relative errors against bound64 and keeps the worst ratio."""

    def __init__(self, case: Case):
        self.case, self.worst, self.ratio = case, "", 0.0

    def check(self, what: str, err: float, floor: float, kappa: float, why: str) -> None:
        b = bound64(floor, kappa)
        if not err <= b:  # also NaN
            k = f", κ {kappa:.3g}" if kappa > 1.0 else ""
            raise GateFailure(f"[{GATE}] {what}: relative error {err:.3e} > {b:.1e} (float64 floor {floor:.1e}{k}) — "
                              f"{why}; case {self.case}", gate=GATE, case=self.case, error=err, bound=b,
                              hint="the loss is not Σ loss over valid targets / their number: divide by the window's "
                                   "count of targets that are not ignore_index, over every micro-step and rank")
        if err / b >= self.ratio:
            self.worst, self.ratio = what, err / b


def _zeros_like_any(traces, name):
    g = next(t.grads0[name] for t in traces if name in t.grads0)
    return torch.zeros_like(g, dtype=F64)


def token_mean_job(adapter, case: Case, device: str) -> GateResult:
    r = _Runs(adapter, case, device)
    N = case.accum_steps
    a_b = r.run([(r.xa, r.ya), (r.xb, r.yb)], N, GATE)  # step 0 is window A alone
    b = r.run([(r.xb, r.yb)], N, GATE)
    union = (torch.cat([r.xa, r.xb]), torch.cat([r.ya, r.yb]))
    ab = r.run([union], 2 * N, GATE)
    pad, n_pad = r.padded()
    rows = r.run([pad], n_pad, GATE)
    # twins: the same rows reversed, in ONE micro-batch — another order and another split, so a float32 part
    # (a loss computed in fp32, a count divided in fp32) shows; two of them, so one lucky match cannot hide it
    twins = [(ab, r.run([_flip(union)], 1, GATE)), (rows, r.run([_flip(pad)], 1, GATE))]
    overall, floors = _floors(twins)
    v = _Verdicts(case)
    na, nb = r.count(r.ya), r.count(r.yb)
    a = Trace(a_b.losses[:1], a_b.grads0, a_b.params[:1])
    if na + nb:  # additivity: Σ over windows of count × token mean = the union's
        parts = [(n, t) for n, t in ((na, a), (nb, b)) if n]
        whole = (na + nb) * ab.losses[0]
        s = sum(n * t.losses[0] for n, t in parts)
        kappa = sum(abs(n * t.losses[0]) for n, t in parts) / (abs(whole) or 1.0)
        head = f"additivity over windows A ({na} valid targets) and B ({nb}), at the same parameters"
        why = ("the counts × the windows' token means do not add up to the union's: the trainer divides by "
               "something other than the valid-target count")
        v.check(f"{head}: n_A·L_A + n_B·L_B vs n_AB·L_AB (step-0 loss)", abs(s - whole) / (abs(whole) or 1.0),
                overall, kappa, why)
        for name in sorted(set(ab.grads0).union(*(t.grads0 for _, t in parts))):
            zero = _zeros_like_any([ab, *(t for _, t in parts)], name)
            terms = [n * t.grads0.get(name, zero).double() for n, t in parts]
            w = (na + nb) * ab.grads0.get(name, zero).double()
            wn = w.norm().item()
            kappa = sum(x.norm().item() for x in terms) / wn if wn > 0 else 1.0
            v.check(f"{head}: n_A·g_A + n_B·g_B vs n_AB·g_AB of {name!r}", rel_err(sum(terms), w),
                    floors.get(name, overall), kappa, why)
    if na:  # rows without a valid target change nothing
        head = (f"padding: window A ({na} valid targets) plus {case.effective_batch} rows without one, inside every "
                f"micro-batch")
        why = "rows that hold no valid target changed the result: padding is counted (positions or sequences)"
        la, lt = a.losses[0], rows.losses[0]
        v.check(f"{head}: step-0 loss", abs(lt - la) / (abs(la) or 1.0), overall, 1.0, why)
        for name in sorted(set(a.grads0) | set(rows.grads0)):
            zero = _zeros_like_any([a, rows], name)
            v.check(f"{head}: gradient of {name!r}", rel_err(rows.grads0.get(name, zero), a.grads0.get(name, zero)),
                    floors.get(name, overall), 1.0, why)
    return GateResult(GATE, case, v.worst, v.ratio, valid=(na, nb), floor64=overall)


def empty_window_job(adapter, case: Case, device: str) -> GateResult:
    r = _Runs(adapter, case, device)
    N = case.accum_steps
    with_empty = r.run([(r.xa, r.ya), r.empty(), (r.xb, r.yb)], N, EMPTY)
    without = r.run([(r.xa, r.ya), (r.xb, r.yb)], N, EMPTY)
    before, after = with_empty.params[0], with_empty.params[1]
    for name, p in before.items():
        q = after.get(name)
        if q is None or not (q.shape == p.shape and torch.equal(q, p)):
            d = float("nan") if q is None or q.shape != p.shape else (q.double() - p.double()).abs().max().item()
            raise GateFailure(
                f"[{EMPTY}] a window without a valid target (after window A, {r.count(r.ya)} valid targets) changed "
                f"parameter {name!r}: max|Δ| = {d:.3e}{' (NaN: a division by a count of 0?)' if math.isnan(d) else ''}. "
                f"It must be no step at all — skip the update when the window's valid count is 0 — or declare "
                f"@verify.adapter(empty_windows=False); case {case}", gate=EMPTY, case=case, error=d, bound=0.0,
                hint="an empty window was stepped: weight decay, momentum or a 0/0 moved the parameters")
    j = Judge(EMPTY, case, where="window B after an empty window, vs B right after A with no empty window between "
                                 "(the reference): ")
    # a true no-op leaves the two runs bit-identical; the float64 rule (at what an fp32 run resolves) bounds them
    j.float64(Trace(with_empty.losses[2:], {}, with_empty.params[2:]), Trace(without.losses[1:], {}, without.params[1:]))
    return GateResult(EMPTY, case, "parameters bit-unchanged; the next window as without it", 0.0)
