"""The combined report of `python -m benchmarks.memory_modes`: one verify.memory report per data-parallel mode
-> STEM.json (every mode's full report inside), STEM.md (verdicts, flatness at fixed B, measured vs
predicted per mode and N, the model's terms), STEM.png (peak vs N per mode beside the prediction, and
measured vs predicted). Renders from the report dict alone."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from verify.memory import plot
from verify.memory.plan import fmt_bytes as _f
from verify.memory.plan import report_unit as _unit


def combined(verdicts: list[str]) -> str:
    """Every mode PASS: PASS; any mode FAIL or ERROR (or none ran): FAIL; else INCONCLUSIVE."""
    if not verdicts or any(v not in ("PASS", "N/A", "INCONCLUSIVE") for v in verdicts):
        return "FAIL"
    return "INCONCLUSIVE" if "INCONCLUSIVE" in verdicts else "PASS"




def _rows(rep: dict) -> list[dict]:
    rows = []
    for c in rep["configs"]:
        rows.append(dict(sweeps=c["sweeps"], N=c["N"], B=c["B"], measured=[x.get("peak_bytes") for x in c["ranks"]],
                         peak_bytes=c["peak_bytes"], predicted_bytes=c.get("predicted_bytes"),
                         ratio=[x.get("pred_ratio") for x in c["ranks"]], terms=c.get("predicted_terms"),
                         step_ms=[x.get("step_ms") for x in c["ranks"]]))
    return rows


def _flat(rep: dict) -> dict:
    """Fixed B = 1: the peaks by N (max over ranks) and invariant b1's verdict (flat within 2 % for N ≥ 2)."""
    cs = sorted((c for c in rep["configs"] if "B" in c["sweeps"]), key=lambda c: c["N"])
    b1 = next(v for v in rep["invariants"] if v["id"] == "b1")
    ok = [c["peak_bytes"] for c in cs if c["N"] >= 2 and c["peak_bytes"] is not None]
    return dict(N=[c["N"] for c in cs], peak_bytes=[c["peak_bytes"] for c in cs], status=b1["status"],
                spread_bytes=max(ok) - min(ok) if ok else None, spread_rel=(max(ok) - min(ok)) / min(ok) if ok else None)


def assemble(args, results: list[dict], argv, wall: float) -> dict:
    from verify import report_header

    head = report_header("memory-modes")
    first = next((r["report"] for r in results if r["report"] is not None), None)
    s = first["settings"] if first else {}
    modes = []
    for r in results:
        rep = r["report"]
        m = dict(mode=r["mode"], verdict=r["verdict"], error=r["error"], exit_code=r["exit_code"], wall_s=r["wall_s"],
                 command=r["command"])
        if rep is not None:
            m.update(trainer_class=next((x.get("trainer_class") for c in rep["configs"] for x in c["ranks"]
                                         if "error" not in x), None),
                     adapter=rep["settings"]["adapter"], invariants={v["id"]: v["status"] for v in rep["invariants"]},
                     model_check=(rep.get("prediction") or {}).get("verdict"), flat_fixed_B=_flat(rep), rows=_rows(rep),
                     report=rep)
        else:
            m.update(stderr_tail=r["stderr_tail"])
        modes.append(m)
    return dict(
        head, tool="benchmarks.memory_modes",
        command="python -m benchmarks.memory_modes " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        settings=dict(effective_batch=args.effective_batch, world_size=args.world, device=args.device,
                      model_name=s.get("model_name"), model=s.get("model"), n_params=s.get("n_params"),
                      seq_len=s.get("seq_len"), measured_steps=s.get("measured_steps"), warmup_steps=s.get("warmup_steps"),
                      threads=s.get("threads"), modes=[r["mode"] for r in results]),
        probe=first["probe"] if first else None,
        prediction_quantity=(first.get("prediction") or {}).get("quantity") if first else None,
        modes=modes, wall_s=wall,
        verdict=combined([r["verdict"] for r in results]))


def _cells(vals, fmt) -> str:
    v = ["—" if x is None else fmt(x) for x in vals]
    return v[0] if len(set(v)) == 1 else " / ".join(v)


