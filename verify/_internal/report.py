"""The run report: one `verify-report.json` + `verify-report.md` for everything a run proved.

Gate tests call `record(result)` once per passed example (or `skip(gate, reason)`); the pytest plugin
collects failures from the test reports. Under pytest-xdist each worker ships its tallies (`dump`) to the
controller, which merges them (report_merge.py) and alone writes, once, atomically, mode 0644. The self-test
adds its operator × gate table to the same report (`write(..., selftest=...)` keeps the gate section of
an existing report of the same trainer, and the other way round). A folder holds one trainer's report: a run
of another trainer replaces it and says so on the terminal (`replaces`).
"""
from __future__ import annotations

import json
import os

from verify._internal.ranks.comm import LINKS
from verify._internal.gates.table import TABLE, gate_budget
from verify._internal.gates.tolerance import NATIVE_TEXT
from verify._internal.verdict import Gate

__all__ = ["record", "skip", "not_applicable", "dump", "write", "replaces", "read", "render_md", "REPORT_NAME"]

REPORT_NAME = "verify-report"
_STATS: dict[str, dict] = {}

# Keys: the gates' names (Gate values), "@precision" added for a mixed-precision tally (equivalence@bf16).
BOUNDS = {g: row.claim for g, row in TABLE.items()}  # each gate's bound in words, in the report's order
ORDER = tuple(g.value for g in BOUNDS)  # the report's gate order: BOUNDS' order
EXACT = (Gate.BIT_EXACT, Gate.EMPTY_WINDOW)  # torch.equal or a failure: no error / bound to rank
LARGEST = (Gate.BOUNDARY_ONLY, Gate.BYTES_PER_STEP, Gate.OVERFLOW)  # exact too: the worst case is the largest world × N


def _gate(name: str) -> dict:
    if name not in _STATS:  # budget: the examples the gate's own test draws under this profile (None: judged on
        row = TABLE.get(next((g for g in Gate if g.value == name), None))  # another's runs, or a precision's tally)
        _STATS[name] = dict(examples=0, skipped=0, skip_reason=None, worst_ratio=0.0, worst_check="", worst_case=None,
                            budget=gate_budget(row.gate) if row is not None and row.budget else None)
    return _STATS[name]


def _keep_worst(s: dict, ratio: float, check: str, case) -> None:
    if s["worst_case"] is None or ratio > s["worst_ratio"]:
        s.update(worst_ratio=float(ratio), worst_check=check, worst_case=case.as_dict(), worst_case_text=str(case))


def _keep_floor(s: dict, result) -> None:
    """The largest float64 floor (tolerance.twin_floor: the reference's own rounding) the gate measured."""
    f = result.extra.get("floor64")
    if f is not None:
        s["float64_floor"] = max(float(f), s.get("float64_floor") or 0.0)
    if result.extra.get("native"):  # a native reference (Numerics(native=...)): no float64 run, the report says so
        s["native"] = result.extra["native"]


def _key(gate: Gate, case) -> str:
    """The report's key: the gate's name, with "@precision" outside fp32 (a plain str: it goes to JSON)."""
    p = getattr(case, "precision", "fp32")
    return gate.value if p == "fp32" else f"{gate.value}@{p}"


def _largest(s: dict, case, check: str) -> None:
    """An exact gate's worst case (no error / bound to rank): its largest world × N run; and the worlds it ran."""
    w = s.get("worst_case")
    s["worlds"] = sorted(set(s.get("worlds", [])) | {case.world})
    if w is None or case.world * case.accum_steps > w["world"] * w["accum_steps"]:
        s.update(worst_ratio=0.0, worst_check=check, worst_case=case.as_dict(), worst_case_text=str(case))


