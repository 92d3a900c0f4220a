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
import torch

from planted import registry as planted
from verify import GateFailure, atomic_write, check, report_header
from verify.study import FLOAT64_BOUND, float64_deviations


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports/cpu/float64-margins.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from verify import Gate

    JUDGED = (Gate.EQUIVALENCE, Gate.PARTIAL_SUMS, Gate.SPLIT_INVARIANCE, Gate.LONG_WINDOW, Gate.NORMALISER,
              Gate.EMPTY_WINDOW)  # the gates whose float64 checks run in one process
    rows = []
    with float64_deviations() as seen:  # each float64 check's largest deviation, as the policy scales it
        for b in planted.PLANTED:
            rows += _row(b, seen, JUDGED)
    atomic_write(a.out, json.dumps({**report_header("float64-margins"), "bound": FLOAT64_BOUND, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


def _row(b, seen: list, judged) -> list[dict]:
    """One planted bug's row ([] where its gate is not judged in one process), its float64 deviations from `seen`."""
    from verify import Gate

    if b.gate not in judged or b.case is None or b.case.ranks > 1 or b.needs:
        return []
    adapter = b.load()
    if adapter.process_group:
        return []
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
    over = None if dev is None else dev / FLOAT64_BOUND
    print(f"{b.name:28s} {verdict:18s} " + ("—" if dev is None else f"{dev:.2e} {over:9.3g}×")
          + ("" if ratio is None else f"  verdict {ratio:.3g}×"))
    return [dict(bug=b.name, gate=str(b.gate), verdict=verdict, float64_deviation=dev, float64_over_bound=over,
                 verdict_over_bound=ratio)]


if __name__ == "__main__":
    raise SystemExit(main())