def text_table(report) -> str:
    unit, _ = _unit(report)
    head = ["mode", "sweep", "N", "B", f"peak {unit}", f"pred {unit}", "meas/pred"]
    body = []
    for m in report["modes"]:
        for r in m.get("rows", []):
            body.append([m["mode"], ",".join(r["sweeps"]), str(r["N"]), str(r["B"]),
                         _cells(r["measured"], lambda b: _f(b, report)), _f(r["predicted_bytes"], report),
                         _cells(r["ratio"], lambda x: f"{x:.2f}")])
    w = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    line = lambda r: "  ".join(v.ljust(w[i]) if i < 2 else v.rjust(w[i]) for i, v in enumerate(r))  # noqa: E731
    s = report["settings"]
    out = [f"memory per mode: E={s['effective_batch']}, world {s['world_size']}, {s['device']}, model {s['model_name']}, "
           f"S={s['seq_len']} (per-rank values r0 / r1 / ... where they differ)", line(head), *map(line, body)]
    for m in report["modes"]:
        inv = " ".join(f"{k}:{v}" for k, v in (m.get("invariants") or {}).items())
        out.append(f"{m['mode']:<11} {m['verdict']:<5} {m['wall_s']:6.1f} s  " +
                   (f"{inv} model:{m.get('model_check')}" if m.get("invariants") else m["error"]))
    out.append(f"verdict: {report['verdict']}")
    return "\n".join(out)


def render_md(report, stem: str) -> str:
    s, mi = report["settings"], report["machine_info"]
    unit, _ = _unit(report)
    sha, dirty = report.get("git_commit"), (report.get("git") or {}).get("dirty")  # verify.report_header's fields
    commit = f"commit `{sha[:12]}{' (dirty)' if dirty else ''}`" if sha else "not a git checkout"
    dev = mi["gpu"] if mi.get("gpu") and s["device"] == "cuda" else f"CPU ({mi.get('cpu_model') or 'unknown'}, {mi['cpu_count']} cores)"
    L = [f"# Peak memory per data-parallel mode, E = {s['effective_batch']}, W = {s['world_size']}: **{report['verdict']}**", "",
         f"`{report['command']}` · {commit} · {report['utc']} · {dev} · torch {mi['torch']} · "
         f"{report['wall_s']:.0f} s in all", "",
         f"Model {s['model_name']} ({s['n_params'] or 0:,} params), S = {s['seq_len']}, fp32, {s['warmup_steps']} warm-up + "
         f"{s['measured_steps']} measured optimizer steps per configuration, every configuration per rank "
         f"(E = N × B × W, B per rank). One `torchrun -m verify.memory --trainer MODE` per mode.", "",
         "## Verdicts", "", "| mode | trainer | a1 | a2 | b1 flat at B=1 | b2 | model check | verdict | wall s |",
         "|---|---|---|---|---|---|---|---|---:|"]
    for m in report["modes"]:
        if m.get("invariants"):
            i = m["invariants"]
            L.append(f"| {m['mode']} | {m['trainer_class']} | {i['a1']} | {i['a2']} | {i['b1']} | {i['b2']} | "
                     f"{m['model_check']} | **{m['verdict']}** | {m['wall_s']:.0f} |")
        else:
            L.append(f"| {m['mode']} | — | | | | | | **{m['verdict']}**: {m['error']} | {m['wall_s']:.0f} |")
    ns = sorted({n for m in report["modes"] if m.get("flat_fixed_B") for n in m["flat_fixed_B"]["N"]})
    L += ["", f"## Fixed micro-batch B = 1: is the peak flat in N? ({unit}, max over ranks)", "",
          "| mode | " + " | ".join(f"N={n}" for n in ns) + " | spread N ≥ 2 | b1 |", "|---|" + "---:|" * (len(ns) + 2)]
    for m in report["modes"]:
        fl = m.get("flat_fixed_B")
        if fl:
            by = dict(zip(fl["N"], fl["peak_bytes"]))
            sp = "—" if fl["spread_bytes"] is None else f"{_f(fl['spread_bytes'], report)} ({fl['spread_rel']:.1%})"
            L.append(f"| {m['mode']} | " + " | ".join(_f(by.get(n), report) for n in ns) + f" | {sp} | {fl['status']} |")
    L += ["", f"## Measured vs predicted ({unit} per rank)", "",
          "| mode | sweep | N | B | measured (r0 / r1 …) | predicted | measured / predicted |", "|---|---|---:|---:|---:|---:|---:|"]
    for m in report["modes"]:
        for r in m.get("rows", []):
            L.append(f"| {m['mode']} | {','.join(r['sweeps'])} | {r['N']} | {r['B']} | "
                     f"{_cells(r['measured'], lambda b: _f(b, report))} | {_f(r['predicted_bytes'], report)} | "
                     f"{_cells(r['ratio'], lambda x: f'{x:.2f}')} |")
    L += ["", "## The model's terms at B = 1 (what the prediction counts)", ""]
    for m in report["modes"]:
        for n in (1, 2):
            r = next((r for r in m.get("rows", []) if r["B"] == 1 and r["N"] == n and r["terms"]), None)
            if r:
                L.append(f"- **{m['mode']}**, N = {n}: " + " + ".join(f"{k} {_f(v, report)}" for k, v in r["terms"].items())
                         + f" = {_f(r['predicted_bytes'], report)} {unit}")
    pr = report.get("probe") or {}
    L += ["", "## What the figures are", "", f"- **measured**: {pr.get('primary')}. {pr.get('includes')}",
          f"- **predicted** (`xtrain_proof/memory.py`): {report.get('prediction_quantity')}.",
          "- **model check**: measured / predicted outside [0.25, 4] (for predictions ≥ 4 × the noise floor) fails "
          "the run; inside, the ratio is reported, not judged. The invariants (a1, a2, b1, b2) are the verdict.",
          "- Each mode's full verify.memory report is inside the JSON (`modes[].report`).", "",
          f"![peak vs N per mode]({stem}.png)", ""]
    return "\n".join(L)