def record(result, gate: Gate | None = None) -> None:
    """One passed example of a gate (a verify.GateResult); mixed-precision examples are tallied apart
    (equivalence@bf16, ...), each precision having its own rounding. `gate`: the gate the calling test proves
    with `result` where that is not the check's own, else that gate would read as not run: a long window is the
    equivalence check at N ≥ 64 (LONG_WINDOW); bytes per step returns its N run's data-parallel result
    (BYTES_PER_STEP; that run counts for boundary-only and data-parallel equivalence too)."""
    gate = Gate(result.gate if gate is None else gate)
    if result.gate is Gate.DP_EQUIVALENCE:  # one data-parallel run proves both: the counter's and the numbers' verdict
        if gate not in (Gate.DP_EQUIVALENCE, Gate.BYTES_PER_STEP):
            raise ValueError(f"record(gate={gate.value!r}): a data-parallel result proves boundary-only, data-parallel "
                             f"equivalence and (paired with its window at N = 1) bytes per step")
        if gate is Gate.BYTES_PER_STEP:
            _gate(_key(gate, result.case))["examples"] += 1
            _largest(_gate(_key(gate, result.case)), result.case, "largest world × N")
        ex, w = result.extra, result.case.world
        b = _gate(_key(Gate.BOUNDARY_ONLY, result.case))
        b["examples"] += 1
        b["worlds"] = sorted(set(b.get("worlds", [])) | {w})
        b["expected_before_boundary"] = b.get("expected_before_boundary", 0) + len(ex["comm"].expected_used)
        if ex.get("declared_side_traffic"):  # a row's sized metric traffic at the boundary (CountRow.side)
            b["declared_side_traffic"] = b.get("declared_side_traffic", 0) + ex["declared_side_traffic"]
        # world 1 has nobody to reduce with; a case whose reference has no gradient (every window without a valid
        # target) has no gradient bytes to divide by
        if w > 1 and ex["gradient_bytes"]:
            per_step = [by / ex["gradient_bytes"] for by in ex["boundary_bytes"]]
            by_link = {link_key(link): [s[link] for s in ex["boundary_bytes_by_link"]]
                       for link in LINKS} if ex.get("boundary_bytes_by_link") else {}
            for key, vals in (("boundary_bytes_over_gradient_bytes", per_step),
                              ("boundary_collectives_per_step", ex["boundary_collectives"]), *by_link.items()):
                lo, hi = b.get(key, [min(vals), max(vals)])
                b[key] = [min(lo, min(vals)), max(hi, max(vals))]
            if b["worst_case"] is None or w * result.case.accum_steps > b["worst_case"]["world"] * b["worst_case"]["accum_steps"]:
                b.update(worst_check="largest world × N", worst_case=result.case.as_dict(), worst_case_text=str(result.case))
        e = _gate(_key(Gate.DP_EQUIVALENCE, result.case))
        e["examples"] += 1
        if getattr(result.case, "uneven", False):  # ranks of unequal windows (Case.rank_rows): how many were run
            e["uneven_examples"] = e.get("uneven_examples", 0) + 1
        _keep_worst(e, result.ratio, result.worst, result.case)
        _keep_floor(e, result)
        if ex.get("metrics"):  # the same run's reported metrics, judged on its float64 run
            _metrics_tally(_gate(Gate.REPORTED_METRICS.value), ex["metrics"], result.case)
        return
    if gate is Gate.REPORTED_METRICS:  # one key: a bf16 / fp16 run's metrics are tallied as grad_norm@fp16, ...
        _metrics_tally(_gate(gate.value), result.extra, result.case, result)
        return
    s = _gate(_key(gate, result.case))
    s["examples"] += 1
    _keep_floor(s, result)
    if result.extra.get("unjudged"):  # checks a case could not judge (grads_from="optimizer": after clipping, ...)
        s["unjudged"], s["unjudged_examples"] = s.get("unjudged") or result.extra["unjudged"], s.get("unjudged_examples", 0) + 1
    if gate is Gate.NORMALISER and result.extra.get("packed_rows"):  # windows of packed rows, and a document halved
        s["packed_examples"] = s.get("packed_examples", 0) + 1
        s["packed_halved"] = s.get("packed_halved", 0) + bool(result.extra.get("halved_packed"))
    if gate is Gate.OVERFLOW:  # exact checks, no error to rank: the worlds seen, and the largest world × N as the case
        _largest(s, result.case, "largest world × N: " + result.worst)
    elif gate not in EXACT:
        _keep_worst(s, result.ratio, result.worst, result.case)
    if getattr(result.case, "mesh", None) is not None:  # the mesh shapes a mesh gate ran, the axes left uncounted
        s["meshes"] = sorted(set(s.get("meshes", [])) | {str(result.case.mesh)})
        counted = result.extra.get("counts") or {}
        s["axes_not_counted"] = sorted(set(s.get("axes_not_counted", [])) | set(counted.get("unjudged", [])))
        if result.extra.get("metrics"):  # the mesh run's reported metrics, judged on its float64 run
            _metrics_tally(_gate(Gate.REPORTED_METRICS.value), result.extra["metrics"], result.case)


