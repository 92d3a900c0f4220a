"""The report of a verify.memory run: `assemble` (rows + verdicts + the common header of verify/_internal/header.py
+ memory-specific provenance), `compare_anchor` (our rows beside plain torch's), and the renderings: the
stdout table, memory-E{E}.md, memory-E{E}.png; `write_all` writes the three all or none.

Everything renders from the report dict alone (the JSON), so a report can be re-rendered later.
matplotlib is imported only when the plot is rendered.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from verify.memory import anchor, plot, timing
from verify.memory.invariants import REL_TOL, tolerance
from verify.memory.plan import Plan
from verify.memory.plan import fmt_bytes as _fmt
from verify.memory.plan import report_unit as _unit


EXIT_CODES = {"PASS": 0, "N/A": 0, "FAIL": 1, "INCONCLUSIVE": 3}
"""verify.memory's exit status by verdict (2 is bad input): INCONCLUSIVE is not a failure — the run could
not tell, at this size, whether accumulation saves memory — so it has its own code, which a CI job can
treat as it likes."""
INCONCLUSIVE_HINT = ("hint: at this size what the check compares is within the probe's noise floor; make the "
                     "activations bigger than the fixed state: --model small or gpt2-ish, a longer --seq-len, or a "
                     "larger --effective-batch")


def overall(report) -> str:
    """FAIL (an invariant, a configuration that did not run, the anchor or an absurd prediction) over
    INCONCLUSIVE (an invariant could not be decided) over PASS; N/A when no invariant applied."""
    errs = [c for c in report["configs"] if c["peak_bytes"] is None]
    anchor_bad = report.get("anchor") and report["anchor"].get("verdict") == "FAIL"
    model_bad = (report.get("prediction") or {}).get("verdict") == "FAIL"
    if errs or anchor_bad or model_bad or any(v["status"] == "FAIL" for v in report["invariants"]):
        return "FAIL"
    if any(v["status"] == "INCONCLUSIVE" for v in report["invariants"]):
        return "INCONCLUSIVE"
    return "N/A" if all(v["status"] == "N/A" for v in report["invariants"]) else "PASS"


def _timing_lines(report) -> list[str]:
    """The timing warning (verify/memory/timing.py): a header line, then one line per unstable configuration."""
    bad = (report.get("timing") or {}).get("unstable") or []
    if not bad:
        return []
    return ["timing: UNSTABLE — the peaks stand, but these step times and rates are not comparable (was the "
            "machine busy?):", *(f"  {ln}" for ln in bad)]


def _cuda(report) -> bool:
    return report["settings"]["device"].startswith("cuda")


def _columns(report):
    """(header, cell(rank_row)) pairs for one configuration's measurements."""
    unit, _ = _unit(report)
    cols = [(f"peak {'alloc ' if _cuda(report) else ''}{unit}", lambda x: _fmt(x.get("peak_bytes"), report))]
    if _cuda(report):
        cols += [(f"reserved {unit}", lambda x: _fmt(x.get("peak_reserved_bytes"), report)),
                 (f"nvml {unit}", lambda x: _fmt(x.get("nvml_peak_used_bytes"), report))]
    cols += [(f"pred {unit}", lambda x: _fmt(x.get("predicted_bytes"), report)),
             ("meas/pred", lambda x: "—" if x.get("pred_ratio") is None else f"{x['pred_ratio']:.2f}"),
             ("step ms", lambda x: "—" if "step_ms" not in x else f"{x['step_ms']:.1f}"),
             _rate_column(report)]
    return cols


def _rate_key(report) -> str:
    """tok_s where the inputs are token ids (every successful row says so), else rows_s."""
    rows = [x for c in report["configs"] for x in c["ranks"] if "error" not in x]
    return "tok_s" if rows and all("tok_s" in x for x in rows) else "rows_s"


def _rate_column(report):
    key = _rate_key(report)
    return (key.replace("_", "/"), lambda x: "—" if key not in x else f"{x[key]:,.0f}")


def _cells(report, c, fn, once=False) -> str:
    vals = [("ERROR" if "error" in x else fn(x)) for x in c["ranks"]]
    return vals[0] if len(vals) == 1 or (once and len(set(vals)) == 1) else " / ".join(vals)


