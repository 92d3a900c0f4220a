"""Rendering for verify.memory: the stdout table, memory-E{E}.md, memory-E{E}.png, and the atomic write.

Everything renders from the report dict alone (the JSON), so a report can be re-rendered later.
"""
from __future__ import annotations

import io
import json
import os
import sys
import tempfile
from pathlib import Path

MiB, GiB = 2**20, 2**30


def _unit(report) -> tuple[str, int]:
    return ("GiB", GiB) if report["settings"]["device"].startswith("cuda") else ("MiB", MiB)


def _fmt(b, report) -> str:
    if b is None:
        return "—"
    unit, scale = _unit(report)
    return f"{b / scale:.3f}" if unit == "GiB" else f"{b / scale:.1f}"


def overall(report) -> str:
    bad = [v for v in report["invariants"] if v["status"] in ("FAIL", "INCONCLUSIVE")]
    errs = [c for c in report["configs"] if c["peak_bytes"] is None]
    anchor_bad = report.get("anchor") and report["anchor"].get("verdict") == "FAIL"
    if bad or errs or anchor_bad:
        return "FAIL"
    return "N/A" if all(v["status"] == "N/A" for v in report["invariants"]) else "PASS"


def _cuda(report) -> bool:
    return report["settings"]["device"].startswith("cuda")


def _columns(report):
    """(header, cell(rank_row)) pairs for one configuration's measurements."""
    unit, _ = _unit(report)
    cols = [(f"peak {'alloc ' if _cuda(report) else ''}{unit}", lambda x: _fmt(x.get("peak_bytes"), report))]
    if _cuda(report):
        cols += [(f"reserved {unit}", lambda x: _fmt(x.get("peak_reserved_bytes"), report)),
                 (f"nvml {unit}", lambda x: _fmt(x.get("nvml_peak_used_bytes"), report))]
    cols += [("step ms", lambda x: "—" if "step_ms" not in x else f"{x['step_ms']:.1f}"),
             ("tok/s", lambda x: "—" if "tok_s" not in x else f"{x['tok_s']:,.0f}")]
    return cols


def _cells(report, c, fn) -> str:
    vals = [("ERROR" if "error" in x else fn(x)) for x in c["ranks"]]
    return vals[0] if len(vals) == 1 else " / ".join(vals)


def _header(report) -> str:
    s, m = report["settings"], report["settings"]["model"]
    w = f", world {s['world_size']} (per-rank values r0 / r1 / ...)" if s["world_size"] > 1 else ""
    return (f"E={s['effective_batch']}{w}, model {s['model_name']} (L={m['n_layer']} h={m['n_head']} d={m['d_model']} "
            f"V={m['vocab_size']}, {s['n_params']:,} params), S={s['seq_len']}, {s['device']}, fp32, "
            f"1 warm-up + {s['measured_steps']} measured optimizer steps per configuration, trainer {s['trainer']}")


def text_table(report) -> str:
    cols = _columns(report)
    head = ["sweep", "N", "B", "N·B", *[h for h, _ in cols]]
    body = []
    for c in report["configs"]:
        body.append([",".join(c["sweeps"]), str(c["N"]), str(c["B"]), str(c["eff"]),
                     *[_cells(report, c, fn) for _, fn in cols]])
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
    a = report.get("anchor")
    if a:
        for t in a["targets"]:
            ours = "—" if t["ours"] is None else f"{t['ours']:.4f}"
            out.append(f"(anchor) {t['status']:<8} {t['name']}: ours {ours}, plain torch {t['anchor']:.4f}, target {t['target']}")
    out.append(f"verdict: {report['verdict']}")
    return "\n".join(out)


