"""The start check's false-alarm side (docs/design/tolerance.md, "The reference starts where the runs start"): every
one-process zoo trainer among the seeds, built as the equivalence gate builds the runs it compares (the float32 big
batch, float64 at N and at 1, from its defaults, in each declared precision), their starts compared by same_start.
A rejection here is a false alarm: the zoo's trainers draw in float32 and cast (or say otherwise in their recipe).

    python -m benchmarks.start_zoo [--seeds 0:800] [--out reports/cpu/start-zoo.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import verify
from verify.study import AUTOCAST, same_start, start_print


def honest(seed: int) -> dict | None:
    """One zoo trainer's verdicts (None for a data-parallel one: its runs need a process group)."""
    from benchmarks.zoo.population import one_process

    found = one_process(seed)
    if found is None:
        return None
    adapter, cases = found
    alarms = []
    for precision, case in cases.items():
        def start(n, dtype):
            return start_print(adapter(case.spec(accum_steps=n, dtype=dtype, adapter=adapter)).params())

        big = start(1, torch.float32)
        for n in (1, 3):
            why = same_start(big, start(n, torch.float64), f"N={n}", AUTOCAST.get(precision))
            if why:
                alarms.append(f"{precision}: {why}")
    return dict(seed=seed, precisions=list(adapter.precisions), false_alarms=alarms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.start_zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0:800", help="START:STOP of the zoo's seeds")
    p.add_argument("--out", default="reports/cpu/start-zoo.json")
    a = p.parse_args(argv)
    start, stop = map(int, a.seeds.split(":"))
    t0, rows = time.monotonic(), []
    for seed in range(start, stop):
        r = honest(seed)
        if r is not None:
            rows.append(r)
    alarms = [r for r in rows if r["false_alarms"]]
    doc = dict(verify.report_header("start-zoo"), command=f"python -m benchmarks.start_zoo --seeds {a.seeds}",
               trainers=len(rows), false_alarms=len(alarms), seconds=round(time.monotonic() - t0, 1), rows=rows)
    verify.atomic_write({a.out: json.dumps(doc, indent=1)})
    print(f"start check: {len(rows)} one-process zoo trainers, {len(alarms)} false alarms, {doc['seconds']} s -> {a.out}")
    for r in alarms[:5]:
        print(f"  t{r['seed']}: {r['false_alarms'][0]}")
    return 1 if alarms else 0


if __name__ == "__main__":
    raise SystemExit(main())
