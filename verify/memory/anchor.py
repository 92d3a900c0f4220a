"""The memory report beside plain torch's: the shipped anchor (plain PyTorch, same model, protocol and GPU
kind, verify/memory/h200_torch_single_E32.json) and the targets our numbers must meet against it."""
from __future__ import annotations

import json

from .invariants import REL_TOL
from .plan import DEFAULT_ANCHOR, GiB, Plan

ANCHOR_TARGET_RATIO = 0.126
"""peak(N=32, B=1) / peak(N=1, B=32) plain torch gave on one H200 (2.0413 / 16.2643 GiB = 0.1255): ours
must not exceed it (rounded up)."""


def anchor_applies(plan: Plan) -> bool:
    """The anchor's setting: xtrain's options with the gpt2-ish GPT at S=512, E=32, one GPU."""
    from xtrain_core.config import PRESETS

    return (plan.anchor is not None and plan.cuda and plan.world == 1 and plan.E == 32
            and plan.model == PRESETS["gpt2-ish"] and plan.seq_len == 512)


def compare_anchor(plan: Plan, rows: list[dict]) -> dict | None:
    """Our rows beside plain torch's (same model, protocol and GPU kind), and the issue's targets."""
    if not anchor_applies(plan):
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
    targets = []
    ours_ratio = by[(32, 1)]["peak_bytes"] / by[(1, 32)]["peak_bytes"] if (32, 1) in by and (1, 32) in by else None
    targets.append(dict(name="peak allocated ratio (N=32,B=1)/(N=1,B=32)", target=f"≤ {ANCHOR_TARGET_RATIO}",
                        ours=ours_ratio, anchor=ratio(a_by, "peak_alloc_gib"),
                        status="PASS" if ours_ratio is not None and ours_ratio <= ANCHOR_TARGET_RATIO else "FAIL"))
    flat = [by[k]["peak_bytes"] for k in by if k[1] == 1 and k[0] >= 2]
    a_flat = [a["peak_alloc_gib"] for a in anchor if a["B"] == 1 and a["N"] >= 2]
    ours_spread = (max(flat) - min(flat)) / min(flat) if flat else None
    targets.append(dict(name="flatness at B=1, N ≥ 2: (max − min) / min", target=f"≤ {REL_TOL:.0%}",
                        ours=ours_spread, anchor=(max(a_flat) - min(a_flat)) / min(a_flat),
                        status="PASS" if ours_spread is not None and ours_spread <= REL_TOL else "FAIL"))
    src = f"verify/memory/{DEFAULT_ANCHOR.name} (shipped with verify)" if plan.anchor == DEFAULT_ANCHOR \
        else str(plan.anchor)
    return dict(source=src, pairs=pairs, targets=targets)


