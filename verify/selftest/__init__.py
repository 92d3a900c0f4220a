"""The fault-injection self-test: proof that the gates are live for YOUR trainer.

Every operator of verify.selftest.operators wraps the adapter's trainer and plants one bug; the gates then run
on the wrapped trainer over fixed cases built from the adapter's `defaults` (single-process, a long window in
a low precision, every data-parallel world, meshes; padded for an adapter with an ignore_index). A mutant runs
case by case until a gate rejects it (`--every-case`: the whole matrix); a run that raises is an "error" cell,
never a kill. Score = killed / operators whose bug can exist for this adapter; the unwrapped trainer must pass
every gate on every case, at every world.

Entry points: `run_selftest`, `python -m verify.selftest`. The cases and the cells: docs/design/self-test.md.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field

from verify._internal.gates.windows import LONG_N, LOW_PRECISIONS
from verify._internal.verdict import Gate, GateFailure
from verify.selftest.operators import OPERATORS, Operator

__all__ = ["run_selftest", "OPERATORS", "Operator", "SelftestResult", "GATES", "NOT_RUN"]

# the table's columns: the gates the self-test runs (split invariance, partial sums, empty windows and bytes per
# step are the plugin's: the self-test's fixed cases do not draw their windows)
GATES = (Gate.EQUIVALENCE, Gate.BIT_EXACT, Gate.NORMALISER, Gate.LONG_WINDOW, Gate.BOUNDARY_ONLY, Gate.DP_EQUIVALENCE,
         Gate.OVERFLOW, Gate.MESH_EQUIVALENCE, Gate.REPORTED_METRICS)
DP = (Gate.BOUNDARY_ONLY, Gate.DP_EQUIVALENCE)  # the two verdicts of one data-parallel run (check_distributed)
MESHED = (Gate.BOUNDARY_ONLY, Gate.MESH_EQUIVALENCE)  # the mesh gate's two verdicts: its counter per axis, its numbers
ERROR = "error"  # a cell where a run raised instead of reaching a verdict, or the unwrapped trainer fails there
MAX_CAUSE = 300  # characters of an error's one-line cause
NOT_RUN = "not run"  # the mutant was already killed by an earlier case (run_selftest(every_case=True) runs it)
DIST = {1: (3, 2), 2: (3, 2), 3: (2, 1), 4: (2, 1)}  # world -> (N, B) of its data-parallel case
PAD = (1.0, 0.0, 0.25, 1.0, 0.5, 0.0, 1.0)  # valid share of a row, cycled: uneven micro-batches and ranks


def _padded(adapter, case):
    """`case` with fixed padding (adapters with an ignore_index): row i of step k keeps PAD[(i + 2k) % 7] of
    its S targets (at least one where the share is not 0); every window keeps some valid target."""
    if adapter.ignore_index is None:
        return case
    S = int(adapter.batch(1, 0, case.options)[1].reshape(1, -1).shape[1])
    E = case.effective_batch
    lengths = [max(1, round(S * PAD[(i + 2 * k) % len(PAD)])) if PAD[(i + 2 * k) % len(PAD)] else 0
               for k in range(case.steps) for i in range(E)]
    return case.replace(lengths=tuple(lengths))


def selftest_cases(adapter, *, worlds=(1, 2, 3), device: str = "cpu"):
    from functools import partial

    from verify._internal.cases.case import Case
    from verify._internal.objective import window_terms

    o = adapter.defaults
    case = partial(Case, terms=window_terms(adapter))  # a declared per_micro term is left out, as the gates do
    single = [case(accum_steps=1, micro_batch=2, steps=2, seed=1, data_seed=11, device=device, options=o),
              case(accum_steps=3, micro_batch=2, steps=2, seed=2, data_seed=12, device=device, options=o),
              case(accum_steps=4, micro_batch=1, steps=3, seed=3, data_seed=13, device=device, options=o)]
    dist = []
    if adapter.data_parallel:
        dist = [case(accum_steps=DIST[w][0], micro_batch=DIST[w][1], steps=2, world=w, seed=4 + w, data_seed=20 + w,
                     device=device, options=o) for w in worlds if w in DIST]
        if getattr(adapter, "uneven", False) and 2 in worlds:  # last: rank 1 holds 4 rows in 2 micro-steps, rank 0 6 in 3
            dist.append(case(accum_steps=3, micro_batch=2, steps=2, world=2, seed=9, data_seed=29, device=device,
                             options=o, rank_rows=((2, 2, 2), (3, 1))))
    single = [_padded(adapter, c) for c in single]
    low = [p for p in LOW_PRECISIONS if p in adapter.precisions]
    if low:
        single.append(case(accum_steps=LONG_N, micro_batch=1, steps=1, seed=5, data_seed=15, device=device, options=o,
                           precision=low[0]))  # unpadded: only low_precision_accumulation runs there
    return single, [_padded(adapter, c) for c in dist]


def mesh_cases(adapter, top: int, device: str = "cpu") -> list:
    """The fixed mesh cases of an adapter with mesh_axes, on at most `top` ranks (module docstring)."""
    from verify._internal.cases.case import Case
    from verify._internal.ranks.mesh import Mesh, unsupported

    axes, out = adapter.mesh_axes or (), []
    if "pp" in axes:
        out.append((Mesh(pp=2), 2, 4))  # (mesh, chunks, N): two schedule steps of two micro-batches
    if "tp" in axes:
        out.append((Mesh(tp=2), 1, 3))
    if "dp" in axes:
        wide = (Mesh(dp=2, tp=2), 1, 3) if "tp" in axes else (Mesh(dp=2, pp=2), 2, 4) if "pp" in axes else None
        out.append(wide if wide and top >= 4 else (Mesh(dp=2), 1, 3))
    from verify._internal.objective import window_terms

    return [Case(accum_steps=n, micro_batch=2, steps=2, world=m.dp, mesh=m, pipeline_chunks=ch, seed=30 + i,
                 data_seed=40 + i, device=device, options=adapter.defaults, terms=window_terms(adapter))
            for i, (m, ch, n) in enumerate(out) if m.size <= top and unsupported(m, adapter.mesh_sizes) is None]


def _column(check: Gate, failure: GateFailure) -> Gate:
    """The column a failure of `check` goes to, read from its `gate` field: a data-parallel run fails either the
    counter (boundary-only) or, for anything else it raises (the numbers, a determinism diagnosis of them, a
    trainer writing into its batch), data-parallel equivalence; every other check's failure is its own."""
    if failure.gate is Gate.REPORTED_METRICS:  # a data-parallel or mesh run judges its reported metrics last
        return Gate.REPORTED_METRICS
    if check in (Gate.DP_EQUIVALENCE, Gate.MESH_EQUIVALENCE):  # the mesh gate's counter too: per axis
        return Gate.BOUNDARY_ONLY if failure.gate is Gate.BOUNDARY_ONLY else check
    return check