def _what(report) -> str:
    s = report["settings"]
    params = f"{s['n_params']:,} params" if s.get("n_params") is not None else "params unknown"
    if s.get("model_name"):
        text = s.get("model_text") or " ".join(f"{k}={v}" for k, v in (s.get("model") or {}).items())
        return f"model {s['model_name']} ({text}, {params}), S={s['seq_len']}"
    return f"adapter {s.get('adapter_name') or s['trainer']} ({params}; options {s.get('options_text')})"


def _header(report) -> str:
    s = report["settings"]
    w = f", world {s['world_size']} (per-rank values r0 / r1 / ...)" if s["world_size"] > 1 else ""
    return (f"E={s['effective_batch']}{w}, {_what(report)}, {s['device']}, fp32, {s.get('warmup_steps', 1)} warm-up + "
            f"{s['measured_steps']} measured optimizer steps per configuration, trainer {s['trainer']}")


def text_table(report) -> str:
    cols = _columns(report)
    head = ["sweep", "N", "B", "N·B", *[h for h, _ in cols]]
    body = []
    for c in report["configs"]:
        body.append([",".join(c["sweeps"]), str(c["N"]), str(c["B"]), str(c["eff"]),
                     *[_cells(report, c, fn, h.startswith("pred")) for h, fn in cols]])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    line = lambda r: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    out = [f"memory: {_header(report)}", f"peak: {report['probe']['primary']}", line(head)]
    out += [line(r) for r in body]
    for c in report["configs"]:
        for x in c["ranks"]:
            if "error" in x:
                out.append(f"  N={c['N']},B={c['B']} rank {x['rank']}: {x['error']}")
    st = report["static"]
    if st:
        unit, _ = _unit(report)
        opt = _fmt(st["optim_state_bytes"], report)
        out.append(f"static state: params {_fmt(st['param_bytes'], report)} + grads {_fmt(st['grad_bytes'], report)} "
                   f"+ optimizer {opt} = {_fmt(st['static_bytes'], report)} {unit}")
    for v in report["invariants"]:
        out.append(f"({v['id']}) {v['status']:<12} {v['claim']}")
        for r in v["rows"]:
            out.append(f"      {r}")
    pr = report.get("prediction")
    if pr:
        out.append(f"(model) {pr['verdict']:<10} {pr['claim']}")
        for r in pr["rows"]:
            out.append(f"      {r}")
    a = report.get("anchor")
    if a:
        for t in a["targets"]:
            ours = "—" if t["ours"] is None else f"{t['ours']:.4f}"
            out.append(f"(anchor) {t['status']:<8} {t['name']}: ours {ours}, plain torch {t['anchor']:.4f}, target {t['target']}")
    out += _timing_lines(report)
    out.append(f"verdict: {report['verdict']}")
    if report["verdict"] == "INCONCLUSIVE":
        out.append(INCONCLUSIVE_HINT)
    return "\n".join(out)


