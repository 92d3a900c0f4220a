"""Two whole windows A and B at the same parameters, as the normaliser gate (gates/objective.py) runs them, and
the empty-window gate (adapters with an ignore_index):
empty window  a window without a valid target leaves every parameter bit-unchanged and the next window as
              without it (skipped where the adapter declares empty_windows=False). Bound: torch.equal, then the
              float64 rule for the window after it. Design: docs/design/numerics.md ("Empty windows").
"""
from __future__ import annotations

import math

import torch

from verify._internal.cases.case import Case, Trace, drive
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped
from verify._internal.gates.single import run_alone
from verify._internal.gates.tolerance import Judge, bound64, param_err, twin_floor

__all__ = ["check_empty_window", "windows_case"]

EMPTY = Gate.EMPTY_WINDOW
F64 = torch.float64


def windows_case(adapter, case: Case) -> Case:
    """`case` as this gate's two windows A and B: world 1 (the same E rows per window), two steps (B's
    padding: A's reversed where the case drew one step), float64 (precision fp32)."""
    E = case.effective_batch
    lengths = case.lengths
    if adapter.ignore_index is None:  # no padding at all (a row mean, a sum over rows)
        return case.replace(world=1, micro_batch=case.micro_batch * case.world, steps=2, precision="fp32")
    if lengths is None:  # unpadded: every target valid
        lengths = (int(adapter.batch(1, 0, case.options)[1].reshape(1, -1).shape[1]),) * E
    if len(lengths) < 2 * E:
        lengths = tuple(lengths[:E]) + tuple(reversed(lengths[:E]))
    return case.replace(world=1, micro_batch=case.micro_batch * case.world, steps=2, precision="fp32",
                        lengths=tuple(lengths[:2 * E]))


def _skip_unless_tokens(adapter) -> None:
    if adapter.ignore_index is None:
        raise GateSkipped(f"{adapter.name} declares no ignore_index: it claims no token mean (declare "
                          f"batches=verify.Batches(ignore_index=-100) for a token-weighted trainer)")


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
    largest twin_diff, and for each parameter at least its own largest |Δ| relative to its param_scale (a tensor
    whose terms cancel rounds more than the whole; one zero in exact arithmetic is judged against the whole)."""
    from verify._internal.gates.tolerance import twin_diff, whole_norm

    measured = max(twin_diff(a, b) for a, b in pairs)
    params = {}
    for a, b in pairs:
        whole = whole_norm(b.grads0)
        for name, g in b.grads0.items():
            if name in a.grads0:
                params[name] = max(params.get(name, measured), param_err(a.grads0[name], g, whole, measured))
    return twin_floor(measured), {k: twin_floor(v) for k, v in params.items()}


def _zeros_like_any(traces, name):
    g = next(t.grads0[name] for t in traces if name in t.grads0)
    return torch.zeros_like(g, dtype=F64)


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
                f"batches=verify.Batches(empty_windows=False); case {case}", gate=EMPTY, case=case, error=d, bound=0.0,
                hint="an empty window was stepped: weight decay, momentum or a 0/0 moved the parameters")
    j = Judge(EMPTY, case, where="window B after an empty window, vs B right after A with no empty window between "
                                 "(the reference): ")
    # a true no-op leaves the two runs bit-identical; the float64 rule (at what an fp32 run resolves) bounds them
    j.float64(Trace(with_empty.losses[2:], {}, with_empty.params[2:]), Trace(without.losses[1:], {}, without.params[1:]))
    return GateResult(EMPTY, case, "parameters bit-unchanged; the next window as without it", 0.0)
