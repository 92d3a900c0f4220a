"""The release matrix: the recipes of each stack (transformers, TRL, DeepSpeed, Accelerate, Lightning, NeMo Automodel,
ms-swift, verl, torchtitan) on a few releases each, every release a known accumulation bug was reported on among
them (benchmarks/stacks.py says which, and what each bug's verdict means). One row per (release, recipe): passes,
or rejected with each failing gate and its shrunk (minimal) case, with the time.

    python -m benchmarks.frameworks [--versions 4.45.2,...,trl-0.21.0,deepspeed-0.18.8,...] [--out reports/frameworks]
                                    [--cache DIR] [--profile dev|ci] [--max-world 2] [--timeout SECONDS]

A version token is STACK-RELEASE or a bare transformers release; RELEASE 'current' is the newest. Each release gets
a virtual environment under the cache (default ~/.cache/xtrain-verify/frameworks; never the repository; reused while
its pins match) built from the package index: `torch==2.13.0`, that release and the pins of its time, pytest,
hypothesis and this repository (editable), no system site-packages. Then each recipe runs through the plugin from an
empty directory:

    pytest --pyargs verify --verify-trainer RECIPE --verify-report RUN

and, for the HF recipe, the metrics gate on each metric it declares ALONE on two fixed cases (one failing metric
hides no other). A row expected to pass that passes also runs the self-test (`python -m verify.selftest`, worlds up
to --max-world): it meets its expectation only if every operator whose bug can exist is killed. A release pip cannot install here is one row that says so. It writes OUT/frameworks.json (the
common header; per row: the pins, the verdict, each failing gate with its shrunk case, each metric's verdict, the
gates' examples and worst error / bound, times) and OUT/frameworks.md. Exit 0 when every row that ran meets its
expectation (a release with a known bug rejected, the others passing), 1 when one does not, 2 on bad input. pip's
and pytest's output go to CACHE/frameworks.log.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from benchmarks.stacks import HF as RECIPE, STACKS, explain, explain_metric, known_text, parse
from _xtrain_cli import Parser, UsageError, fail, positive_int, writable_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "xtrain-verify", "frameworks")
DEFAULT = ("4.45.2,4.46.3,4.50.0,5.5.3,5.9.0,current,trl-0.21.0,trl-current,deepspeed-0.18.8,deepspeed-0.19.5,"
           "deepspeed-current,accelerate-1.0.1,accelerate-current,lightning-2.4.0,lightning-current,"
           "nemo_automodel-0.6.0,nemo_automodel-current,swift-4.5.3,swift-current,verl-0.7.1,torchtitan-current")


def _versions(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    if not out:
        raise UsageError("--versions: give at least one, e.g. 4.45.2,current")
    for v in out:
        try:
            parse(v)
        except ValueError as e:
            raise UsageError(f"--versions: {e}") from None
    return out


def venv(version: str, cache: str, log) -> tuple[str, dict, float]:
    """The venv of one release (built once; rebuilt when its pins change): its python, the versions installed of
    the stack's shown distributions and torch, and the seconds spent building it (0 when reused)."""
    stack, release = parse(version)
    where = os.path.join(cache, version if stack.key else f"transformers-{version}")
    py, stamp = os.path.join(where, "bin", "python"), os.path.join(where, "pins.json")
    own = [p for p in stack.pins(release) if stack.no_deps and re.split(r"[=<>]", p)[0] == stack.package]
    want = stack.pins(release) + [f"-e {ROOT}"] + (["--no-deps"] if own else [])
    t0 = time.perf_counter()
    if not (os.path.exists(py) and os.path.exists(stamp) and json.load(open(stamp)).get("pins") == want):
        shutil.rmtree(where, ignore_errors=True)
        _run([sys.executable, "-m", "venv", where], log)  # no --system-site-packages: only this release
        _run([py, "-m", "pip", "install", "-q", *[p for p in stack.pins(release) if p not in own], "-e", ROOT], log)
        if own:  # the release itself, without its dependencies (Stack.no_deps)
            _run([py, "-m", "pip", "install", "-q", "--no-deps", *own], log)
        # a shown distribution a release's pins leave out (TRL beside transformers 4.45, for its SFT recipe) is absent
        probe = ("import json, importlib.metadata as m\nout = {}\nfor d in " + repr(['torch', *stack.shown]) + ":\n"
                 "    try: out[d] = m.version(d)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
        installed = json.loads(_run([py, "-c", probe], log))
        with open(stamp, "w") as f:
            json.dump(dict(pins=want, installed=installed), f)
    return py, json.load(open(stamp))["installed"], time.perf_counter() - t0


def _run(cmd, log, **kw) -> str:
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    log.write(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {r.returncode}: {(r.stderr or r.stdout).strip()[-500:]}")
    return r.stdout


def _launch(cmd: list, run_dir: str, env: dict, timeout: int, log) -> tuple:
    """(exit code or None on a time-out, stdout + stderr, seconds, the run's verify-report.json or {}) of one
    subprocess in `run_dir`, this checkout importable, one thread; its output to the log."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYPOTHESIS_PROFILE")},
           "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env}
    log.write("$ " + " ".join(cmd) + "\n")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=run_dir, env=env, timeout=timeout)
        code, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        code, out = None, f"timed out after {timeout} s\n{e.stdout or ''}"
    seconds = time.perf_counter() - t0
    log.write(out if isinstance(out, str) else out.decode(errors="replace"))
    path = os.path.join(run_dir, "verify-report.json")
    return code, out, round(seconds, 1), json.load(open(path)) if os.path.exists(path) else {}


def run_gates(py: str, run_dir: str, *, profile: str, max_world: int, timeout: int, log, trainer=RECIPE) -> dict:
    """The plugin on `trainer` (the HF recipe) from an empty directory; its report, exit status and time."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = [py, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", "-rs",
           "--verify-trainer", trainer, "--verify-report", run_dir, "--junitxml", os.path.join(run_dir, "junit.xml")]
    code, out, seconds, report = _launch(cmd, run_dir, dict(HYPOTHESIS_PROFILE=profile,
                                                            XTRAIN_DIST_MAX_WORLD=str(max_world)), timeout, log)
    return dict(exit_code=code, seconds=seconds, report=report, summary=_summary_line(out),
                test_seconds=_test_seconds(os.path.join(run_dir, "junit.xml")))


def run_selftest(py: str, run_dir: str, *, max_world: int, timeout: int, log, trainer: str) -> dict:
    """`python -m verify.selftest` on a recipe that passes its gates (worlds up to max_world): the mutation score,
    whether every operator whose bug can exist was killed while the unwrapped trainer passed, and the time. The
    framework recipes' self-tests live here, on each release, not in CI (docs/performance.md)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = [py, "-m", "verify.selftest", "--verify-trainer", trainer, "--verify-report", run_dir,
           "--max-world", str(max_world)]
    code, _, seconds, report = _launch(cmd, run_dir, {}, timeout, log)
    st = report.get("selftest") or {}
    return dict(exit_code=code, ok=code == 0 and bool(st.get("ok")), score=st.get("score"), seconds=seconds)


PROBE_CASES = (dict(accum_steps=2, micro_batch=2, steps=2, seed=1, data_seed=2),
               dict(accum_steps=3, micro_batch=1, steps=2, seed=1, data_seed=3))


def probe_metrics() -> None:
    """Run inside a version's venv: each metric the recipe declares judged alone by the metrics gate on
    PROBE_CASES (unpadded, clipping active); prints one JSON line {metric: 'passes' | the first verdict}."""
    import dataclasses
    import importlib

    from verify import Case, Gate, GateFailure, check

    module, name = RECIPE.split(":")
    adapter = getattr(importlib.import_module(module), name)
    out = {}
    for metric in adapter.metrics.names:
        alone = dataclasses.replace(adapter, metrics=dataclasses.replace(adapter.metrics, names=(metric,)))
        out[metric] = "passes"
        for fields in PROBE_CASES:
            try:
                check(Gate.REPORTED_METRICS, alone, Case(**fields))
            except GateFailure as e:
                out[metric] = str(e).splitlines()[0]
                break
    print(json.dumps(out))


def run_probe(py: str, log) -> dict:
    """probe_metrics in the venv of `py`: {metric: verdict}, or {'error': why}."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYPOTHESIS_PROFILE")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    try:
        out = _run([py, "-c", "from benchmarks.frameworks import probe_metrics; probe_metrics()"], log, cwd=ROOT, env=env)
        return json.loads(out.strip().splitlines()[-1])
    except (RuntimeError, ValueError, IndexError) as e:
        return {"error": str(e)[-300:]}