def _metrics_tally(s: dict, m: dict, case, result=None) -> None:
    """One case's metrics (gates/metrics.py MetricsTally.extra): steps checked per metric, why some were not,
    the worlds, how many steps clipped."""
    s["examples"] += 1
    for name, n in m.get("metrics_checked", {}).items():
        s.setdefault("checked", {})[name] = s.get("checked", {}).get(name, 0) + n
    for name, why in m.get("metrics_unchecked", {}).items():
        s.setdefault("unchecked", {}).setdefault(name, why)
    s["clipped_steps"] = s.get("clipped_steps", 0) + m.get("clipped_steps", 0)
    s["steps"] = s.get("steps", 0) + m.get("metric_steps", 0)
    s["worlds"] = sorted(set(s.get("worlds", [])) | {case.world})
    if result is not None:
        _keep_worst(s, result.ratio, result.worst, case)


def coverage(gates: dict, declarations: dict | None) -> tuple[list[str], str]:
    """What a run did not check, and its last line: ([one line per gate or metric not checked, with the reason
    and the declaration that enables it], 'checked G of T gates and M of 6 metrics ...')."""
    from verify._internal.metrics import ENABLE, METRIC_NAMES

    ran = {n.split("@")[0] for n, g in gates.items() if g.get("examples")}
    every = [*ORDER, *(g.value for g in Gate if g.value not in ORDER and g is not Gate.DETERMINISM)]
    lines = []
    for name in every:
        if name in ran:
            continue
        g = gates.get(name)
        why = g.get("skip_reason") if g else None
        lines.append(f"{name}: {why or 'no test of this gate ran in this session (deselected, or not collected)'}")
    declared = (declarations or {}).get("metrics") or {}
    names = declared.get("names", [])
    m = gates.get(Gate.REPORTED_METRICS.value) or {}
    checked = {k for k, n in m.get("checked", {}).items() if n and k in METRIC_NAMES}
    for name in METRIC_NAMES:
        if name in checked:
            continue
        if not declared:
            why = f"the trainer declares no metrics ({ENABLE})"
        elif name not in names:
            why = "not in Metrics(names=...): add it there and return it from metrics()"
        else:
            why = m.get("unchecked", {}).get(name) or "declared, but no metrics run reached it in this session"
        lines.append(f"metric {name}: {why}")
    for name, why in sorted(m.get("unchecked", {}).items()):
        if name in checked or name not in METRIC_NAMES:
            lines.append(f"metric {name}, some steps: {why}")
    lines += [f"{name}, in part ({g.get('unjudged_examples', 1)} of {g.get('examples', 1)} examples): {g['unjudged']}"
              for name, g in sorted(gates.items()) if g.get("unjudged")]
    from verify._internal.objective import non_equivalences

    lines += non_equivalences((declarations or {}).get("objective"))
    g_ran = len(ran & set(every))
    last = f"checked {g_ran} of {len(every)} gates and {len(checked)} of {len(METRIC_NAMES)} metrics"
    offered = len(every) + len(METRIC_NAMES)
    if 2 * (g_ran + len(checked)) < offered:
        last += " — less than half of what the harness can check; the lines above say what would enable the rest"
    elif lines:
        last += "; not checked: " + ", ".join(ln.split(":")[0] for ln in lines if ", some steps" not in ln)
    return lines, last


def skip(gate: Gate, reason: str) -> None:
    s = _gate(Gate(gate).value)
    s["skipped"] += 1
    s["skip_reason"] = reason


def not_applicable(adapter, settings, *gates: Gate) -> str | None:
    """In a gate test: why the first of `gates` does not apply (the gate table's why_not), recorded as the reason
    every one of them was not checked; None where it applies. The test skips with it (pytest.skip(reason))."""
    from verify._internal.gates.table import why_not

    reason = why_not(gates[0], adapter, settings)
    for gate in gates if reason else ():
        skip(gate, reason)
    return reason


def dump() -> str:
    return json.dumps(_STATS)


# -- writing -----------------------------------------------------------------------------------------

def paths(folder: str) -> tuple[str, str]:
    return os.path.join(folder, REPORT_NAME + ".json"), os.path.join(folder, REPORT_NAME + ".md")


