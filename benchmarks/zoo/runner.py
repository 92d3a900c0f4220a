"""Runs zoo trainers through the plugin and the self-test, J jobs at a time, each in its own subprocess and
folder (under --work), and gathers one row per trainer: its choices, each gate's verdict, every failure with its
case and hint, the drawn operator's verdict, the times.

    gates   pytest --pyargs verify --verify-trainer benchmarks.zoo.population:t<S> --verify-report DIR (the profile's
            HYPOTHESIS_PROFILE; dev runs also get --hypothesis-seed S: every draw is reproducible from S)
    kill    python -m benchmarks.zoo kill --seed S (verify.run_selftest with the drawn operator)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REF = "benchmarks.zoo.population:t{seed}"


def env_for(folder: str, profile: str | None, max_world: int | None) -> dict:
    """A subprocess's environment: this checkout importable, one thread, its own caches; the caller's own
    HYPOTHESIS_PROFILE and PYTHONPATH replaced."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYPOTHESIS_PROFILE")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", XDG_CACHE_HOME=os.path.join(folder, "cache"),
               PYTHONDONTWRITEBYTECODE="1")
    if profile:
        env["HYPOTHESIS_PROFILE"] = profile
    if max_world:
        env["XTRAIN_DIST_MAX_WORLD"] = str(max_world)
    return env


def gates_command(seed: int, folder: str, profile: str) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", "-rs",
           "--verify-trainer", REF.format(seed=seed), "--verify-report", folder,
           "--junitxml", os.path.join(folder, "junit.xml")]
    return cmd + ([] if profile == "ci" else ["--hypothesis-seed", str(seed)])


def _run(cmd, folder, env, timeout) -> tuple[int | None, str, float]:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=folder, env=env, timeout=timeout)
        code, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code, out = None, f"timed out after {timeout} s\n{text}"
    with open(os.path.join(folder, "output.txt"), "a") as f:
        f.write("$ " + " ".join(cmd) + "\n" + out + "\n")
    return code, out, time.perf_counter() - t0


def gate_verdicts(report: dict) -> dict:
    """{gate: 'pass' | 'FAIL' | 'skip' | 'not run'} from a verify-report.json."""
    failed = {f.get("gate") for f in report.get("failures", [])}
    out = {}
    for gate, s in (report.get("gates") or {}).items():
        base = gate.split("@")[0]
        out[gate] = ("FAIL" if base in failed else "pass" if s.get("examples") else
                     "skip" if s.get("skipped") else "not run")
    for g in failed - set(out):
        out[g or "?"] = "FAIL"
    return out


def failures(report: dict) -> list[dict]:
    rows = []
    for f in report.get("failures", []):
        first = (f.get("message") or "").strip().splitlines()[0] if f.get("message") else ""
        case = re.search(r"case (N=.*)$", first)
        rows.append(dict(test=(f.get("test") or "").split("::")[-1], gate=f.get("gate"), verdict=first,
                         case=case.group(1) if case else "", hint=f.get("hint")))
    return rows


def run_gates(seed: int, work: str, profile: str, timeout: int, max_world: int | None) -> dict:
    folder = os.path.join(work, f"t{seed}", "gates")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    code, out, seconds = _run(gates_command(seed, folder, profile), folder, env_for(folder, profile, max_world),
                              timeout)
    path = os.path.join(folder, "verify-report.json")
    report = json.load(open(path)) if os.path.exists(path) else {}
    fails = failures(report)
    if code == 0:
        verdict = "passes"
    elif code == 1 and fails and all(f["gate"] for f in fails):
        verdict = "rejected"
    else:  # a usage error, a crash outside a gate, a timeout: no verdict on the trainer
        verdict = "error"
    lines = [ln.strip("= ") for ln in out.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), "")
    why = None
    if verdict == "error":  # the first failure no gate raised (the trainer crashed), else the output's end
        crash = [f["verdict"] for f in fails if not f["gate"]]
        why = crash[0] if crash else " / ".join(lines[-2:])
    return dict(exit_code=code, verdict=verdict, seconds=round(seconds, 1), gates=gate_verdicts(report),
                failures=fails, summary=summary, error_tail=why, folder=folder)


