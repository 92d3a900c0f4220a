"""reports/zoo/zoo.{json,md}: the report header (verify.report_header()), the command that regenerates it, the
false-alarm rate (an honest trainer some gate rejected), the kill rate (the drawn operator rejected), and one row
per trainer: its seed, choices, each gate's verdict, failures with their case and hint, the operator, the times.
Both files are written once, at the end, atomically.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from collections import Counter

import verify
from benchmarks.zoo.recipe import draw

KILLED, SURVIVED = "killed", "SURVIVED"


def summary(rows: list[dict]) -> dict:
    gates = [r["gates"] for r in rows if "gates" in r]
    ran = [g for g in gates if g["verdict"] in ("passes", "rejected")]
    alarms = [r["seed"] for r in rows if r.get("gates", {}).get("verdict") == "rejected"]
    errors = [r["seed"] for r in rows if r.get("gates", {}).get("verdict") == "error"]
    kills = [r["kill"] for r in rows if "kill" in r]
    judged = [k for k in kills if k["verdict"] in (KILLED, SURVIVED)]
    killed = [k for k in judged if k["verdict"] == KILLED]
    times = [g["seconds"] for g in gates]
    per_gate = Counter((gate, v) for g in gates for gate, v in g["gates"].items())
    out = dict(trainers=len(rows), judged=len(ran), false_alarms=alarms, gate_errors=errors,
               false_alarm_rate=round(len(alarms) / len(ran), 4) if ran else None,
               kill_drawn=len(kills), kill_judged=len(judged), killed=len(killed),
               kill_rate=round(len(killed) / len(judged), 4) if judged else None,
               survived=[(k["seed"], k["operator"]) for k in judged if k["verdict"] == SURVIVED],
               kill_na=[k["seed"] for k in kills if k["verdict"] == "n/a"],
               kill_errors=[k["seed"] for k in kills if k["verdict"] not in (KILLED, SURVIVED, "n/a")],
               selftest_baseline_fails=[k["seed"] for k in kills if k.get("baseline_ok") is False],
               gates_seconds=dict(mean=round(statistics.mean(times), 1), median=round(statistics.median(times), 1),
                                  max=max(times), total=round(sum(times), 1)) if times else None,
               kill_seconds=round(sum(k.get("wall_seconds", 0) for k in kills), 1),
               per_gate={g: {v: n for (gg, v), n in per_gate.items() if gg == g} for g in sorted({g for g, _ in per_gate})})
    return out


def document(results: dict, *, command: str, profile: str, jobs: int, wall: float, max_world) -> dict:
    rows = []
    for seed in sorted(results):
        r = draw(seed)
        row = dict(seed=seed, short=r.short(), choices=r.as_dict(),
                   reproduce=f"HYPOTHESIS_PROFILE={profile} pytest --pyargs verify -p no:cacheprovider "
                             f"--verify-trainer benchmarks.zoo.population:t{seed}"
                             + ("" if profile == "ci" else f" --hypothesis-seed {seed}"))
        row.update({k: {x: y for x, y in v.items() if x != "folder"} for k, v in results[seed].items()})
        rows.append(row)
    doc = verify.report_header("zoo")
    kept = sum(1 for jobs_of in results.values() for v in jobs_of.values() if v.get("kept"))
    doc.update(command=command, profile=profile, jobs=jobs, wall_seconds=round(wall, 1), max_world=max_world,
               kept_jobs=kept, summary=summary(rows), trainers=rows)
    return doc


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def render_md(doc: dict) -> str:
    s = doc["summary"]
    m = doc["machine_info"]
    out = ["# The zoo: generated honest trainers through the gates", "",
           f"`{doc['command']}` — commit {doc.get('git_commit') or '(not a git checkout)'}, {doc['utc']}, "
           f"{m.get('cpu_count')} cores ({m.get('cpu_model')}), torch {m.get('torch')}, profile {doc['profile']}, "
           f"{doc['jobs']} jobs, {doc['wall_seconds']:.0f} s wall"
           + (f" (this run; {doc['kept_jobs']} jobs kept from an earlier run at the same commit, --resume)"
              if doc.get("kept_jobs") else ""), "",
           "| trainers | gates judged | false alarms | rate | gate errors | operators judged | killed | kill rate | "
           "survived | n/a | kill errors |", "|---|---|---|---|---|---|---|---|---|---|---|",
           f"| {s['trainers']} | {s['judged']} | {len(s['false_alarms'])} | {_pct(s['false_alarm_rate'])} | "
           f"{len(s['gate_errors'])} | {s['kill_judged']} | {s['killed']} | {_pct(s['kill_rate'])} | "
           f"{len(s['survived'])} | {len(s['kill_na'])} | {len(s['kill_errors'])} |", ""]
    if s["gates_seconds"]:
        t = s["gates_seconds"]
        out += [f"Gates per trainer: mean {t['mean']} s, median {t['median']} s, max {t['max']} s "
                f"(sum {t['total']} s); self-tests: {s['kill_seconds']} s in all.", ""]
    rows = doc["trainers"]
    alarms = [r for r in rows if r.get("gates", {}).get("verdict") == "rejected"]
    if alarms:
        out += ["## False alarms", ""]
        for r in alarms:
            out += [f"### t{r['seed']}: {r['short']}", "", f"`{r['reproduce']}`", ""]
            out += [f"* **{f['gate']}** (`{f['test']}`): {f['verdict']}" + (f"  \n  hint: {f['hint']}" if f.get("hint") else "")
                    for f in r["gates"]["failures"]]
            out.append("")
    odd = [r for r in rows if r.get("gates", {}).get("verdict") == "error" or
           r.get("kill", {}).get("verdict") not in (None, KILLED, "n/a")]
    if odd:
        out += ["## Errors and survivors", ""]
        for r in odd:
            g, k = r.get("gates", {}), r.get("kill", {})
            why = g.get("error_tail") if g.get("verdict") == "error" else ""
            out.append(f"* t{r['seed']} ({r['short']}): gates {g.get('verdict')}{': ' + why if why else ''}; "
                       f"operator {k.get('operator')} {k.get('verdict')}{': ' + str(k.get('why')) if k.get('why') else ''}")
        out.append("")
    out += ["## Gates", "", "| gate | pass | FAIL | skip | not run |", "|---|---|---|---|---|"]
    out += [f"| {g} | {v.get('pass', 0)} | {v.get('FAIL', 0)} | {v.get('skip', 0)} | {v.get('not run', 0)} |"
            for g, v in s["per_gate"].items()]
    out += ["", "## Trainers", "", "| seed | choices | gates | failing | s | operator | kill |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        g, k = r.get("gates", {}), r.get("kill", {})
        failing = ", ".join(sorted({f["gate"] or "?" for f in g.get("failures", [])}))
        out.append(f"| {r['seed']} | {r['short']} | {g.get('verdict', '')} | {failing} | {g.get('seconds', '')} | "
                   f"{k.get('operator') or ''} | {k.get('verdict', '')} |")
    return "\n".join(out) + "\n"


def write(doc: dict, out_dir: str) -> list[str]:
    """zoo.json and zoo.md, each to a temp file beside it first, then both moved into place."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    files = {os.path.join(out_dir, "zoo.json"): json.dumps(doc, indent=1) + "\n",
             os.path.join(out_dir, "zoo.md"): render_md(doc)}
    temps = []
    try:
        for path, text in files.items():
            fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".tmp-", suffix=os.path.basename(path))
            temps.append((tmp, path))
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
        for tmp, path in temps:
            os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return list(files)
