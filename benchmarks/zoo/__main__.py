"""python -m benchmarks.zoo --seed S
python -m benchmarks.zoo run [--count 200] [--start 0 | --seeds 3,17,...] [--profile ci] [--jobs J] [--out reports/zoo]
                             [--work DIR] [--timeout SECONDS] [--no-kill] [--max-world W] [--resume]
python -m benchmarks.zoo kill --seed S [--out FILE]

--seed: one trainer's choices, declarations and the commands that run it. run: seeds start..start+count-1 (or
--seeds) through the plugin under the profile and, unless --no-kill, each with its drawn operator through the
self-test; J jobs at a time (a data-parallel gate also starts up to XTRAIN_DIST_MAX_WORLD rank processes: size J
for that); each job's files under --work (default: a fresh folder in the temp dir); reports/zoo/zoo.{json,md}
written once at the end. --resume (with the same --work): a job that finished at this commit, profile and world cap
in an earlier run is kept, not run again. Exit 0 when no honest trainer was rejected and every drawn operator was killed, 1 when
not, 3 when some job erred (no verdict), 2 on bad input. kill: the subprocess the runner starts per trainer.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time


def _seeds(text: str) -> list[int]:
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds must be integers separated by commas, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"--seeds needs at least one seed ≥ 0, got {text!r}")
    return out


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer ≥ 1, got {text!r}")
    return v


def show(seed: int) -> int:
    from benchmarks.zoo.population import declarations, objective_of
    from benchmarks.zoo.recipe import draw

    r = draw(seed)
    print(f"t{seed}: {r.short()}")
    for k, v in r.as_dict().items():
        print(f"  {k:14} {v}")
    decl = declarations(r)
    print("declares: " + ", ".join(f"{k}={getattr(v, '__name__', v)!r}" if k != "objective" else
                                   f"objective={objective_of(r).declared()}" for k, v in decl.items() if k != "data")
          + f", data=verify.data.{r.data}(...)")
    ref = f"benchmarks.zoo.population:t{seed}"
    print(f"gates:     HYPOTHESIS_PROFILE=ci pytest --pyargs verify --verify-trainer {ref}\n"
          f"self-test: python -m verify.selftest --verify-trainer {ref}\n"
          f"operator:  python -m benchmarks.zoo kill --seed {seed}")
    return 0


def run(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zoo run")
    p.add_argument("--count", type=_positive, default=200)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--seeds", type=_seeds, default=None)
    p.add_argument("--profile", choices=("dev", "ci"), default="ci")
    p.add_argument("--jobs", type=_positive, default=max(1, (os.cpu_count() or 2) // 4))
    p.add_argument("--out", default=os.path.join("reports", "zoo"))
    p.add_argument("--work", default=None)
    p.add_argument("--timeout", type=_positive, default=3600)
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--max-world", type=_positive, default=None)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    if a.start < 0:
        p.error(f"--start must be ≥ 0, got {a.start}")
    seeds = a.seeds if a.seeds is not None else list(range(a.start, a.start + a.count))
    work = a.work or tempfile.mkdtemp(prefix="zoo-")
    from benchmarks.zoo import report, runner

    command = "python -m benchmarks.zoo run " + shlex.join(
        (["--seeds", ",".join(map(str, seeds))] if a.seeds is not None else ["--count", str(a.count), "--start", str(a.start)])
        + ["--profile", a.profile, "--jobs", str(a.jobs)] + (["--no-kill"] if a.no_kill else [])
        + (["--max-world", str(a.max_world)] if a.max_world else []))
    print(f"zoo: {len(seeds)} trainers, profile {a.profile}, {a.jobs} jobs; files under {work}", flush=True)
    t0 = time.perf_counter()
    results = runner.run_all(seeds, work=work, profile=a.profile, jobs=a.jobs, timeout=a.timeout,
                             kill=not a.no_kill, max_world=a.max_world, progress=lambda s: print(s, flush=True),
                             resume=a.resume)
    doc = report.document(results, command=command, profile=a.profile, jobs=a.jobs, wall=time.perf_counter() - t0,
                          max_world=a.max_world)
    paths = report.write(doc, a.out)
    s = doc["summary"]
    print(f"false alarms {len(s['false_alarms'])}/{s['judged']} {s['false_alarms'] or ''}; killed "
          f"{s['killed']}/{s['kill_judged']}; survived {s['survived'] or 0}; errors: gates {s['gate_errors'] or 0}, "
          f"kill {s['kill_errors'] or 0}\nwrote {', '.join(paths)}")
    if s["gate_errors"] or s["kill_errors"]:
        return 3
    return 1 if s["false_alarms"] or s["survived"] else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return run(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.zoo", description=__doc__.split("\n\n")[1])
    p.add_argument("command", nargs="?", choices=("kill",))
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.seed < 0:
        p.error(f"--seed must be ≥ 0, got {a.seed}")
    if a.command == "kill":
        from benchmarks.zoo import kill

        return kill.main(a.seed, a.out)
    return show(a.seed)


if __name__ == "__main__":
    sys.exit(main())
