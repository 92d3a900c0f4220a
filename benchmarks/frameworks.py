"""The historical bugs as a reproducible report: Hugging Face transformers' gradient accumulation on padded
data (a per-micro-batch token mean), the N× gradient and logged grad_norm of 4.46-4.47 (#35207), the next step's
LR logged before 4.51 (#36973), the per-rank token mean under DDP before 4.54 (#39395), the 1/N gradient and
grad_norm of 5.2-5.5.3 (#45305), and a current release (KNOWN below); and TRL's GRPO loss (examples/trl_grpo.py):
0.21's token-level "bnpo", normalised per micro-batch and rank (trl PR #3938), and the current TRL (trl-VERSION rows).

    python -m benchmarks.frameworks [--versions 4.45.2,4.46.3,4.50.0,5.5.3,current,trl-0.21.0,trl-current] [--out reports/frameworks] [--cache DIR]
                                    [--profile dev|ci] [--max-world 2] [--timeout SECONDS]

For each transformers version it builds a virtual environment under the cache (default
~/.cache/xtrain-verify/frameworks; never the repository; reused while its pins match) holding
`torch==2.13.0`, that transformers release, accelerate, pytest, hypothesis and this repository (an
editable install), with no system site-packages: the transformers under test is the only one importable.
Then it runs the HF recipe (examples/hf_trainer.py) through the plugin, from an empty directory:

    pytest --pyargs verify --verify-trainer examples.hf_trainer:factory --verify-report RUN

and, in the same venv, the metrics gate on each metric the recipe declares ALONE, on two fixed cases (one
failing metric hides no other: the plugin's metrics test stops at its first). It writes OUT/frameworks.json
(the common header; per version: the pins, the verdict, each failing gate with its shrunk case, each metric's
verdict, the gates' examples and worst error / bound, times) and OUT/frameworks.md. Exit 0 when every version
meets its expectation (a release with a known bug rejected, the others passing), 1 when one does not, 2 on bad
input. pip's and pytest's output go to CACHE/frameworks.log.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from verify._internal.verdict import Gate
from verify._internal.cli import Parser, UsageError, fail, positive_int, writable_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "examples.hf_trainer:factory"
TRL_RECIPE = "examples.trl_grpo:factory"  # a "trl-X.Y.Z" / "trl-current" row: TRL's GRPO loss, token-level
TORCH = "torch==2.13.0"  # pinned like the README's install: the local CPU wheel, never a multi-GB CUDA build
# accelerate of each release's time for the old ones (their Trainer predates accelerate's later changes)
ACCELERATE = {"4.45.2": "accelerate==1.0.1", "4.46.3": "accelerate==1.1.1", "4.50.0": "accelerate==1.5.2",
              "5.5.3": "accelerate==1.13.0"}
# What the gates see on this recipe's GPT-2 in each range of releases [since, fixed) (measured at the releases the
# report runs and at their neighbours); the metrics gate judges what HF logs (examples/hf_trainer.py).
PER_MICRO = ("each micro-batch's own token mean on padded data: GPT-2 takes no loss kwargs before 4.50 (4.49 not "
             "checked), and the Trainer's fix (#34191 / #34373, 4.46) reaches only a model that takes num_items_in_batch")
NOT_OVER_N = ("the loss of a model without loss kwargs not divided by N before backward: N× the gradient and the "
              "logged grad_norm (#35207, fixed in 4.48)")
NEXT_LR = "the LR logged after the scheduler's step: the next step's (#35942, fixed in 4.51 by #36973)"
PER_RANK = ("under DDP each rank's loss divided by its own valid-target count (average_tokens_across_devices=False "
            "by default; True from 4.54, #39395)")
TWICE_OVER_N = ("accelerate's backward divides the loss by N a second time: the gradient and the logged grad_norm "
                "1/N (#45305, fixed in 5.5.4 by #45349)")
KNOWN = [((0, 0, 0), (4, 50, 0), PER_MICRO), ((4, 46, 0), (4, 48, 0), NOT_OVER_N), ((0, 0, 0), (4, 51, 0), NEXT_LR),
         ((0, 0, 0), (4, 54, 0), PER_RANK), ((5, 2, 0), (5, 5, 4), TWICE_OVER_N)]
LOCAL_BNPO = ("the token-level loss ('bnpo') divided by each micro-batch's own completion tokens on each rank, then by "
              "gradient_accumulation_steps: 'exact only with gas=1 and num GPUs=1' (trl PR #3938, 'dapo' from 0.22)")
KNOWN_TRL = [((0, 0, 0), (0, 22, 0), LOCAL_BNPO)]
# TRL 0.21's own pins of its time (it needs transformers ≥ 4.55); accelerate below 1.16 as the [trl] extra
TRL_PINS = {"0.21.0": ["transformers==4.55.4", "accelerate==1.15.0"]}
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "xtrain-verify", "frameworks")


def expectation(version: str) -> str:
    """'rejected' for a release with a known bug, 'passes' otherwise ('current': the newest)."""
    return "rejected" if known_bugs(version) else "passes"


def known_bugs(version: str) -> list[str]:
    """The known bugs a release has (none for 'current' or 'trl-current')."""
    trl, version = is_trl(version), version.removeprefix("trl-")
    if version == "current":
        return []
    release = tuple(int(x) for x in (version.split(".") + ["0"])[:3])
    return [what for since, fixed, what in (KNOWN_TRL if trl else KNOWN) if since <= release < fixed]


def is_trl(version: str) -> bool:
    return version.startswith("trl-")


def recipe(version: str) -> str:
    return TRL_RECIPE if is_trl(version) else RECIPE


def _version(text: str) -> list[str]:
    out = [v.strip() for v in text.split(",") if v.strip()]
    for v in out:
        if v.removeprefix("trl-") != "current" and not re.fullmatch(r"\d+\.\d+(\.\d+)?", v.removeprefix("trl-")):
            raise UsageError(f"--versions: {v!r} is not a release number (e.g. 4.45.2, trl-0.21.0) or 'current'")
    if not out:
        raise UsageError("--versions: give at least one, e.g. 4.45.2,current")
    return out


def pins(version: str) -> list[str]:
    if is_trl(version):
        release = version.removeprefix("trl-")
        trl = "trl" if release == "current" else f"trl=={release}"
        pinned = TRL_PINS.get(release, ["transformers", "accelerate<1.16"])
        return [TORCH, trl, *pinned, "pytest>=8", "hypothesis>=6.100"]
    tf = "transformers" if version == "current" else f"transformers=={version}"
    return [TORCH, tf, ACCELERATE.get(version, "accelerate"), "pytest>=8", "hypothesis>=6.100"]


def venv(version: str, cache: str, log) -> tuple[str, dict, float]:
    """The venv of one transformers version (built once; rebuilt when its pins change): its python, the
    versions installed, and the seconds spent building it (0 when reused)."""
    where = os.path.join(cache, version if is_trl(version) else f"transformers-{version}")
    py, stamp = os.path.join(where, "bin", "python"), os.path.join(where, "pins.json")
    want = pins(version) + [f"-e {ROOT}"]
    t0 = time.perf_counter()
    if not (os.path.exists(py) and os.path.exists(stamp) and json.load(open(stamp)).get("pins") == want):
        shutil.rmtree(where, ignore_errors=True)
        _run([sys.executable, "-m", "venv", where], log)  # no --system-site-packages: only this transformers
        _run([py, "-m", "pip", "install", "-q", *pins(version), "-e", ROOT], log)
        installed = json.loads(_run([py, "-c", _TRL_VERSIONS if is_trl(version) else _VERSIONS], log))
        with open(stamp, "w") as f:
            json.dump(dict(pins=want, installed=installed), f)
    return py, json.load(open(stamp))["installed"], time.perf_counter() - t0


_VERSIONS = ("import json, torch, transformers, accelerate, hypothesis; print(json.dumps({m.__name__: m.__version__ "
             "for m in (torch, transformers, accelerate, hypothesis)}))")
_TRL_VERSIONS = _VERSIONS.replace("import json,", "import json, trl,").replace("(torch,", "(torch, trl,")


def _run(cmd, log, **kw) -> str:
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    log.write(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {r.returncode}: {(r.stderr or r.stdout).strip()[-500:]}")
    return r.stdout


def run_gates(py: str, run_dir: str, *, profile: str, max_world: int, timeout: int, log, trainer=RECIPE) -> dict:
    """The plugin on `trainer` (the HF recipe) from an empty directory; its report, exit status and time."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYPOTHESIS_PROFILE")}
    env.update(PYTHONPATH=ROOT, HYPOTHESIS_PROFILE=profile, XTRAIN_DIST_MAX_WORLD=str(max_world),
               OMP_NUM_THREADS="1")
    cmd = [py, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", "-rs",
           "--verify-trainer", trainer, "--verify-report", run_dir, "--junitxml", os.path.join(run_dir, "junit.xml")]
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
    report = json.load(open(path)) if os.path.exists(path) else {}
    return dict(exit_code=code, seconds=round(seconds, 1), report=report, summary=_summary_line(out),
                test_seconds=_test_seconds(os.path.join(run_dir, "junit.xml")))


