"""The path-parity gate: a switch the adapter declares must not change the result (verify.Parity), e.g. activation
checkpointing on vs off, a fused vs an unfused loss, compile on vs off.

Both sides run the same windows from the same init, at the case's N and precision. Where the math is the same
(Parity.exact, the default) every loss, step-0 gradient and parameter after every step must be bit-equal; where it
is not (a fused kernel sums in another order), the on side is judged like an accumulation run against the off side
as its big batch (tolerance.Judge.step0 and the float64 runs). A difference is first re-run on the off side alone
(diagnose.determinism): a trainer that differs from itself is reported as such. Design: docs/design/protocol.md.
"""
from __future__ import annotations

import torch

from verify._internal.cases.case import Case, drive
from verify._internal.declare import Parity
from verify._internal.gates.diagnose import determinism, first_difference
from verify._internal.gates.single import run_alone
from verify._internal.gates.tolerance import Judge
from verify._internal.verdict import Gate, GateFailure, GateResult, GateSkipped

__all__ = ["Parity", "check_parity", "HINT"]

GATE = Gate.PATH_PARITY
HINT = ("the switch changed the numbers: something the forward computes (a counter, a running statistic, a random "
        "draw) runs again when the backward recomputes it under checkpointing, or a fused path normalises "
        "differently. Keep state updates out of the recomputed region (or skip them while recomputing: "
        "torch.utils.checkpoint's recompute runs under the same module), and make both paths divide by the same count")


def check_parity(adapter, case: Case, *, pool=None) -> GateResult:
    """The declared switch on vs off on `case` (module docstring); GateSkipped without a declaration."""
    if adapter.parity is None:
        raise GateSkipped(f"{adapter.name} declares no switch that must leave the result unchanged (declare "
                          f"@verify.adapter(parity=verify.Parity(name=..., apply=...)), e.g. activation checkpointing)")
    return run_alone(parity_job, adapter, case.replace(world=1), pool)


def _ratio(a, b) -> str:
    """' (‖on‖ / ‖off‖ = 2)' for the first step-0 gradient the two sides disagree on, else ''."""
    for name, g in a.grads0.items():
        h = b.grads0.get(name)
        if h is not None and not torch.equal(g, h):
            n = g.double().norm().item()
            return f" (‖on‖ / ‖off‖ = {h.double().norm().item() / n:.4g})" if n else ""
    return ""


def parity_job(adapter, case: Case, device: str) -> GateResult:
    p = adapter.parity
    off, on = (case.replace(options=p.apply(case.options, side)) for side in (False, True))
    batches = off.batches(adapter)  # one set of windows for both sides (a switch changes no data)
    N = case.accum_steps

    def run(c: Case, dtype=torch.float32):
        trainer = adapter(c.spec(accum_steps=N, dtype=dtype, device=device, adapter=adapter))
        return drive(trainer, batches, N, dtype=dtype, device=device, gate=GATE)

    a, b = run(off), run(on)
    if not p.exact:
        j = Judge(GATE, case, where=f"{p.name} on vs off (the off side as the big batch): ")
        ref64 = run(off, torch.float64)
        try:
            floor = j.float64(run(on, torch.float64), ref64)
            j.step0(b, a, ref64)
        except GateFailure as e:
            raise determinism(e, lambda: run(off), a) from None
        return GateResult(GATE, case, j.worst, j.worst_ratio, floor64=floor, switch=p.name, exact=False)
    what = first_difference(a, b)
    if what is None:
        return GateResult(GATE, case, "bit-equal", 0.0, switch=p.name, exact=True)
    failure = GateFailure(f"[{GATE}] {p.name} on vs off, the same windows from the same init: {what} differs"
                          f" (off vs on){_ratio(a, b)}, where the math is the same (declared exact: every bit must be); case "
                          f"{case}", gate=GATE, case=case, hint=HINT)
    raise determinism(failure, lambda: run(off), a)