def _md_table(report, configs) -> list[str]:
    cols = _columns(report)
    head = ["N", "B", "N·B", *[h for h, _ in cols]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for c in configs:
        lines.append("| " + " | ".join([str(c["N"]), str(c["B"]), str(c["eff"]),
                                        *[_cells(report, c, fn, h.startswith("pred")) for h, fn in cols]]) + " |")
    return lines


def _ours(report) -> str:
    x = next((x for c in report["configs"] for x in c["ranks"] if "error" not in x), {})
    o = x.get("optimizer")
    opt = "optimizer not exposed" if not o else (
        f"{o['cls']}(fused={o['fused']}, foreach={o['foreach']})" + (" (None/None: torch's default, foreach on CUDA)"
                                                                     if o["fused"] is None and o["foreach"] is None else ""))
    return f"`--trainer {report['settings']['trainer']}` = {x.get('trainer_class', '?')}, {opt}"


def render_md(report) -> str:
    s, mi = report["settings"], report["machine_info"]
    E = s["effective_batch"]
    unit, _ = _unit(report)
    from verify._internal.header import commit_text

    commit = commit_text(report, 12)
    dev = mi["gpu"] + (f", driver {mi['driver']}" if mi.get("driver") else "") if mi.get("gpu") else \
        f"CPU ({mi.get('cpu_model') or 'unknown'}, {mi['cpu_count']} cores, {s['threads']} threads)"
    L = [f"# Peak memory vs accumulation steps, E = {E}: **{report['verdict']}**", "",
         f"`{report.get('command', 'python -m verify.memory')}` · {commit} · {report['utc']} · "
         f"{dev} · torch {mi['torch']}" + (f", CUDA {mi['cuda']}" if mi.get("cuda") else "") + f" · Python {mi['python']}",
         "", _header(report) + ".", "",
         "Gradient accumulation exists to save memory: an optimizer step over N micro-batches of B rows (sequences, "
         "for a language model) should peak like ONE micro-batch (plus the gradient buffers, held across "
         "micro-steps), not like N·B rows.",
         "", "## Verdicts", "", "| | invariant | verdict | evidence |", "|---|---|---|---|"]
    for v in report["invariants"]:
        ev = "<br>".join((v["rows"] or v["detail"]))
        L.append(f"| {v['id']} | {v['claim']} | **{v['status']}** | {ev} |")
    if report["verdict"] == "INCONCLUSIVE":
        L += ["", f"**INCONCLUSIVE** (exit {EXIT_CODES['INCONCLUSIVE']}, not a failure): " + INCONCLUSIVE_HINT[len("hint: "):] + "."]
    a = report.get("anchor")
    if a:
        for t in a["targets"]:
            ours = "—" if t["ours"] is None else f"{t['ours']:.4f}"
            L.append(f"| anchor | {t['name']} {t['target']} (plain torch: {t['anchor']:.4f}) | **{t['status']}** | ours {ours} |")
    th = report["thresholds"]
    L += ["", f"Tolerances: max({th['rel']:.0%} of the peak, {_fmt(th['abs_noise_bytes'], report)} {unit}) for "
          f"'does not grow' and 'flat'; well below: {th['well_below']}; rise: {th['rise']}.", ""]
    A = sorted((c for c in report["configs"] if "A" in c["sweeps"]), key=lambda c: c["N"])
    B = sorted((c for c in report["configs"] if "B" in c["sweeps"]), key=lambda c: c["N"])
    L += [f"## Sweep A: fixed effective batch E = {E} (B = E/N)", "", *_md_table(report, A), "",
          "## Sweep B: fixed micro-batch B = 1", "", *_md_table(report, B), ""]
    timing = _timing_lines(report)
    if timing:
        L += ["## Timing: unstable", "", *(f"- {ln}" for ln in timing[1:]), ""]
    errs = [(c, x) for c in report["configs"] for x in c["ranks"] if "error" in x]
    if errs:
        L += ["Errors:", ""] + [f"- N={c['N']}, B={c['B']}, rank {x['rank']}: {x['error']}" for c, x in errs] + [""]
    L += _md_prediction(report)
    st = report["static"]
    if st:
        L += ["## Static state", "",
              f"params {_fmt(st['param_bytes'], report)} + gradients {_fmt(st['grad_bytes'], report)} + optimizer "
              f"state {_fmt(st['optim_state_bytes'], report)} = **{_fmt(st['static_bytes'], report)} {unit}** "
              f"(bytes of the tensors, after the warm-up step, as the trainer's params() and grads() return them: "
              f"FSDP2's are the gathered full tensors, a rank holds 1/W of the parameters; the optimizer state is "
              f"read from the trainer's `.opt` or `.optimizer`, a DTensor's local shard; — when it exposes neither).", ""]
    if a:
        L += ["## Beside plain torch (the anchor)", "",
              f"Anchor: `{a['source']}`" + (f" ({a['note']})" if a.get("note") else "") + ". Ours: the trainer under "
              f"test through the harness interface: {_ours(report)}.", "",
              "| N | B | peak alloc GiB ours / torch | reserved GiB ours / torch | nvml GiB ours / torch | "
              "step ms ours / torch | tok/s ours / torch |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for p in a["pairs"]:
            o, t = p["ours"], p["anchor"]

            def pair(k, f):
                ov = "—" if o is None or o.get(k) is None else f.format(o[k])
                return f"{ov} / {f.format(t[k])}"
            L.append(f"| {p['N']} | {p['B']} | {pair('peak_alloc_gib', '{:.3f}')} | {pair('peak_reserved_gib', '{:.3f}')} "
                     f"| {pair('nvml_peak_gib', '{:.3f}')} | {pair('step_ms', '{:.1f}')} | {pair('tok_s', '{:,.0f}')} |")
        L.append("")
    pr = report["probe"]
    L += ["## What the figures include", "", f"- **peak**: {pr['primary']}. {pr['includes']}"]
    if pr.get("nvml"):
        n0 = next((x for c in report["configs"] for x in c["ranks"] if x.get("nvml_period_s")), None)
        period = f" (period {n0['nvml_period_s'] * 1e3:.0f} ms, mean interval {n0['nvml_mean_interval_s'] * 1e3:.1f} ms)" \
            if n0 and n0.get("nvml_mean_interval_s") else ""
        L.append(f"- **nvml**: {pr['nvml']}{period}." + ("" if mi.get("nvml") == "ok" else f" Not measured: {mi.get('nvml')}."))
        L.append("- **reserved**: torch.cuda.max_memory_allocated's sibling max_memory_reserved: blocks the caching "
                 "allocator holds, used or not.")
    L += [f"- **isolation**: {pr['isolation']}.",
          ("- **step ms / tok/s**: wall time of the measured optimizer steps (synchronized at the end); tokens = "
           "N·B·S per rank" if _rate_key(report) == "tok_s" else
           "- **step ms / rows/s**: wall time of the measured optimizer steps (synchronized at the end); rows = N·B "
           "per rank (the inputs are not token ids, so no token rate is claimed)")
          + "; the CPU box may be shared, so CPU timings are indicative only.", "",
          f"![peak vs N](memory-E{E}.png)", ""]
    return "\n".join(L)


def write_all(report, out: Path) -> list[Path]:
    """Render all three files first, then write them all or none (verify/_internal/header.py: atomic_write_all): an
    error while rendering or writing leaves no partial report."""
    from verify._internal.header import atomic_write_all

    stem = f"memory-E{report['settings']['effective_batch']}"
    files = {}
    try:
        png = plot.to_png(plot.peaks_figure(report))
    except ImportError:
        print("verify.memory: matplotlib is not installed; writing the report without the plot", file=sys.stderr)
        png = None
    files[out / f"{stem}.json"] = json.dumps(report, indent=1, default=str) + "\n"
    files[out / f"{stem}.md"] = render_md(report)
    if png is not None:
        files[out / f"{stem}.png"] = png
    return [Path(p) for p in atomic_write_all(files)]


def _ends(plan: Plan) -> str:
    return f"; of these only N = 1, 2, {plan.E_local} (--sweep ends)" if plan.sweep == "ends" else ""


def assemble(plan: Plan, per_rank: list[list[dict]], verdicts: list[dict], *, nvml: str | None = None) -> dict:
    """The report: the common header (verify/_internal/header.py), memory-specific provenance, settings, probe
    definitions, thresholds, every configuration with its per-rank rows, the verdicts, the anchor
    comparison. `nvml`: why NVML could not be used on this GPU (None: it could)."""
    from verify._internal.header import header
    from verify._internal.cases.case import _plain, _short
    from verify.memory.probes import probe_definition

    configs = []
    for i, c in enumerate(plan.configs):
        ranks = [rows[i] for rows in per_rank]
        peaks = [x["peak_bytes"] for x in ranks if "error" not in x]
        configs.append(dict(N=c.N, B=c.B, eff=c.N * c.B * plan.world, sweeps=list(c.sweeps),
                            peak_bytes=max(peaks) if len(peaks) == len(ranks) else None, ranks=ranks))
    ok0 = [x for x in per_rank[0] if "error" not in x]
    static = None if not ok0 else {k: ok0[0][k] for k in ("param_bytes", "grad_bytes", "optim_state_bytes", "static_bytes")}
    head = header("memory", plan.device if plan.cuda else None)
    if plan.cuda:
        head["machine_info"]["nvml"] = "ok" if nvml is None else nvml
    ref = plan.adapter.locate()
    git = dict(head["git"], sources_sha256=sources_sha256(ref, plan.sources))  # the header's, and the sources' hash
    n_params = plan.n_params if plan.n_params is not None else (ok0[0]["param_count"] if ok0 else None)
    floor, _ = tolerance(plan.cuda)
    hwm = all(x.get("hwm_source", "").startswith("VmHWM") for x in ok0)
    probe = probe_definition(plan.cuda, hwm_reset=hwm)
    return dict(
        head, tool="verify.memory", git=git,
        settings=dict(effective_batch=plan.E, world_size=plan.world, effective_batch_per_rank=plan.E_local,
                      device=str(plan.device), trainer=plan.trainer, adapter=ref, adapter_name=plan.adapter.name,
                      options=_plain(plan.options), options_text=_short(plan.options), model_name=plan.model_name,
                      model=plan.model, model_text=plan.model_text, n_params=n_params,
                      seq_len=plan.seq_len, warmup_steps=plan.warmup, measured_steps=plan.steps, dtype="float32",
                      threads=plan.threads if not plan.cuda else None, tf32=False if plan.cuda else None,
                      sweep_A=f"N | {plan.E_local}, B = {plan.E_local}/N (per rank)" + _ends(plan),
                      sweep_B="B = 1, N = 1, 2, 4, ... ≤ " + str(plan.E_local) + _ends(plan)),
        probe=probe,
        thresholds=dict(rel=REL_TOL, abs_noise_bytes=floor, well_below="peak(E,1) ≤ ideal + ½·(peak(1,E) − ideal), ideal = peak(1,1) + grad_bytes "
                        "(at least half the saving of ideal accumulation); INCONCLUSIVE when peak(1,E) − ideal < "
                        "4 × abs_noise_bytes",
                        rise="peak(2,1) − peak(1,1) ≤ grad_bytes + max(rel·peak(1,1), abs_noise_bytes)"),
        static=static, configs=configs, invariants=verdicts,
        anchor=anchor.compare_anchor(plan, per_rank[0]),
        timing=dict(unstable=timing.unstable(per_rank), spread=timing.SPREAD, cpu_wait=timing.CPU_WAIT),
    )


def _md_prediction(report) -> list[str]:
    pr = report.get("prediction")
    if not pr:
        return []
    unit, _ = _unit(report)
    L = ["## Predicted peak (memory model)", ""]
    if pr["mode"] is None:
        return L + [f"Not predicted: {pr['reason']}.", ""]
    L += [pr.get("text") or f"Mode **{pr['mode']}** (`{pr.get('model')}`).", "",
          f"The prediction is {pr['quantity']}. Model check (exit 1 only outside the absurd bounds "
          f"{pr['absurd_bounds']}, predictions ≥ 4 × the noise floor): **{pr['verdict']}**.", "",
          f"| N | B | predicted {unit} | measured / predicted | terms counted ({unit}) |", "|---:|---:|---:|---:|---|"]
    for c in report["configs"]:
        if c["predicted_bytes"] is None:
            continue
        r = _cells(report, c, lambda x: "—" if x.get("pred_ratio") is None else f"{x['pred_ratio']:.2f}")
        t = "; ".join(f"{k} {_fmt(v, report)}" for k, v in c["predicted_terms"].items())
        L.append(f"| {c['N']} | {c['B']} | {_fmt(c['predicted_bytes'], report)} | {r} | {t} |")
    return L + [""]


# -- provenance -----------------------------------------------------------------------------------

def sources_sha256(adapter_ref: str | None = None, packages=("verify",)) -> str:
    """sha256 over the measured code: every .py file of `packages` as imported (a repository or
    site-packages; the CLI adds the trainer's own package), and the adapter's own module. Identifies the
    code with or without git."""
    import hashlib
    import importlib

    files = []
    for pkg in map(importlib.import_module, packages):
        root = Path(pkg.__file__).resolve().parent
        files += [(f.relative_to(root.parent).as_posix(), f) for f in sorted(root.rglob("*.py"))]
    mod = importlib.import_module(adapter_ref.split(":")[0]) if adapter_ref else None
    where = getattr(mod, "__file__", None)
    if where and not any(Path(where).resolve() == f for _, f in files):
        files.append((adapter_ref.split(":")[0] + ".py", Path(where)))
    h = hashlib.sha256()
    for name, f in files:
        h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