def _checks(adapter, case, plain: bool, dist: bool) -> list:
    """[(gate, check, columns)] that one case runs (a mesh case: the mesh gate; dist: the data-parallel gates, at
    any world, 1 included; else the single-process ones); `columns`: the table cells that one check fills."""
    from verify._internal.gates import check_bit_exact, check_distributed, check_equivalence, check_normaliser
    from verify._internal.gates.windows import check_long_window

    if case.mesh is not None:
        from verify._internal.gates.mesh import check_mesh

        checks = [(Gate.MESH_EQUIVALENCE, check_mesh)]
    elif case.accum_steps >= LONG_N:
        checks = [(Gate.LONG_WINDOW, check_long_window)]
    elif not dist:
        checks = [(Gate.EQUIVALENCE, check_equivalence)] + ([(Gate.BIT_EXACT, check_bit_exact)]
                                                            if plain and case.accum_steps == 1 else [])
        # the normaliser gate: on padded cases, and on every case of a declared objective without padding
        if case.lengths is not None or (adapter.objective is not None and adapter.ignore_index is None):
            checks += [(Gate.NORMALISER, check_normaliser)]
        if adapter.metrics is not None:
            from verify._internal.gates.metrics import check_metrics

            # a reporting bug's mutant is judged by the metrics gate first: the others cannot see it
            first = getattr(adapter.mutation, "metric", "")
            checks.insert(0 if first else len(checks), (Gate.REPORTED_METRICS, check_metrics))
    else:
        checks = [(Gate.DP_EQUIVALENCE, check_distributed)]
        from verify._internal.gates.overflow import check_overflow, overflow_hook

        if overflow_hook(adapter)[0] is not None:
            checks.append((Gate.OVERFLOW, lambda a, c: check_overflow(a, c.replace(precision="fp16"), 0, c.world - 1)))
    if adapter.native is not None:  # no float64 path: only the gates that judge a native trainer (the gate table's)
        from verify._internal.gates.table import TABLE

        checks = [(name, check) for name, check in checks if TABLE[name].native]
    metrics = (Gate.REPORTED_METRICS,) if adapter.metrics is not None else ()  # a world's run judges its metrics too
    return [(name, check, DP + metrics if name is Gate.DP_EQUIVALENCE else MESHED + metrics
             if name is Gate.MESH_EQUIVALENCE else (name,)) for name, check in checks]