def read(folder: str) -> dict | None:
    try:
        with open(paths(folder)[0]) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def replaces(folder: str, trainer: str) -> str | None:
    """What writing `trainer`'s report into `folder` replaces: 'the report of <other trainer> (<utc>)' where the
    folder holds another trainer's report, else None. One report per folder: a run says so on the terminal
    rather than replace another trainer's silently (--verify-report DIR keeps them apart)."""
    old = read(folder)
    if old is None or old.get("trainer") in (None, trainer):
        return None
    return f"the report of {old['trainer']} ({old.get('utc') or 'undated'})"


def write(folder: str, *, trainer: str, settings: dict, gates: dict | None = None, failures=None,
          selftest: dict | None = None, exitstatus: int | None = None, device=None,
          declarations: dict | None = None) -> list[str]:
    """Render JSON and markdown first, then replace both files. A section not given (gates or selftest)
    is kept from an existing report of the same trainer, so one report holds a gate run and a self-test.
    `declarations`: the adapter's (Adapter.declarations()), listed in every report."""
    from verify._internal.header import atomic_write, header

    old = read(folder)
    same = old is not None and old.get("trainer") == trainer
    doc = dict(header("verify-report", device), trainer=trainer, settings=settings,
               gates=gates if gates is not None else (old.get("gates", {}) if same else {}),
               failures=failures if failures is not None else (old.get("failures", []) if same else []),
               exitstatus=exitstatus if exitstatus is not None else (old.get("exitstatus") if same else None),
               selftest=selftest if selftest is not None else (old.get("selftest") if same else None),
               declarations=declarations if declarations is not None else (old.get("declarations") if same else None))
    if same and gates is None:
        doc["settings"] = {**old.get("settings", {}), **settings}
    js, md = json.dumps(doc, indent=1, default=str), render_md(doc)
    jp, mp = paths(folder)
    atomic_write(jp, js)
    atomic_write(mp, md)
    return [jp, mp]


def link_key(link: str) -> str:
    """A gate's report key for the boundary's bytes over one link (comm.LINKS): boundary_bytes_intra_node, ..."""
    return f"boundary_bytes_{link.replace('-', '_')}"


LINK_KEYS = tuple(link_key(link) for link in LINKS)


def _links(g: dict) -> str:
    """The boundary's bytes per step by link (intra-node / inter-node: the groups' nodes, verify._internal.ranks.comm.group_links)."""
    if not any(k in g for k in LINK_KEYS):
        return ""
    parts = [f"{link} {g[k][0]}–{g[k][1]} B" for link, k in zip(LINKS, LINK_KEYS) if k in g]
    return "boundary bytes per step by link: " + ", ".join(parts) + "; "


def _ratio(x) -> str:
    return "—" if x is None else f"{x:.3g}"


