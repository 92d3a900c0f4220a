"""The run report's tallies from several processes as one: under pytest-xdist each worker ships its tallies
(report.dump()) to the controller, which merges them here, key by key, into what one process recording every
example would hold. So a serial run and a parallel run of the same examples give the same report
(docs/design/layout.md, "The report"; tests/harness/test_report_keys.py records every kind of result, split in two).
"""
from __future__ import annotations

import json

from verify._internal.report import LARGEST, LINK_KEYS

__all__ = ["merge"]

# how each tally key (report.record and its helpers) merges
SUMMED = ("examples", "skipped", "expected_before_boundary", "declared_side_traffic", "uneven_examples",
          "packed_examples", "packed_halved", "clipped_steps", "steps")
UNITED = ("worlds", "meshes", "axes_not_counted")
RANGES = ("boundary_bytes_over_gradient_bytes", "boundary_collectives_per_step", *LINK_KEYS)  # [lo, hi]
WORST = ("worst_ratio", "worst_check", "worst_case", "worst_case_text")  # one case, kept whole
KNOWN = (*SUMMED, *UNITED, *RANGES, *WORST, "float64_floor", "checked", "unchecked", "skip_reason", "budget")


def merge(into: dict, blob: str) -> None:
    """A worker's tallies (report.dump()) into `into`. A key not in KNOWN (a tally added later) is summed where
    it is an int, united where a list, else the first value stands: a count is never dropped."""
    for gate, s in json.loads(blob).items():
        t = into.setdefault(gate, s)
        if t is s:
            continue
        for key, v in s.items():
            if key in WORST:
                continue
            old = t.get(key)
            if key in RANGES:
                t[key] = v if old is None else [min(old[0], v[0]), max(old[1], v[1])]
            elif key == "float64_floor":
                t[key] = max(v, old or 0.0)
            elif key == "checked":  # steps checked per metric
                t[key] = {n: (old or {}).get(n, 0) + (v or {}).get(n, 0) for n in {*(old or {}), *v}}
            elif key == "unchecked":  # why a metric was not checked: the first reason stands
                t[key] = {**v, **(old or {})}
            elif key in SUMMED or (key not in KNOWN and isinstance(v, int) and not isinstance(v, bool)):
                t[key] = (old or 0) + v
            elif key in UNITED or (key not in KNOWN and isinstance(v, list)):
                t[key] = sorted(set(old or []) | set(v))
            elif old is None:  # skip_reason, and anything else: the first value stands
                t[key] = v
        if s.get("worst_case") is not None and (t.get("worst_case") is None or _worse(gate, s, t)):
            t.update({k: s.get(k) for k in WORST})


def _worse(gate: str, s: dict, t: dict) -> bool:
    """Whether tally `s`'s worst case beats `t`'s as report.record would rank them: the larger world × N for an
    exact gate (report.LARGEST), else the larger error / bound; a tie keeps t's (record keeps the first)."""
    if gate.split("@")[0] in LARGEST:
        a, b = s["worst_case"], t["worst_case"]
        return a["world"] * a["accum_steps"] > b["world"] * b["accum_steps"]
    return s["worst_ratio"] > t["worst_ratio"]