def write_all(report, out: Path, stem: str) -> list[Path]:
    from verify import atomic_write

    files = {out / f"{stem}.json": json.dumps(report, indent=1, default=str) + "\n", out / f"{stem}.md": render_md(report, stem)}
    try:
        files[out / f"{stem}.png"] = plot.to_png(modes_figure(report))
    except ImportError:
        print("benchmarks.memory_modes: matplotlib is not installed; writing the report without the plot", file=sys.stderr)
    return [Path(p) for p in atomic_write(files)]


def modes_figure(report):
    """Three panels: B = 1 sweep and fixed-E sweep per mode (measured, predicted), measured vs predicted."""
    plt = plot._plt()
    unit, scale = _unit(report)
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.0), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    E_local = report["settings"]["effective_batch"] // report["settings"]["world_size"]
    for k, m in enumerate(report["modes"]):
        col = colors[k % len(colors)]
        for ax, sweep in ((axes[0], "B"), (axes[1], "A")):
            rs = sorted((r for r in m.get("rows", []) if sweep in r["sweeps"]), key=lambda r: r["N"])
            if not rs:
                continue
            ns = [r["N"] for r in rs]
            ax.plot(ns, [float("nan") if r["peak_bytes"] is None else r["peak_bytes"] / scale for r in rs], "-o",
                    color=col, label=f"{m['mode']} measured")
            if any(r["predicted_bytes"] for r in rs):
                ax.plot(ns, [float("nan") if r["predicted_bytes"] is None else r["predicted_bytes"] / scale for r in rs],
                        "--x", color=col, lw=1, label=f"{m['mode']} predicted")
        pts = [(r["predicted_bytes"] / scale, x / scale) for r in m.get("rows", []) if r["predicted_bytes"]
               for x in r["measured"] if x is not None]
        if pts:
            axes[2].plot(*zip(*pts), "o", color=col, alpha=0.8)
    for ax, title in ((axes[0], "fixed micro-batch B = 1 (flat in N for N ≥ 2?)"),
                      (axes[1], f"fixed effective batch per rank {E_local} (B = {E_local}/N)")):
        ax.set_xscale("log", base=2)
        ns = sorted({int(x) for ln in ax.get_lines() for x in ln.get_xdata()})
        if ns:
            ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("N (micro-steps per optimizer step)")
        ax.set_ylabel(f"peak {unit} per rank")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    lim = max([1.0] + [max(ln.get_xdata().max(), ln.get_ydata().max()) for ln in axes[2].get_lines()])
    axes[2].plot([0, lim * 1.05], [0, lim * 1.05], "k:", lw=1, label="measured = predicted")
    axes[2].set_xlabel(f"predicted {unit}")
    axes[2].set_ylabel(f"measured {unit} (each rank)")
    axes[2].set_title("measured vs predicted, every configuration (colour = mode)", fontsize=10)
    axes[2].grid(alpha=0.3)
    plot.legend_below(fig, axes, ncol=5)
    s = report["settings"]
    fig.suptitle(f"peak memory per data-parallel mode: {s['model_name']}, S={s['seq_len']}, E={s['effective_batch']}, "
                 f"W={s['world_size']}, {s['device']} ({report['verdict']})", fontsize=11)
    return fig