def _test_seconds(path: str) -> dict[str, float]:
    """Each gate test's own time (pytest's junit xml): for a failing one, the time to its shrunk verdict."""
    if not os.path.exists(path):
        return {}
    import xml.etree.ElementTree as ET

    return {t.get("name"): round(float(t.get("time", 0)), 1) for t in ET.parse(path).iter("testcase")}


def _summary_line(out) -> str:
    text = out if isinstance(out, str) else out.decode(errors="replace")
    lines = [ln.strip("= ") for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    return lines[-1] if lines else ""


def verdict(run: dict) -> str:
    if run["exit_code"] == 0:
        return "passes"
    if run["exit_code"] == 1 and run["report"].get("failures"):
        return "rejected"
    return "error"  # usage error, internal error, timeout: no verdict on the trainer


def failure_rows(report: dict, seconds: dict | None = None) -> list[dict]:
    """Each failing gate test: its gate (the report's `gate`, from GateFailure.gate: never read from the text),
    the one-line verdict (it names the shrunk case), the hint and the test's time to that verdict (drawing,
    failing, shrinking)."""
    rows = []
    for f in report.get("failures", []):
        first = f["message"].strip().splitlines()[0] if f.get("message") else ""
        case = re.search(r"case (N=.*)$", first)
        test = f.get("test", "").split("::")[-1]
        rows.append(dict(test=test, seconds=(seconds or {}).get(test), gate=f.get("gate") or "?",
                         case=case.group(1) if case else "", verdict=first, hint=f.get("hint")))
    return rows


def render_md(doc: dict) -> str:
    out = ["# The release matrix: each stack's accumulation and logged metrics, through the gates", "",
           f"`{doc['command']}` — commit {doc.get('git_commit') or '(outside a git repository)'}, {doc.get('utc', '')}", "",
           "Known bugs (benchmarks/stacks.py): " + " ".join(known_text()), "",
           "| release | recipe | installed | expected | verdict | self-test | gates (s) | venv build (s) |",
           "|---|---|---|---|---|---|---|---|"]
    for v in doc["versions"]:
        ok = {True: "✓", False: "✗ (not as expected)", None: ""}[v["meets_expectation"]]
        shown = ", ".join(f"{k} {x}" for k, x in v["installed"].items() if k != "torch") or v.get("error", "")
        st = v.get("selftest")
        selftest = "—" if not st else f"{st['score']} {'✓' if st['ok'] else '✗'} ({st['seconds']} s)"
        out.append(f"| {label(v)} | {v['recipe']} | {shown} | {v['expected']} | {v['verdict']} {ok} | {selftest} | "
                   f"{v['seconds']} | {v['venv_seconds']} |")
    for v in doc["versions"]:
        out += ["", f"## {label(v)}, {v['recipe']}: {v['verdict']}", ""]
        if v.get("error"):
            out += [f"Not installable here: `{v['error']}`"]
            continue
        out += [f"pytest: {v['summary'] or '(no summary)'}"]
        if v.get("known"):
            out += ["", "Known bugs of this release: " + "; ".join(v["known"]) + "."]
        if v["failures"]:
            out += ["", "| gate | test | minimal case | seconds to the shrunk verdict |", "|---|---|---|---|"]
            out += [f"| {f['gate']} | {f['test']} | `{f['case']}` | {f.get('seconds') or '?'} |" for f in v["failures"]]
            out += ["", "Verdicts:", ""] + [f"- `{f['verdict']}`" + (f" — hint: {f['hint']}" if f["hint"] else "")
                                            + (f"\n  - what it shows: {explain(f, v.get('known', ()))}"
                                               if explain(f, v.get("known", ())) else "")
                                            for f in v["failures"]]
        if v.get("metrics"):
            out += ["", "Each declared metric judged alone by the metrics gate (" +
                    ", ".join(f"N={c['accum_steps']} B={c['micro_batch']} K={c['steps']}" for c in PROBE_CASES) +
                    "; clipping active):", "", "| metric | verdict |", "|---|---|"]
            for name, text in v["metrics"].items():
                why = explain_metric(text)
                out.append(f"| {name} | `{text}`" + (f" — {why}" if why else "") + " |")
        gates = {k: g for k, g in (v.get("gates") or {}).items() if g.get("examples")}
        if gates:
            out += ["", "| gate | examples | worst error / bound |", "|---|---|---|"]
            out += [f"| {k} | {g['examples']} | {_ratio(g.get('worst_ratio'))} |" for k, g in gates.items()]
    return "\n".join(out) + "\n"


def label(v: dict) -> str:
    """'transformers 4.45.2', 'TRL 0.21.0', 'DeepSpeed 0.19.8' (a row of the report)."""
    stack, release = parse(v["version"])
    return f"{stack.title} {v['installed'].get(stack.package, release)}"


def _ratio(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def main(argv=None) -> int:
    p = Parser(prog="benchmarks.frameworks", description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", default=DEFAULT,
                   help="comma-separated STACK-RELEASE tokens (trl-0.21.0, deepspeed-current) or bare transformers "
                        "releases; 'current' is the newest")
    p.add_argument("--out", default=os.path.join("reports", "frameworks"))
    p.add_argument("--cache", default=CACHE, help="where the venvs live (never the repository)")
    p.add_argument("--profile", choices=("dev", "ci"), default="dev", help="hypothesis profile of the gate runs")
    p.add_argument("--max-world", type=positive_int, default=2)
    p.add_argument("--timeout", type=positive_int, default=1800, help="seconds per gate run")
    a = p.parse_args(argv)
    try:
        versions = _versions(a.versions)
        if os.path.commonpath([os.path.abspath(a.cache), ROOT]) == ROOT:
            raise UsageError(f"--cache {a.cache}: inside the repository; venvs go under a cache directory")
        writable_dir("--out", a.out)
        writable_dir("--cache", a.cache)
    except UsageError as e:
        fail(str(e))
    from verify import atomic_write
    from verify import report_header

    os.makedirs(a.out, exist_ok=True)
    rows = []
    with open(os.path.join(a.cache, "frameworks.log"), "w") as log:
        for version in versions:
            stack, release = parse(version)
            print(f"{version}: venv ...", flush=True)
            try:
                py, installed, built = venv(version, a.cache, log)
            except RuntimeError as e:  # one row that says so; the other releases still run
                rows.append(dict(version=version, recipe="—", installed={}, expected="—", verdict="not installed",
                                 meets_expectation=None, error=str(e).splitlines()[-1][-300:], seconds=0,
                                 venv_seconds=0, failures=[]))
                print(f"{version}: not installed ({rows[-1]['error']})", flush=True)
                continue
            for trainer, known in stack.rows(release):
                name = f"{label(dict(version=version, installed=installed))} {trainer}"
                print(f"{name}: gates ({a.profile} profile) ...", flush=True)
                tag = trainer.replace(":", "-").replace(".", "_")
                run = run_gates(py, os.path.join(a.cache, f"run-{version}-{tag}"), profile=a.profile,
                                max_world=a.max_world, timeout=a.timeout, log=log, trainer=trainer)
                metrics = run_probe(py, log) if stack.probe_metrics and trainer == RECIPE else {}
                v, want = verdict(run), "rejected" if known else "passes"
                st = run_selftest(py, os.path.join(a.cache, f"selftest-{version}-{tag}"), max_world=a.max_world,
                                  timeout=a.timeout, log=log, trainer=trainer) if v == want == "passes" else None
                rows.append(dict(version=version, recipe=trainer, installed=installed, expected=want, verdict=v,
                                 meets_expectation=v == want and (st is None or st["ok"]), known=known,
                                 metrics=metrics, selftest=st,
                                 exit_code=run["exit_code"], seconds=run["seconds"], venv_seconds=round(built, 1),
                                 summary=run["summary"], failures=failure_rows(run["report"], run.get("test_seconds")),
                                 gates=run["report"].get("gates"), settings=run["report"].get("settings")))
                built = 0.0  # the venv's build counts once, on its first row
                print(f"{name}: {v} (expected {want}) in {run['seconds']} s"
                      + (f"; self-test {st['score']} {'ok' if st['ok'] else 'NOT OK'} in {st['seconds']} s" if st else ""),
                      flush=True)
    doc = dict(report_header("frameworks"), profile=a.profile, max_world=a.max_world,
               command="python -m benchmarks.frameworks " + " ".join(argv if argv is not None else sys.argv[1:]),
               versions=rows)
    atomic_write({os.path.join(a.out, "frameworks.json"): json.dumps(doc, indent=1, default=str),
                      os.path.join(a.out, "frameworks.md"): render_md(doc)})
    print(f"wrote {os.path.join(a.out, 'frameworks.json')} and frameworks.md")
    return 0 if all(r["meets_expectation"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