def _cause(e: BaseException) -> str:
    """An exception in one line: its type, its message's first line and where it was raised (file:line); for a
    pool job that failed on a rank (DistJobError), the rank's own last traceback line too."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    out = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    raised = [i for i, ln in enumerate(lines) if ln.startswith("--- rank ") and ln.endswith(" raised:")]
    if raised:  # the first failing rank's exception: the last line of its traceback
        part = lines[raised[0] + 1:next((i for i in range(raised[0] + 1, len(lines)) if lines[i].startswith("--- rank")),
                                        len(lines))]
        out += f" — {part[-1].strip()}" if part else ""
    else:
        tb = traceback.extract_tb(e.__traceback__)
        out += f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return out if len(out) <= MAX_CAUSE else out[:MAX_CAUSE - 1] + "…"


def _run_gates(adapter, case, plain: bool, dist: bool, settled=frozenset(), first_kill: bool = False) -> dict:
    """Gate -> 'pass' | 'kill: <message>' | 'error: <cause>' for one adapter on one case (`_checks`): 'kill' only
    for a gate's rejection (GateFailure), 'error' for any other exception (the run crashed, the data maker or a
    pool job failed, a job timed out: no gate judged). A check whose every column is in `settled` (already
    'rejects' for this mutant, or broken on the unwrapped trainer) is not run; with first_kill none runs after
    the first that rejects (their columns are absent)."""
    out = {}
    checks = [(name, check, columns) for name, check, columns in _checks(adapter, case, plain, dist)
              if not set(columns) <= set(settled)]
    for name, check, columns in checks:
        try:
            check(adapter, case)
            out.update(dict.fromkeys(columns, "pass"))
        except GateFailure as e:
            gate = _column(name, e)
            out[gate] = "kill: " + str(e).splitlines()[0]
            at = columns.index(gate) if gate in columns else 0
            for i, c in enumerate(columns):  # one run judges its columns in order: counter, numbers, metrics
                if c != gate:
                    out.setdefault(c, "pass" if i < at else "not reached")
        except Exception as e:  # noqa: BLE001  (no gate reached a verdict: an error, never a kill)
            out.update(dict.fromkeys(columns, "error: " + _cause(e)))
        if first_kill and any(v.startswith("kill") for v in out.values()):
            break
    return out


@dataclass
class SelftestResult:
    trainer: str
    cases: list
    baseline: dict  # case index -> {gate: verdict} for the unwrapped trainer
    rows: dict = field(default_factory=dict)  # operator -> {gate: 'rejects'|'passes'|'error'|..., 'verdict': ...}
    seconds: float = 0.0
    worlds: list = field(default_factory=list)  # the worlds of the data-parallel cases
    n_single: int = 0  # cases[:n_single] run the single-process gates, the rest the data-parallel or mesh ones
    meshes: list = field(default_factory=list)  # the meshes of the mesh cases ("mesh dp=1 pp=2 tp=1")
    errors: list = field(default_factory=list)  # [(who, gate, case index, cause)]: runs that raised (the unwrapped included)

    @property
    def baseline_ok(self) -> bool:
        return all(v == "pass" or v == "not reached" for r in self.baseline.values() for v in r.values())

    @property
    def applicable(self) -> list[str]:
        return [op for op, r in self.rows.items() if r["verdict"] != "n/a"]

    @property
    def killed(self) -> list[str]:
        return [op for op, r in self.rows.items() if r["verdict"] == "killed"]

    @property
    def erred(self) -> list[str]:
        """Operators no gate killed with some cell 'error' (a run raised, or the unwrapped trainer fails there)."""
        return [op for op, r in self.rows.items() if r["verdict"] == ERROR]

    @property
    def score(self) -> str:
        return f"{len(self.killed)}/{len(self.applicable)}"

    @property
    def ok(self) -> bool:
        return self.baseline_ok and not self.errors and len(self.killed) == len(self.applicable)

    @property
    def exit_code(self) -> int:
        """0 ok; 3 some run raised instead of reaching a verdict (the score proves nothing there); 1 otherwise
        (an operator survived, or the unwrapped trainer fails a gate)."""
        return 0 if self.ok else 3 if self.errors else 1

    def error_lines(self) -> list[str]:
        """One line per distinct cause: where it was raised (who, gate, case), once, then the cause."""
        by: dict[str, list] = {}
        for who, gate, i, cause in self.errors:
            by.setdefault(cause, []).append(f"{who} {gate} on {_short(self.cases[i], i >= self.n_single)}")
        return [f"error: {w[0]}{f' (+{len(w) - 1} more)' if len(w) > 1 else ''}: {c}" for c, w in by.items()]

    def table(self, md: bool = False) -> str:
        head = ["operator", *(g.value for g in GATES), "verdict"]
        rows = [[op, *(r.get(g, "n/a") for g in GATES), r["verdict"]] for op, r in self.rows.items()]
        rows.append(["(unwrapped trainer)", *(_baseline_cell(self.baseline, g) for g in GATES),
                     "passes" + self.at_worlds if self.baseline_ok else
                     ("ERROR " if any(e[0] == BASELINE for e in self.errors) else "FAILS ") + self.failing])
        if md:
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])

    @property
    def at_worlds(self) -> str:
        """Where the unwrapped trainer was run: ' at worlds 1, 2' (data-parallel), '' (one process)."""
        at = f" at world{'s' if len(self.worlds) > 1 else ''} {', '.join(map(str, self.worlds))}" if self.worlds else ""
        return at + (f"{' and' if at else ''} on {', '.join(self.meshes)}" if self.meshes else "")

    @property
    def failing(self) -> str:
        """Where the unwrapped trainer fails: 'in one process', 'at world 1', ... joined by ' and '."""
        bad = lambda r: any(v not in ("pass", "not reached") for v in r.values())  # noqa: E731
        where = ["in one process"] if any(bad(self.baseline[i]) for i in range(self.n_single)) else []
        rest = [(c, bad(self.baseline[i])) for i, c in enumerate(self.cases) if i >= self.n_single]
        ws = sorted({c.world for c, b in rest if b and c.mesh is None})
        ms = [str(c.mesh) for c, b in rest if b and c.mesh is not None]
        return " and ".join(where + ([f"at world{'s' if len(ws) > 1 else ''} {', '.join(map(str, ws))}"] if ws else [])
                            + ([f"on {', '.join(ms)}"] if ms else []))

    def as_dict(self) -> dict:
        survived = [op for op, r in self.rows.items() if r["verdict"] == "SURVIVED"]
        raised = [e for e in self.errors if e[0] == BASELINE]
        problems = ([f"{len(self.errors)} run(s) raised instead of reaching a verdict (not kills)"]
                    if self.errors else []) + \
                   ([f"the unwrapped trainer {'errs' if raised else 'fails a gate'} {self.failing}"]
                    if not self.baseline_ok else []) + \
                   ([f"error: {self.erred}"] if self.erred else []) + ([f"survived: {survived}"] if survived else [])
        return dict(trainer=self.trainer, score=self.score, ok=self.ok, seconds=round(self.seconds, 1),
                    worlds=self.worlds, exit_code=self.exit_code,
                    verdict=(f"every operator killed, the unwrapped trainer passes{self.at_worlds}" if self.ok else
                             "FAIL: " + "; ".join(problems)),
                    cases=[str(c) for c in self.cases], baseline={str(k): v for k, v in self.baseline.items()},
                    operators={op: dict(r) for op, r in self.rows.items()},
                    errors=[dict(who=w, gate=str(g), case=str(self.cases[i]), cause=c) for w, g, i, c in self.errors],
                    descriptions={op: OPERATORS[op].doc for op in self.rows},
                    table_md=self.table(md=True))


BASELINE = "(unwrapped trainer)"


def _short(case, dist: bool) -> str:
    """A case as the self-test's first line lists it: its shape, without the seeds (' W=1' for a one-rank group)."""
    return str(case).split(" seed")[0] + (" W=1" if dist and case.world == 1 and case.mesh is None else "")


