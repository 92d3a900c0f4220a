"""The memory report beside a reference measurement (the anchor: e.g. plain torch, same model, protocol and
GPU kind) and the targets our numbers must meet against it. Which anchor applies to a run is the CLI's
choice (Plan.anchor; xtrain's: xtrain_proof/memory.py); this module only compares."""
from __future__ import annotations

import json
import math
from pathlib import Path

from verify.memory.invariants import REL_TOL
from verify.memory.plan import GiB, Plan


def target_ratio(anchor: list[dict]) -> float:
    """peak(N=32, B=1) / peak(N=1, B=32) of the anchor, rounded UP to 3 decimals: ours must not exceed it
    (plain torch on one H200: 2.0413 / 16.2643 GiB = 0.1255 -> 0.126)."""
    a = {(x["N"], x["B"]): x for x in anchor}
    return math.ceil(a[(32, 1)]["peak_alloc_gib"] / a[(1, 32)]["peak_alloc_gib"] * 1000) / 1000


def _source(path) -> str:
    """The anchor's path, relative to the installed package when it ships with it."""
    from verify.memory.runners import package_root

    try:
        return f"{Path(str(path)).resolve().relative_to(package_root()).as_posix()} (shipped with the package)"
    except ValueError:
        return str(path)


def compare_anchor(plan: Plan, rows: list[dict]) -> dict | None:
    """Our rows beside the anchor's (same model, protocol and GPU kind), and the targets."""
    if plan.anchor is None:
        return None
    anchor = json.loads(plan.anchor.read_text())
    by = {(x["N"], x["B"]): x for x in rows if "error" not in x}
    pairs = []
    for a in anchor:
        o = by.get((a["N"], a["B"]))
        pairs.append(dict(N=a["N"], B=a["B"], anchor=a, ours=None if o is None else dict(
            peak_alloc_gib=o["peak_bytes"] / GiB, peak_reserved_gib=o["peak_reserved_bytes"] / GiB,
            nvml_peak_gib=None if o.get("nvml_peak_used_bytes") is None else o["nvml_peak_used_bytes"] / GiB,
            step_ms=o["step_ms"], tok_s=o["tok_s"], static_gib=o["static_bytes"] / GiB)))
    a_by = {(a["N"], a["B"]): a for a in anchor}
    ratio = lambda d, key: d[(32, 1)][key] / d[(1, 32)][key]  # noqa: E731
    targets, target = [], target_ratio(anchor)
    ours_ratio = by[(32, 1)]["peak_bytes"] / by[(1, 32)]["peak_bytes"] if (32, 1) in by and (1, 32) in by else None
    targets.append(dict(name="peak allocated ratio (N=32,B=1)/(N=1,B=32)", target=f"≤ {target}",
                        ours=ours_ratio, anchor=ratio(a_by, "peak_alloc_gib"),
                        status="PASS" if ours_ratio is not None and ours_ratio <= target else "FAIL"))
    flat = [by[k]["peak_bytes"] for k in by if k[1] == 1 and k[0] >= 2]
    a_flat = [a["peak_alloc_gib"] for a in anchor if a["B"] == 1 and a["N"] >= 2]
    ours_spread = (max(flat) - min(flat)) / min(flat) if flat else None
    targets.append(dict(name="flatness at B=1, N ≥ 2: (max − min) / min", target=f"≤ {REL_TOL:.0%}",
                        ours=ours_spread, anchor=(max(a_flat) - min(a_flat)) / min(a_flat),
                        status="PASS" if ours_spread is not None and ours_spread <= REL_TOL else "FAIL"))
    return dict(source=_source(plan.anchor), note=plan.anchor_note, pairs=pairs, targets=targets)
