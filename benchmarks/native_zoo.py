"""The native reference's false-alarm side (issue 44 item 3; docs/design/tolerance.md, "The native reference"):
every one-process zoo trainer without a declared objective among the seeds, declared native fp32 (the tightest: its
bounds at eps32), through the equivalence gate on drawn windows (its own strategy: padded, every declared autocast
precision); and, beside it, the float64 bench's planted equivalence bugs under the same declaration.

    python -m benchmarks.native_zoo [--seeds 0:800] [--examples 12] [--out reports/cpu/native-zoo.json]
"""
from __future__ import annotations

import argparse
import json
import time

import verify
from verify.study import strategy


def native(adapter):
    return adapter.replace(numerics=verify.Numerics(precisions=adapter.precisions, overflow=adapter.overflow,
                                                    native="fp32"))


def honest(seed: int, examples: int) -> dict:
    """One zoo trainer's drawn windows: the largest error / bound, and every rejection (a false alarm) verbatim."""
    from hypothesis import HealthCheck, given, seed as fixed, settings

    from benchmarks.zoo import population
    from benchmarks.zoo.recipe import draw

    adapter = native(getattr(population, f"t{seed}"))
    ratios, alarms = [], []

    @fixed(seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=strategy(verify.Gate.EQUIVALENCE, adapter, 1, 1))
    def one(case):
        try:
            ratios.append(verify.check(verify.Gate.EQUIVALENCE, adapter, case).ratio)
        except verify.GateSkipped:
            pass
        except verify.GateFailure as e:
            alarms.append(str(e).splitlines()[0])

    one()
    r = draw(seed)
    return dict(seed=seed, family=r.family, optimizer=r.optimizer, precisions=list(r.precisions), judged=len(ratios),
                worst=max(ratios, default=0.0), false_alarms=alarms)


def planted() -> list[dict]:
    from planted import registry

    out = []
    for bug in registry.of_gate(verify.Gate.EQUIVALENCE):
        if bug.needs or bug.module.startswith("native"):
            continue
        try:
            r = verify.check(verify.Gate.EQUIVALENCE, native(bug.load()), bug.case)
            verdict, line = "passes", f"error / bound {r.ratio:.3f}"
        except verify.GateFailure as e:
            verdict, line = "rejected", str(e).splitlines()[0][:160]
        except verify.GateSkipped as e:
            verdict, line = "skipped", str(e)
        out.append(dict(bug=bug.name, verdict=verdict, line=line))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:800", help="zoo seeds LO:HI (default 0:800)")
    ap.add_argument("--examples", type=int, default=12, help="drawn windows per trainer (default 12)")
    ap.add_argument("--out", default="reports/cpu/native-zoo.json")
    a = ap.parse_args(argv)
    try:
        lo, hi = (int(v) for v in a.seeds.split(":"))
    except ValueError:
        ap.error(f"--seeds: LO:HI, two integers, got {a.seeds!r}")
    from benchmarks.zoo import population
    from benchmarks.zoo.recipe import draw

    t0 = time.perf_counter()
    seeds = [s for s in range(lo, hi) if draw(s).layout == "single"
             and population.declarations(draw(s)).get("objective") is None]
    rows = []
    for s in seeds:
        rows.append(honest(s, a.examples))
        print(f"t{s}: {rows[-1]['judged']} windows, worst {rows[-1]['worst']:.3f}, false alarms "
              f"{len(rows[-1]['false_alarms'])}", flush=True)
    bench = planted()
    wall = time.perf_counter() - t0
    alarms = [r for r in rows if r["false_alarms"]]
    md = ["# The native reference on honest trainers it was not tuned to, and on the planted bench", "",
          f"`python -m benchmarks.native_zoo --seeds {a.seeds} --examples {a.examples}`; {wall:.0f} s.", "",
          f"**{len(rows)} one-process zoo trainers** (no declared objective) declared `Numerics(native=\"fp32\")`, "
          f"{sum(r['judged'] for r in rows)} drawn windows judged: **{len(alarms)} with a false alarm**; the largest "
          f"error / bound {max((r['worst'] for r in rows), default=0):.3f}.", ""]
    md += [f"- t{r['seed']} ({r['family']}, {r['optimizer']}): {r['false_alarms'][0]}" for r in alarms]
    md += ["", "The float64 bench's planted equivalence bugs, each declared native fp32 on its own case:", "",
           "| planted bug | verdict | message |", "|---|---|---|"]
    md += [f"| `{b['bug']}` | {b['verdict']} | {b['line']} |" for b in bench]
    verify.atomic_write({a.out: json.dumps({**verify.report_header("native-zoo"), "seeds": a.seeds, "examples": a.examples,
                                            "wall_s": round(wall, 1), "trainers": rows, "planted": bench}, indent=1),
                         a.out.removesuffix(".json") + ".md": "\n".join(md) + "\n"})
    print(f"{len(rows)} trainers, {len(alarms)} with a false alarm; wrote {a.out} and its .md")
    return 1 if alarms else 0


if __name__ == "__main__":
    raise SystemExit(main())
