"""How far every planted bug of planted/registry.py lands above the float64 bound (docs/design.md §3):
the float64 checks judge at C·eps32 (what an fp32 run resolves) since issue 26, where a true float64 trainer was
judged at 1e-9 before, so a structural bug must err well above C·eps32 ≈ 9.5e-7. For each planted bug that a
gate rejects in one process (world 1: the float64 checks run there in this process), its largest float64
deviation from the float64 big batch (losses of every step, parameters after every step, as the checks scale
them) divided by C·eps32: > 1 rejects it there, however its gate's verdict then reads; and the rejecting
check's own error over its bound (which check: the verdict's gate; a count or dtype check has none).

    python -m benchmarks.float64_margins [--out reports/cpu/float64-margins.json]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from planted import registry as planted
from verify import GateFailure, atomic_write, check, report_header
# the study's probe: the float64 checks' own deviation, read inside the policy (no public door: it measures the harness)
from verify._internal.gates.tolerance import C, EPS32, Judge


def deviation(acc64, ref64) -> float:
    """The largest relative deviation the float64 checks see (Judge._float64's scaling), NaN-free."""
    out = 0.0
    for la, lr in zip(acc64.losses, ref64.losses):
        if not (math.isnan(la) or math.isnan(lr)):
            out = max(out, abs(la - lr) / (abs(lr) or 1.0))
    for pa, pr in zip(acc64.params, ref64.params):
        for name, p in pr.items():
            if name in pa and p.numel() and pa[name].shape == p.shape:
                d = (pa[name].double() - p.double()).abs().max().item()
                out = max(out, d / max(1.0, p.abs().max().item()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports/cpu/float64-margins.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    seen: list[float] = []
    original = Judge._float64

    def record(self, acc64, ref64, *args, **kwargs):  # whatever else the policy takes (its floor, κ), passed on
        seen.append(deviation(acc64, ref64))
        return original(self, acc64, ref64, *args, **kwargs)

    Judge._float64 = record
    from verify import Gate

    JUDGED = (Gate.EQUIVALENCE, Gate.PARTIAL_SUMS, Gate.SPLIT_INVARIANCE, Gate.LONG_WINDOW, Gate.NORMALISER,
              Gate.EMPTY_WINDOW)  # the gates whose float64 checks run in one process
    rows = []
    for b in planted.PLANTED:
        if b.gate not in JUDGED or b.case is None or b.case.ranks > 1 or b.needs:
            continue
        adapter = b.load()
        if adapter.process_group:
            continue
        seen.clear()
        ratio = None
        try:
            check(b.gate, adapter, b.case, *(b.args if b.gate is not Gate.SPLIT_INVARIANCE else (1,)))
            verdict = "passed"
        except GateFailure as e:
            verdict = str(e.gate)
            if e.error is not None and e.bound:
                ratio = e.error / e.bound  # the rejecting check's error over its bound
        dev = max(seen) if seen else None
        rows.append(dict(bug=b.name, gate=str(b.gate), verdict=verdict, float64_deviation=dev,
                         float64_over_bound=None if dev is None else dev / (C * EPS32), verdict_over_bound=ratio))
        print(f"{b.name:28s} {verdict:18s} " + ("—" if dev is None else f"{dev:.2e} {dev / (C * EPS32):9.3g}×")
              + ("" if ratio is None else f"  verdict {ratio:.3g}×"))
    Judge._float64 = original
    atomic_write(a.out, json.dumps({**report_header("float64-margins"), "bound": C * EPS32, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
