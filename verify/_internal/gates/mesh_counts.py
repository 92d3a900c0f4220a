"""Counts per mesh axis: every collective of a mesh run attributed to the axis whose group it ran on.

A collective's axis is its process group's ("mesh_dp" / "mesh_pp" / "mesh_cp" / "mesh_tp" from init_device_mesh; an axis
spanning the world reuses the default group). A row's unit is an OUTER step (pipeline_chunks micro-steps);
`counts(case)` gives axis -> CountRow (or a function of the rank's coordinates). dp without a row: the
boundary-only rule; pp / tp declared: exact by family; undeclared: reported, not judged; a collective on no
mesh axis inside the trainer's calls fails, naming its group.

Design: docs/design/distributed.md, "Mesh axes" ("Counts per axis").
"""
from __future__ import annotations

from verify._internal.cases.case import Case
from verify._internal.ranks.comm import Collective, family
from verify._internal.ranks.mesh import AXES, Mesh
from verify._internal.verdict import Gate, GateFailure
from verify._internal.gates.counts import CountRow, as_row, check_step
from verify._internal.gates.distributed import _split

__all__ = ["axis_of", "check_mesh_counts", "outer_units", "DP_ROW"]

DP_ROW = CountRow("dp: boundary-only", before={}, boundary=None)  # the dp axis of a trainer that declares none


def axis_of(c: Collective, mesh: Mesh) -> str | None:
    """The mesh axis of the group `c` ran on; None for the default group (unless one axis spans the world)
    and for any other group."""
    desc = c.pg.partition(" ")[2].strip("'\"")
    if desc.startswith("mesh_") and desc[5:] in AXES:
        return desc[5:]
    # the whole world's axis: torch 2.13's DeviceMesh reuses the default group ("default_pg"), torch 2.11's builds
    # a group over every rank described "mesh_default" (seen on an H200 box, gloo, tp=2 of 2 ranks)
    whole = [a for a in AXES if getattr(mesh, a) == mesh.size > 1]
    return whole[0] if desc in ("default_pg", "mesh_default") and whole else None


def outer_units(micro: list, boundary: list, chunks: int) -> tuple[list, list]:
    """One step's per-micro-step collectives (0..N-2) and its boundary -> per outer step (0..S-2) and the
    last outer step with the boundary."""
    N = len(micro) + 1
    S = N // chunks
    units = [[c for m in range(j * chunks, (j + 1) * chunks) for c in micro[m]] for j in range(S - 1)]
    return units, [c for m in range((S - 1) * chunks, N - 1) for c in micro[m]] + list(boundary)


def _row(rows: dict, axis: str, coords) -> CountRow | None:
    r = rows.get(axis)
    if not callable(r):
        return r
    return as_row(r(*coords), f"counts(case)[{axis!r}]{tuple(coords)} (dp_i, pp_i, tp_i)")


def check_mesh_counts(outcomes, case: Case, rows: dict | None, expected=()) -> dict:
    """Every rank's collectives, by axis and outer step, against `rows` (axis -> CountRow or coords -> CountRow;
    dp defaults to DP_ROW). Raises GateFailure (Gate.BOUNDARY_ONLY) on the first violation. Returns what was
    counted: {"judged": axes judged, "unjudged": active axes without a row, "seen": {(rank, axis): families}}."""
    mesh, gate, rows = case.mesh, Gate.BOUNDARY_ONLY, dict(rows or {})
    if set(rows) - set(AXES):
        raise ValueError(f"counts for a mesh case must be keyed by axis ({', '.join(AXES)}), got {sorted(rows)}")
    S = case.accum_steps // case.pipeline_chunks
    out = {"judged": sorted({"dp"} | set(rows), key=AXES.index),
           "unjudged": [a for a in mesh.axes() if a != "dp" and a not in rows], "seen": {}}
    for o in outcomes:
        coords = mesh.coords(o.rank)
        for dt, run in o.runs.items():
            cp = f" cp={mesh.cp_of(o.rank)}" if mesh.cp > 1 else ""
            who = (f"rank {o.rank} (dp={coords[0]} pp={coords[1]} tp={coords[2]}{cp}, {dt.replace('torch.', '')} run)")
            desc = lambda c: c.describe(run.main_thread)  # noqa: E731

            def fail(msg):
                raise GateFailure(f"[{gate}] {case.mesh}, chunks={case.pipeline_chunks}, outer={S}: {who}, {msg}; "
                                  f"case {case}", gate=gate, case=case)

            steps, _init, stray = _split(run, case)
            for where, c in stray[:1]:
                fail(f"gradient-like collective {where}: {desc(c)}")
            for k, s in enumerate(steps):
                units, last = outer_units(s.micro, s.boundary, case.pipeline_chunks)
                for j, cs in enumerate(units + [last]):
                    off = [c for c in cs if axis_of(c, mesh) is None]
                    if off:
                        fail(f"step {k}, outer step {j} of {S}: {len(off)} collective(s) on no mesh axis: "
                             f"{'; '.join(desc(c) for c in off[:3])} — a mesh trainer communicates over its "
                             f"device mesh's dp / pp / tp groups (verify._internal.ranks.mesh.device_mesh)")
                for axis in AXES:
                    mine = lambda cs: [c for c in cs if axis_of(c, mesh) == axis]  # noqa: E731,B023
                    got_units, got_last = [mine(u) for u in units], mine(last)
                    seen = out["seen"].setdefault((o.rank, axis), {})
                    for c in got_last + [c for u in got_units for c in u]:
                        seen[family(c.op)] = seen.get(family(c.op), 0) + 1
                    row = _row(rows, axis, coords) or (DP_ROW if axis == "dp" else None)
                    if row is None:
                        continue
                    _, msg = check_step(row, got_units, got_last, k, getattr(mesh, axis), expected, desc)
                    if msg:  # check_step's unit is our outer step (chunks micro-steps, one schedule step)
                        unit = msg if case.pipeline_chunks == 1 else msg.replace("micro-step", "outer step")
                        fail(f"axis {axis} (an outer step: {case.pipeline_chunks} micro-step(s)): {unit}")
                    if axis == "dp" and mesh.dp > 1 and not [c for c in got_last if c.floating and
                                                              family(c.op) in ("all_reduce", "reduce_scatter")]:
                        fail(f"axis dp, step {k}, boundary: no floating reduction over dp — the {mesh.dp} replicas' "
                             f"gradients must be reduced once at the boundary")
    return out