PROBE_CASES = (dict(accum_steps=2, micro_batch=2, steps=2, seed=1, data_seed=2),
               dict(accum_steps=3, micro_batch=1, steps=2, seed=1, data_seed=3))


def probe_metrics() -> None:
    """Run inside a version's venv: each metric the recipe declares judged alone by the metrics gate on
    PROBE_CASES (unpadded, clipping active); prints one JSON line {metric: 'passes' | the first verdict}."""
    import dataclasses
    import importlib

    from verify._internal.cases.case import Case
    from verify._internal.gates.metrics import check_metrics
    from verify._internal.verdict import GateFailure

    module, name = RECIPE.split(":")
    adapter = getattr(importlib.import_module(module), name)
    out = {}
    for metric in adapter.metrics.names:
        alone = dataclasses.replace(adapter, metrics=dataclasses.replace(adapter.metrics, names=(metric,)))
        out[metric] = "passes"
        for fields in PROBE_CASES:
            try:
                check_metrics(alone, Case(**fields))
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


def explain(f: dict, known=(PER_MICRO,)) -> str | None:
    """What a failure of this recipe means, where its verdict shows a known class (None otherwise); `known`: the
    release's known bugs (known_bugs)."""
    text = f["verdict"]
    loss_gates = (Gate.EQUIVALENCE, Gate.NORMALISER, Gate.SPLIT_INVARIANCE, Gate.DP_EQUIVALENCE)
    if PER_MICRO in known and "nan" in text.lower() and f["gate"] in loss_gates:
        return ("a micro-batch without a valid target gives 0/0 = NaN where the window's token mean is defined: the "
                "loss is a mean per micro-batch, not over the window's valid targets")
    if LOCAL_BNPO in known and f["gate"] in loss_gates:
        return ("TRL 0.21's 'bnpo' divides each micro-batch's token sum by that micro-batch's own completion tokens "
                "(and each rank by its own), then by gradient_accumulation_steps: the window's loss is off by a factor "
                "that depends on how TRL's shuffle spreads the tokens over the micro-steps (and ranks); the normaliser "
                "gate names the class: at one row per micro-batch the loss is the mean of the micro-batches' own token "
                "means")
    if PER_RANK in known and " W=" in text and f["gate"] in loss_gates:
        return ("each rank divides by its own valid-target count (a rank without one: 0/0 = NaN), not the window's "
                "over every rank: average_tokens_across_devices is off by default before 4.54")
    if f["gate"] == Gate.REPORTED_METRICS:
        return explain_metric(text)
    ops = re.findall(r"\w+:(\w+) \w+ \[", text)
    if f["gate"] == Gate.BOUNDARY_ONLY and ops and all("broadcast" in op for op in ops):
        return ("broadcasts only, no gradient: DDP (broadcast_buffers=True) sends the model's buffers from rank 0 on "
                "every forward, no_sync() or not — real per-micro-step traffic (this GPT-2 keeps its causal mask, "
                "bool positions², and masked_bias as buffers), not the accumulation bug")
    return None