def _baseline_cell(baseline: dict, gate: str) -> str:
    vals = [r[gate] for r in baseline.values() if gate in r]
    if not vals:
        return "n/a"
    bad = [v for v in vals if v not in ("pass", "not reached")]
    return "passes" if not bad else ERROR if any(v.startswith(ERROR) for v in bad) else "FAILS"


def worlds_of(max_world: int | None = None) -> list[int]:
    """The worlds the gates draw (verify._internal.gates.distributed.world_range), capped by max_world."""
    from verify._internal.gates.worlds import world_range

    lo, hi = world_range()
    return list(range(lo, (hi if max_world is None else min(max_world, hi)) + 1))


def run_selftest(adapter, *, max_world: int | None = None, device: str = "cpu", progress=None,
                 operators=None, every_case: bool = False) -> SelftestResult:
    """Run the gates on the unwrapped adapter and on every operator's mutant (or those named in
    `operators`); see the module docstring. max_world caps the worlds the gates draw (default: all).
    A mutant stops at the first gate that rejects it (its cells on the cases after: "not run"); every_case runs
    each gate on every case where the bug exists (the whole operator × gate matrix)."""
    ops = [OPERATORS[name] for name in operators] if operators is not None else list(OPERATORS.values())
    t0 = time.perf_counter()
    worlds = worlds_of(max_world) if adapter.data_parallel else []
    single, dist = selftest_cases(adapter, worlds=worlds, device=device)
    meshed = mesh_cases(adapter, max(worlds_of(max_world) or [1]), device) if adapter.mesh_axes else []
    cases = single + dist + meshed
    plain = adapter.plain is not None
    from verify._internal.gates.overflow import overflow_hook

    overflow_ok = overflow_hook(adapter)[0] is not None
    res = SelftestResult(adapter.locate(), cases, {}, worlds=sorted({c.world for c in dist}), n_single=len(single),
                         meshes=[str(c.mesh) for c in meshed])
    total, done = len(cases) * (1 + len(ops)), 0
    for i, case in enumerate(cases):
        res.baseline[i] = _run_gates(adapter, case, plain, i >= len(single))
        _add_errors(res, BASELINE, i, res.baseline[i])
        done += 1
        if progress:
            progress(done, total, "unwrapped trainer")
    for op in ops:
        res.rows[op.name] = _mutant_row(res, op, adapter, plain, every_case, overflow_ok)
        done += len(cases)
        if progress:
            progress(done, total, op.name)
    res.seconds = time.perf_counter() - t0
    return res