def render_md(doc: dict) -> str:
    from verify._internal.header import commit_text, versions_text

    mi = doc.get("machine_info", {})
    lines = [f"# verify report: `{doc['trainer']}`", "",
             f"{doc.get('utc')} · {commit_text(doc)} · xtrain-verify {doc.get('xtrain_version')} · "
             f"torch {mi.get('torch')} · {mi.get('gpu') or 'CPU'} · settings: "
             + ", ".join(f"{k} {v}" for k, v in doc.get("settings", {}).items() if k != "command"), ""]
    if doc.get("versions"):
        lines += [f"Resolved: {versions_text(doc['versions'])}", ""]
    decl = doc.get("declarations")
    if decl is not None:  # each one changes what a gate expects; none turns a gate off
        lines += ["Declarations: " + ("; ".join(f"`{k}={v}`" for k, v in decl.items()) or "none"), ""]
    gates = doc.get("gates") or {}
    if gates:
        lines += ["| gate | examples | worst error / bound | where | float64 floor | worst case | bound |",
                  "|---|---|---|---|---|---|---|"]
        names = sorted(gates, key=lambda n: (ORDER.index(n.split("@")[0]) if n.split("@")[0] in ORDER else 99, n))
        for name in names:
            g = gates[name]
            base = name.split("@")[0]
            if not g["examples"] and g.get("skip_reason"):
                lines.append(f"| {name} | skipped | — | — | — | {g['skip_reason']} | |")
                continue
            extra = ""
            if base == Gate.BOUNDARY_ONLY:
                lo_hi = g.get("boundary_bytes_over_gradient_bytes")
                extra = (f"worlds {g.get('worlds')}; at world > 1: bytes per step ÷ gradient bytes "
                         f"{'—' if lo_hi is None else f'{lo_hi[0]:.4f}–{lo_hi[1]:.4f}'}, boundary collectives per "
                         f"step {g.get('boundary_collectives_per_step')}; declared collectives before the boundary "
                         f"{g.get('expected_before_boundary', 0)}; {_links(g)}largest case: ")
            short = g.get("worst_case_text") or "—"
            ratio = "—" if base in (*EXACT, *LARGEST) else _ratio(g["worst_ratio"])
            floor, native = g.get("float64_floor"), g.get("native")
            floor = native or ("—" if floor is None else f"{floor:.2e}")
            lines.append(f"| {name} | {g['examples']} | {ratio} | {g.get('worst_check') or '—'} | "
                         f"{floor} | {extra}{short} | {NATIVE_TEXT if native else BOUNDS.get(base, '')} |")
        lines += ["", "float64 floor: the largest rounding floor a gate's float64 checks used — eps32 (what an fp32 "
                  "run of the case resolves), or the reference's own rounding measured on its twin where eps32 was "
                  "not enough; —: the gate has no float64 check (docs/design.md §3); native …: no float64 run, the "
                  "trainer judged against its own runs in that precision (Numerics(native=...)).", ""]
    fails = doc.get("failures") or []
    if not gates and not fails:
        lines.append("No gate run recorded yet: `pytest --pyargs verify --verify-trainer "
                     f"{doc['trainer']} -n auto` adds one.")
    else:
        code = doc.get("exitstatus")
        head = (f"FAILED: {len(fails)} gate test(s)" if fails else "every gate that ran passed")
        tail = "" if code is None else f" (pytest exit status {code}" + (", from tests other than the gates"
                                                                          if code and not fails else "") + ")"
        lines.append(f"**{head}**{tail}")
    for f in fails:
        lines += ["", f"- `{f['test']}`", "", "  ```", *("  " + ln for ln in f["message"].splitlines()[:12]), "  ```"]
        if f.get("hint"):
            lines += ["", f"  hint: {f['hint']}"]
    st = doc.get("selftest")
    if st:
        lines += ["", "## Self-test (fault injection)", "", st.get("table_md", ""), "",
                  f"Mutation score: **{st.get('score')}** — {st.get('verdict')}"]
    if gates:
        lines += ["", "## Reported metrics", "", *_metrics_rows(gates.get(Gate.REPORTED_METRICS.value) or {}, decl)]
        missing, last = coverage(gates, decl)
        lines += ["", "## Not checked", ""] + ([f"- {ln}" for ln in missing] or ["- nothing: every gate and metric ran"])
        lines += ["", f"**{last[0].upper()}{last[1:]}**"]
    return "\n".join(lines) + "\n"


def _metrics_rows(m: dict, decl: dict | None) -> list[str]:
    """The metrics table: per metric, the steps checked, its declared convention, and what was not checked."""
    from verify._internal.metrics import CONVENTIONS, METRIC_NAMES

    d = (decl or {}).get("metrics") or {}
    if not d:
        return ["No metrics declared: none of loss, grad_norm, clip_coef, lr, tokens, rows was checked."]
    conv = {"loss": "loss", "grad_norm": "grad_norm", "lr": "lr", "tokens": "counts", "rows": "counts"}
    out = [f"Worlds {m.get('worlds', [])}; {m.get('clipped_steps', 0)} of {m.get('steps', 0)} steps judged had "
           f"clipping active (coefficient < 1)" + ("; no step clipped, so a coefficient bug could not show"
                                                   if m.get("steps") and not m.get("clipped_steps") else ""), "",
           "| metric | steps checked | convention | not checked |", "|---|---|---|---|"]
    for name in (*METRIC_NAMES, "clip (applied)"):
        if name not in d.get("names", []) and name != "clip (applied)":
            out.append(f"| {name} | — | — | not reported |")
            continue
        c, checked = conv.get(name), m.get("checked", {})
        low = ", ".join(f"{k.split('@')[1]} {n}" for k, n in sorted(checked.items()) if k.startswith(name + "@"))
        out.append(f"| {name} | {checked.get(name, 0)}{f' (+ {low})' if low else ''} | "
                   f"{d.get(c, CONVENTIONS[c][0]) if c else '—'} | {m.get('unchecked', {}).get(name, '')} |")
    return out
