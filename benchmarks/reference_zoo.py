"""The reference check's false-alarm side (docs/design/tolerance.md, "The reference computes what the runs compute"):
every one-process zoo trainer among the seeds, in each declared precision, its big batch against its float64 run at
step 0 (verify.study.reference_gap, one case of its defaults). The gate refuses a case where C × that gap reaches 1
(unless the gradient's cancellation κ explains it); on an honest trainer it is the precision's rounding, far below.

    python -m benchmarks.reference_zoo [--seeds 0:800] [--out reports/cpu/reference-zoo.json]
"""
from __future__ import annotations

import argparse
import json
import time

import verify
from verify.study import C, reference_gap


def honest(seed: int) -> dict | None:
    """One zoo trainer's gaps per precision (None for a data-parallel one: its runs need a process group)."""
    from benchmarks.zoo.population import one_process

    found = one_process(seed)
    if found is None:
        return None
    adapter, cases = found
    gaps = {p: reference_gap(adapter, case) for p, case in cases.items()}
    return dict(seed=seed, gaps=gaps, false_alarms=[p for p, g in gaps.items() if not C * g < 1.0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.reference_zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0:800", help="START:STOP of the zoo's seeds")
    p.add_argument("--out", default="reports/cpu/reference-zoo.json")
    a = p.parse_args(argv)
    start, stop = map(int, a.seeds.split(":"))
    t0 = time.monotonic()
    rows = [r for r in map(honest, range(start, stop)) if r is not None]
    alarms = [r for r in rows if r["false_alarms"]]
    worst = {}
    for r in rows:
        for prec, g in r["gaps"].items():
            worst[prec] = max(worst.get(prec, 0.0), g)
    doc = dict(verify.report_header("reference-zoo"), command=f"python -m benchmarks.reference_zoo --seeds {a.seeds}",
               trainers=len(rows), false_alarms=len(alarms), refused_at=1.0 / C, worst_gap=worst,
               seconds=round(time.monotonic() - t0, 1), rows=rows)
    verify.atomic_write({a.out: json.dumps(doc, indent=1)})
    print(f"reference check: {len(rows)} one-process zoo trainers, {len(alarms)} false alarms, the largest gap per "
          f"precision {', '.join(f'{k} {v:.3g}' for k, v in worst.items())} (refused at {1.0 / C:g}), "
          f"{doc['seconds']} s -> {a.out}")
    for r in alarms[:5]:
        print(f"  t{r['seed']}: {r['false_alarms']} {r['gaps']}")
    return 1 if alarms else 0


if __name__ == "__main__":
    raise SystemExit(main())
