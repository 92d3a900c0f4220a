"""The figures of verify.memory: peak vs N for one run (`peaks_figure`), and `to_png` (the memory-modes
study's figure, benchmarks/memory_modes_report.py, uses the same layout). matplotlib is imported here only,
so the reports render without it.

Layout rule for every panel: the legend never sits on the axes. One legend for the whole figure goes
below the panels (labels wrapped to a width), so it can neither cover a point (N = 1 is where the peaks
start, in the corner a default legend picks) nor run past the axes with a long label; constrained layout
makes room for it.
"""
from __future__ import annotations

import io
import textwrap

from verify.memory.plan import report_unit

LABEL_WIDTH = 48  # characters per legend line


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def legend_below(fig, axes, ncol: int = 3) -> None:
    """One figure legend under the panels: every distinct label of `axes`, wrapped to LABEL_WIDTH."""
    seen, handles, labels = set(), [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in seen:
                seen.add(lab)
                handles.append(h)
                labels.append(textwrap.fill(lab, LABEL_WIDTH))
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(ncol, len(handles)), fontsize=7,
                   frameon=False)


def to_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    _plt().close(fig)
    return buf.getvalue()


def peaks_figure(report):
    """Two panels (sweep A at fixed E, sweep B at B = 1): the probe's peaks per rank, the model's
    prediction where there is one, the static floor."""
    plt = _plt()
    cuda = report["settings"]["device"].startswith("cuda")
    unit, scale = report_unit(report)
    E = report["settings"]["effective_batch"]
    world = report["settings"]["world_size"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), layout="constrained")
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
        pred = [c.get("predicted_bytes") for c in cs]
        if any(p is not None for p in pred):
            ax.plot(ns, [float("nan") if p is None else p / scale for p in pred], "k--x", lw=1,
                    label=f"predicted ({report['prediction']['mode']}, verify/memory/model.py)")
        st = report["static"]
        if st:
            if cuda:
                ax.axhline(st["static_bytes"] / scale, color="k", lw=1, ls="-.",
                           label="static floor: params + grads + optimizer state")
            elif not any(p is not None for p in pred):  # with a prediction, the model says what the step adds
                base = (st["param_bytes"] + (st["optim_state_bytes"] or 0)) / scale
                ax.axhline(st["grad_bytes"] / scale, color="k", lw=1, ls="-.",
                           label=f"floor in this figure: gradient buffers (params + optimizer state, "
                                 f"{base:.0f} {unit}, sit in the baseline)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("N (micro-steps per optimizer step)")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    legend_below(fig, axes)
    s = report["settings"]
    what = f"{s['model_name']}, S={s['seq_len']}" if s.get("model_name") else (s.get("adapter_name") or s["trainer"])
    fig.suptitle(f"peak memory vs N: {what}, {s['device']} ({report['verdict']})", fontsize=11)
    return fig
