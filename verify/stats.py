"""Per-run gate statistics, and the report the pytest controller writes once at the end.

Tests call `record(gate, ok=..., ratio=..., where=...)` per example. Under xdist each worker ships its
tallies to the controller through `workeroutput`; only the controller (or a plain -n0 run) writes
reports/verify-<profile>.json, atomically, with schema_version, machine_info, git commit and UTC time.
"""
from __future__ import annotations

import json

_STATS: dict[str, dict] = {}


def record(gate: str, *, ratio: float | None = None, where: str = "") -> None:
    s = _STATS.setdefault(gate, {"examples": 0, "worst_ratio": 0.0, "worst": ""})
    s["examples"] += 1
    if ratio is not None and ratio > s["worst_ratio"]:
        s["worst_ratio"], s["worst"] = ratio, where


def dump() -> str:
    return json.dumps(_STATS)


def merge(into: dict, blob: str) -> None:
    for gate, s in json.loads(blob).items():
        t = into.setdefault(gate, {"examples": 0, "worst_ratio": 0.0, "worst": ""})
        t["examples"] += s["examples"]
        if s["worst_ratio"] > t["worst_ratio"]:
            t["worst_ratio"], t["worst"] = s["worst_ratio"], s["worst"]
