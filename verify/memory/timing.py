"""Is the timing of a verify.memory run trustworthy? (Peaks are; times on a shared box may not be.)

A configuration's timing is flagged UNSTABLE, with the reason, when
  - its measured steps disagree: slowest / fastest > SPREAD (needs ≥ 2 measured steps), or
  - the process's threads spent more than CPU_WAIT of the measured steps' wall time runnable but waiting
    for a core (Linux schedstat, summed over threads): other processes held the cores — the 234 s step of
    a busy 2-core box, where the memory measurement itself is still right. Spinning or sleeping OpenMP
    threads alike: a thread that waits for a core is counted however it would have used it.
This never changes the memory verdict; it says which step times and token rates not to compare, so a run
that is slow for a reason outside it says so instead of silently taking minutes.
"""
from __future__ import annotations

SPREAD = 2.0
CPU_WAIT = 0.5  # thread-seconds waiting for a core per second of wall time

__all__ = ["unstable", "SPREAD", "CPU_WAIT"]


def _one(x: dict) -> str | None:
    steps = x.get("step_s") or []
    why = []
    if len(steps) >= 2 and min(steps) > 0 and max(steps) / min(steps) > SPREAD:
        why.append(f"measured steps {min(steps):.3g}–{max(steps):.3g} s ({max(steps) / min(steps):.1f}× apart, "
                   f"> {SPREAD:g}×)")
    wait = x.get("cpu_wait")
    if wait is not None and wait > CPU_WAIT:
        why.append(f"its threads waited {wait:.2f} s for a core per second of wall time (> {CPU_WAIT:g}: other "
                   "processes held the cores)")
    return "; ".join(why) or None


def unstable(per_rank: list[list[dict]]) -> list[str]:
    """One line per configuration (and rank) whose timing is not to be trusted; [] when all are steady."""
    world = len(per_rank)
    out = []
    for rows in per_rank:
        for x in rows:
            if "error" in x:
                continue
            why = _one(x)
            if why:
                who = f"rank {x.get('rank', 0)}: " if world > 1 else ""
                out.append(f"{who}N={x['N']},B={x['B']}: {why}")
    return out