def explain_metric(text: str) -> str | None:
    """What a metrics verdict of this recipe means, where it shows a known bug (None otherwise)."""
    if re.search(r"\blr reported ", text) and "(= the LR after the scheduler's step" in text:
        return ("HF logged the LR after stepping its scheduler: the next step's, not the one applied (#35942; "
                "fixed in 4.51 by #36973)")
    if re.search(r"\bgrad_norm reported ", text) and "= 1/N (micro-steps)" in text:
        return ("1/N of the big batch's: in 5.2-5.5.3 the Trainer hands accelerate N steps of accumulation, whose "
                "backward divides the already normalised loss by N again: the gradient itself is 1/N (#45305, fixed "
                "in 5.5.4 by #45349)")
    if re.search(r"\bgrad_norm reported ", text) and "= N (micro-steps)" in text:
        return ("N× the big batch's: in 4.46-4.47 the loss of a model without loss kwargs (GPT-2's) is not divided "
                "by gradient_accumulation_steps before backward, so the gradient itself is N× (#35207, fixed in 4.48)")
    return None


def _range(since, fixed) -> str:
    upto = ".".join(map(str, fixed))
    return f"before {upto}" if since == (0, 0, 0) else f"from {'.'.join(map(str, since))} to before {upto}"


def render_md(doc: dict) -> str:
    out = ["# transformers' and TRL's gradient accumulation and logged metrics, through the gates", "",
           f"`{doc['command']}` — commit {doc.get('git_commit') or '(outside a git repository)'}, {doc.get('utc', '')}", "",
           "Known bugs: " + "; ".join(f"{_range(since, fixed)}, {what}" for since, fixed, what in KNOWN) + ". TRL: "
           + "; ".join(f"{_range(since, fixed)}, {what}" for since, fixed, what in KNOWN_TRL) + ".", "",
           "| release | recipe | transformers | accelerate | expected | verdict | gates (s) | venv build (s) |",
           "|---|---|---|---|---|---|---|---|"]
    for v in doc["versions"]:
        i = v["installed"]
        ok = "✓" if v["meets_expectation"] else "✗ (not as expected)"
        out.append(f"| {label(v)} | {v.get('recipe', RECIPE)} | {i.get('transformers', v['version'])} | "
                   f"{i.get('accelerate', '?')} | {v['expected']} | {v['verdict']} {ok} | {v['seconds']} | "
                   f"{v['venv_seconds']} |")
    for v in doc["versions"]:
        out += ["", f"## {label(v)}: {v['verdict']}", "", f"pytest: {v['summary'] or '(no summary)'}"]
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
    """'transformers 4.45.2' or 'TRL 0.21.0' (a row of the report)."""
    name = "trl" if is_trl(v["version"]) else "transformers"
    return f"{'TRL' if name == 'trl' else name} {v['installed'].get(name, v['version'])}"