def _add_errors(res, who: str, i: int, cells: dict) -> None:
    """res.errors += the 'error' cells of one run of case i, once per cause (a check's columns share one)."""
    seen = {(w, k, c) for w, _, k, c in res.errors}
    for gate, v in cells.items():
        if v.startswith(ERROR) and (who, i, v.removeprefix("error: ")) not in seen:
            seen.add((who, i, v.removeprefix("error: ")))
            res.errors.append((who, gate, i, v.removeprefix("error: ")))


def _broken(res, adapter, case, i: int, plain: bool) -> set:
    """The columns where the unwrapped trainer does not pass on case i (every column of a check that failed or
    raised there): a mutant's rejection there is no kill, so they are the mutant's 'error' cells, not run."""
    return {g for _, _, cols in _checks(adapter, case, plain, i >= res.n_single)
            if any(res.baseline[i].get(c, "pass") != "pass" for c in cols) for g in cols}


def cases_of(op, adapter, cases, overflow_ok: bool) -> list:
    """[(i, case)] of the self-test's cases where `op`'s bug exists for this adapter: its mesh or not, its world,
    its window (the long one or not), fp16 overflow only where the adapter can inject it. Empty: the operator is n/a."""
    return [(i, c) for i, c in enumerate(cases) if (c.mesh is not None) == op.mesh and op.applies(adapter)
            and op.exists(c) and (c.world > 1 or not op.dist_only) and (c.accum_steps >= LONG_N) == op.long
            and (not op.fp16 or overflow_ok)]