def _md_table(report, configs) -> list[str]:
    cols = _columns(report)
    head = ["N", "B", "N·B", *[h for h, _ in cols]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for c in configs:
        lines.append("| " + " | ".join([str(c["N"]), str(c["B"]), str(c["eff"]),
                                        *[_cells(report, c, fn) for _, fn in cols]]) + " |")
    return lines


def _ours(report) -> str:
    x = next((x for c in report["configs"] for x in c["ranks"] if "error" not in x), {})
    o = x.get("optimizer")
    opt = "optimizer not exposed" if not o else (
        f"{o['cls']}(fused={o['fused']}, foreach={o['foreach']})" + (" (None/None: torch's default, foreach on CUDA)"
                                                                     if o["fused"] is None and o["foreach"] is None else ""))
    return f"`--trainer {report['settings']['trainer']}` = {x.get('trainer_class', '?')}, {opt}"


def render_md(report) -> str:
    s, g, mi = report["settings"], report["git"], report["machine_info"]
    E = s["effective_batch"]
    unit, _ = _unit(report)
    commit = (g.get("commit") or "unknown")[:12] + (" (dirty)" if g.get("dirty") else "")
    dev = mi["gpu"] + (f", driver {mi['driver']}" if mi.get("driver") else "") if mi.get("gpu") else \
        f"CPU ({mi.get('cpu_model') or 'unknown'}, {mi['cpu_count']} cores, {s['threads']} threads)"
    L = [f"# Peak memory vs accumulation steps, E = {E}: **{report['verdict']}**", "",
         f"`{report.get('command', 'python -m verify.memory')}` · commit `{commit}` · {report['created_utc']} · "
         f"{dev} · torch {mi['torch']}" + (f", CUDA {mi['cuda']}" if mi.get("cuda") else "") + f" · Python {mi['python']}",
         "", _header(report) + ".", "",
         "Gradient accumulation exists to save memory: an optimizer step over N micro-batches of B sequences should "
         "peak like ONE micro-batch (plus the gradient buffers, held across micro-steps), not like N·B sequences.",
         "", "## Verdicts", "", "| | invariant | verdict | evidence |", "|---|---|---|---|"]
    for v in report["invariants"]:
        ev = "<br>".join((v["rows"] or v["detail"]))
        L.append(f"| {v['id']} | {v['claim']} | **{v['status']}** | {ev} |")
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
    errs = [(c, x) for c in report["configs"] for x in c["ranks"] if "error" in x]
    if errs:
        L += ["Errors:", ""] + [f"- N={c['N']}, B={c['B']}, rank {x['rank']}: {x['error']}" for c, x in errs] + [""]
    st = report["static"]
    if st:
        L += ["## Static state", "",
              f"params {_fmt(st['param_bytes'], report)} + gradients {_fmt(st['grad_bytes'], report)} + optimizer "
              f"state {_fmt(st['optim_state_bytes'], report)} = **{_fmt(st['static_bytes'], report)} {unit}** "
              f"(bytes of the tensors, after the warm-up step; the optimizer state is read from the trainer's `.opt`).", ""]
    if a:
        L += ["## Beside plain torch on one H200 (the anchor)", "",
              f"Anchor: `{a['source']}` (../shared/anchors/torch_baseline.py: same model, fp32, TF32 off, warm-up "
              "step then 3 measured steps, AdamW(fused=True)). Ours: the trainer under test through the harness "
              f"interface: {_ours(report)}.", "",
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
          "- **step ms / tok/s**: wall time of the measured optimizer steps (synchronized at the end), tokens = N·B·S "
          "per rank; the CPU box is shared, so CPU timings are indicative only.", "",
          f"![peak vs N](memory-E{E}.png)", ""]
    return "\n".join(L)


def render_png(report) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = _unit(report)
    cuda = _cuda(report)
    E = report["settings"]["effective_batch"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    world = report["settings"]["world_size"]
    for ax, sweep, title in ((axes[0], "A", f"sweep A: fixed effective batch E={E} (B = E/N)"),
                             (axes[1], "B", "sweep B: fixed micro-batch B=1")):
        cs = sorted((c for c in report["configs"] if sweep in c["sweeps"]), key=lambda c: c["N"])
        ns = [c["N"] for c in cs]
        series = [("peak_bytes", "peak allocated" if cuda else "peak RSS above pre-step baseline", "-o")]
        if cuda:
            series += [("peak_reserved_bytes", "peak reserved", "--s"), ("nvml_peak_used_bytes", "nvml device used", ":^")]
        for r in range(world):
            for key, label, style in series:
                ys = [None if "error" in c["ranks"][r] or c["ranks"][r].get(key) is None else c["ranks"][r][key] / scale
                      for c in cs]
                if all(y is None for y in ys):
                    continue
                ax.plot(ns, [float("nan") if y is None else y for y in ys], style,
                        label=label + (f" (rank {r})" if world > 1 else ""))
        st = report["static"]
        if st:
            if cuda:
                ax.axhline(st["static_bytes"] / scale, color="k", lw=1, ls="-.",
                           label="static floor: params + grads + optimizer state")
            else:
                ax.axhline(st["grad_bytes"] / scale, color="k", lw=1, ls="-.",
                           label=f"floor in this figure: gradient buffers (params + optimizer state, {(st['param_bytes'] + (st['optim_state_bytes'] or 0)) / scale:.0f} {unit}, sit in the baseline)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("N (micro-steps per optimizer step)")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"peak memory vs N: {report['settings']['model_name']}, S={report['settings']['seq_len']}, "
                 f"{report['settings']['device']} ({report['verdict']})", fontsize=11)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_all(report, out: Path) -> list[Path]:
    """Render all three files first, then write temp files beside the targets and os.replace them: an error
    while rendering or writing leaves no partial report (and removes its temp files)."""
    stem = f"memory-E{report['settings']['effective_batch']}"
    files = {f"{stem}.json": None, f"{stem}.md": None, f"{stem}.png": None}
    try:
        files[f"{stem}.png"] = render_png(report)
    except ImportError:
        print("verify.memory: matplotlib is not installed; writing the report without the plot", file=sys.stderr)
        del files[f"{stem}.png"]
    files[f"{stem}.md"] = render_md(report).encode()
    files[f"{stem}.json"] = (json.dumps(report, indent=1, default=str) + "\n").encode()
    out.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    temps = []
    try:
        for name, data in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
            temps.append((tmp, out / name))
            os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a report is for people to read
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for tmp, final in temps:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    return [final for _, final in temps]