def _ratio(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def main(argv=None) -> int:
    p = Parser(prog="benchmarks.frameworks", description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", default="4.45.2,4.46.3,4.50.0,5.5.3,current,trl-0.21.0,trl-current",
                   help="comma-separated transformers releases, or 'current' (newest); TRL's as trl-0.21.0, trl-current")
    p.add_argument("--out", default=os.path.join("reports", "frameworks"))
    p.add_argument("--cache", default=CACHE, help="where the venvs live (never the repository)")
    p.add_argument("--profile", choices=("dev", "ci"), default="dev", help="hypothesis profile of the gate runs")
    p.add_argument("--max-world", type=positive_int, default=2)
    p.add_argument("--timeout", type=positive_int, default=1800, help="seconds per gate run")
    a = p.parse_args(argv)
    try:
        versions = _version(a.versions)
        if os.path.commonpath([os.path.abspath(a.cache), ROOT]) == ROOT:
            raise UsageError(f"--cache {a.cache}: inside the repository; venvs go under a cache directory")
        writable_dir("--out", a.out)
        writable_dir("--cache", a.cache)
    except UsageError as e:
        fail(str(e))
    from verify._internal.header import atomic_write_all
    from verify import report_header

    os.makedirs(a.out, exist_ok=True)
    rows = []
    with open(os.path.join(a.cache, "frameworks.log"), "w") as log:
        for version in versions:
            print(f"{version}: venv ...", flush=True)
            try:
                py, installed, built = venv(version, a.cache, log)
            except RuntimeError as e:
                fail(f"{version}: could not build its venv: {e}", 1)
            name = label(dict(version=version, installed=installed))
            print(f"{name}: gates ({a.profile} profile) ...", flush=True)
            run = run_gates(py, os.path.join(a.cache, f"run-{version}"), profile=a.profile, max_world=a.max_world,
                            timeout=a.timeout, log=log, trainer=recipe(version))
            metrics = {} if is_trl(version) else run_probe(py, log)  # the TRL recipe declares no metrics
            v, want = verdict(run), expectation(version)
            rows.append(dict(version=version, recipe=recipe(version), installed=installed, expected=want, verdict=v, meets_expectation=v == want,
                             known=known_bugs(version), metrics=metrics,
                             exit_code=run["exit_code"], seconds=run["seconds"], venv_seconds=round(built, 1),
                             summary=run["summary"], failures=failure_rows(run["report"], run.get("test_seconds")),
                             gates=run["report"].get("gates"), settings=run["report"].get("settings")))
            print(f"{name}: {v} (expected {want}) in {run['seconds']} s", flush=True)
    doc = dict(report_header("frameworks"), recipe=RECIPE, profile=a.profile, max_world=a.max_world,
               command="python -m benchmarks.frameworks " + " ".join(argv if argv is not None else sys.argv[1:]),
               versions=rows)
    atomic_write_all({os.path.join(a.out, "frameworks.json"): json.dumps(doc, indent=1, default=str),
                      os.path.join(a.out, "frameworks.md"): render_md(doc)})
    print(f"wrote {os.path.join(a.out, 'frameworks.json')} and frameworks.md")
    return 0 if all(r["meets_expectation"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