def run_kill(seed: int, work: str, timeout: int, max_world: int | None) -> dict:
    folder = os.path.join(work, f"t{seed}", "kill")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    out_file = os.path.join(folder, "kill.json")
    cmd = [sys.executable, "-m", "benchmarks.zoo", "kill", "--seed", str(seed), "--out", out_file]
    code, out, seconds = _run(cmd, folder, env_for(folder, None, max_world), timeout)
    if code == 0 and os.path.exists(out_file):
        doc = json.load(open(out_file))
    else:
        tail = [ln for ln in out.splitlines() if ln.strip()][-3:]
        doc = dict(seed=seed, operator=None, verdict="error", why="\n".join(tail))
    doc["wall_seconds"] = round(seconds, 1)
    return doc


def commit() -> str | None:
    """This checkout's HEAD, or None (not a git checkout, or uncommitted changes: nothing to resume against)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() if head.returncode == 0 and dirty.returncode == 0 and not dirty.stdout.strip() else None


def _kept(work: str, seed: int, what: str, key: dict) -> dict | None:
    """A finished job's result from an earlier run in the same --work, kept only where it ran at `key` (the same
    commit, profile and world cap); None otherwise."""
    path = os.path.join(work, f"t{seed}", f"{what}.result.json")
    try:
        doc = json.load(open(path))
    except (OSError, ValueError):
        return None
    return doc["result"] if doc.get("key") == key else None


def _keep(work: str, seed: int, what: str, key: dict, result: dict) -> None:
    path = os.path.join(work, f"t{seed}", f"{what}.result.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(key=key, result=result), f)
    os.replace(path + ".tmp", path)


def run_all(seeds, *, work: str, profile: str, jobs: int, timeout: int, kill: bool, max_world: int | None,
            progress=print, resume: bool = False) -> dict:
    """{seed: {'gates': ..., 'kill': ...}}: every job of every seed, `jobs` at a time, a line per finished job.
    Each finished job's result is kept in its folder with the commit it ran at; `resume` reuses those of the same
    commit, profile and world cap (a run stopped part-way goes on where it stopped: 'kept' on its line)."""
    tasks = [(s, "gates") for s in seeds] + ([(s, "kill") for s in seeds] if kill else [])
    results: dict = {s: {} for s in seeds}
    lock, t0, done = threading.Lock(), time.perf_counter(), [0]
    key = dict(commit=commit(), profile=profile, max_world=max_world)

    def one(seed, what):
        kept = _kept(work, seed, what, key) if resume and key["commit"] else None
        if kept is not None:
            return dict(kept, kept=True)
        res = (run_gates(seed, work, profile, timeout, max_world) if what == "gates"
               else run_kill(seed, work, timeout, max_world))
        if key["commit"]:
            _keep(work, seed, what, key, res)
        return res

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, s, w): (s, w) for s, w in tasks}
        for fut in as_completed(futures):
            seed, what = futures[fut]
            try:
                res = fut.result()
            except Exception as e:  # noqa: BLE001  (the runner's own failure: recorded, the others go on)
                res = dict(verdict="error", error_tail=f"{type(e).__name__}: {e}", seconds=0.0)
            with lock:
                results[seed][what] = res
                done[0] += 1
                elapsed = time.perf_counter() - t0
                eta = elapsed / done[0] * (len(tasks) - done[0])
                label = res.get("verdict") if what == "gates" else f"{res.get('operator')} {res.get('verdict')}"
                label += " (kept)" if res.get("kept") else ""
                progress(f"[{done[0]:>{len(str(len(tasks)))}}/{len(tasks)}] t{seed} {what}: {label} "
                         f"({res.get('seconds', res.get('wall_seconds', 0))} s) — elapsed {elapsed:.0f} s, "
                         f"ETA {eta:.0f} s")
    return results