def _mutant_row(res, op, adapter, plain: bool, every_case: bool, overflow_ok: bool) -> dict:
    """{gate: cell, 'verdict': ...} of one operator over the cases where its bug exists (run_selftest)."""
    mutant, n1 = op.apply(adapter), res.n_single
    where = cases_of(op, adapter, res.cases, overflow_ok)
    row = {g: "n/a" for g in GATES}
    for j, (i, case) in enumerate(where):
        broken = _broken(res, adapter, case, i, plain)
        settled = {g for g, v in row.items() if v == "rejects"} | broken
        got = _run_gates(mutant, case, plain, i >= n1, settled, not every_case)
        _add_errors(res, op.name, i, got)  # the unwrapped trainer's errors are listed once, as its own
        got.update({g: "error: the unwrapped trainer fails here" for g in broken if row[g] != "rejects"})
        for gate, v in got.items():
            if v.startswith("kill"):
                row[gate] = "rejects"
            elif v.startswith(ERROR):
                row[gate] = ERROR if row[gate] != "rejects" else row[gate]  # a rejection elsewhere stays a kill
            elif v == "pass" and row[gate] in ("n/a", "not reached"):
                row[gate] = "passes"
            elif row[gate] == "n/a":
                row[gate] = v  # "not reached": an earlier gate on that run already rejected it
        if not every_case and "rejects" in row.values():  # killed: the gates left here and on later cases
            left = [g for _, _, cols in _checks(mutant, case, plain, i >= n1) for g in cols if g not in got]
            left += [g for k, c in where[j + 1:] for _, _, cols in _checks(mutant, c, plain, k >= n1) for g in cols]
            row.update({g: NOT_RUN for g in left if row[g] not in ("rejects", ERROR)})  # a "passes" so far included
            break
    row["verdict"] = ("n/a" if not where else "killed" if "rejects" in row.values()
                      else ERROR if ERROR in row.values() else "SURVIVED")
    return row
