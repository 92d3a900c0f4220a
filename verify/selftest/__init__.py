"""The fault-injection self-test: proof that the gates are live for YOUR trainer.

Every operator of verify.selftest.operators wraps the adapter's trainer and plants one bug; the gates
then run on the wrapped trainer over a fixed set of cases built from the adapter's `defaults`:

    single-process   N=1 (K=2), N=3 (B=2, K=2), N=4 (B=1, K=3): equivalence; bit-exact at N=1 when a
                     plain step is declared
    data-parallel    W=2 (N=3, B=2, K=2) and W=3 (N=2, B=1, K=2) when the adapter declares data
                     parallelism and the pools allow that world

A gate's cell says whether it rejects the mutant on some case where the bug exists ("not reached": an
earlier gate of the same run rejected it first). An operator is killed when some gate rejects it on a case where its bug exists; it survives when every
gate passes on every such case. The unwrapped trainer must pass every gate on every case. Score =
killed / operators whose bug can exist for this adapter (data-parallel-only operators do not apply to
a single-process trainer).
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

from .operators import OPERATORS, Operator

__all__ = ["run_selftest", "OPERATORS", "Operator", "SelftestResult", "GATES"]

GATES = ("equivalence", "bit-exact", "boundary-only", "dp-equivalence")


def selftest_cases(adapter, *, max_world: int, device: str = "cpu"):
    from ..case import Case

    o = adapter.defaults
    single = [Case(accum_steps=1, micro_batch=2, steps=2, seed=1, data_seed=11, device=device, options=o),
              Case(accum_steps=3, micro_batch=2, steps=2, seed=2, data_seed=12, device=device, options=o),
              Case(accum_steps=4, micro_batch=1, steps=3, seed=3, data_seed=13, device=device, options=o)]
    dist = []
    if adapter.data_parallel:
        dist = [Case(accum_steps=n, micro_batch=b, steps=2, world=w, seed=4 + w, data_seed=20 + w, device=device, options=o)
                for n, b, w in ((3, 2, 2), (2, 1, 3)) if w <= max_world]
    return single, dist


def _gate_of(message: str) -> str:
    head = message.split("]", 1)[0].lstrip("[")
    if head.startswith("boundary-only"):
        return "boundary-only"
    if head.startswith("distributed") or head.startswith("data-parallel") or head.startswith("reference"):
        return "dp-equivalence"
    if head.startswith("bit-exact"):
        return "bit-exact"
    return "equivalence"


def _run_gates(adapter, case, plain: bool) -> dict:
    """gate -> 'pass' | 'kill: <message>' | 'error: <exception>' for one adapter on one case."""
    from ..gates import GateFailure, check_bit_exact, check_distributed, check_equivalence

    out = {}
    if case.world == 1:
        checks = [("equivalence", check_equivalence)] + ([("bit-exact", check_bit_exact)]
                                                         if plain and case.accum_steps == 1 else [])
    else:
        checks = [("data-parallel", check_distributed)]
    for name, check in checks:
        try:
            check(adapter, case)
            if name == "data-parallel":
                out["boundary-only"] = out["dp-equivalence"] = "pass"
            else:
                out[name] = "pass"
        except GateFailure as e:
            gate = _gate_of(str(e)) if name == "data-parallel" else name
            out[gate] = "kill: " + str(e).splitlines()[0]
            if name == "data-parallel" and gate == "boundary-only":
                out.setdefault("dp-equivalence", "not reached")
            elif name == "data-parallel":
                out.setdefault("boundary-only", "pass")
        except Exception as e:  # noqa: BLE001  (the wrapped trainer crashed: the bug did not pass silently)
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            if name == "data-parallel":
                out["boundary-only"] = out["dp-equivalence"] = "error: " + tb[:300]
            else:
                out[name] = "error: " + tb[:300]
    return out


@dataclass
class SelftestResult:
    trainer: str
    cases: list
    baseline: dict  # case index -> {gate: verdict} for the unwrapped trainer
    rows: dict = field(default_factory=dict)  # operator -> {gate: 'killed'|'survived'|'n/a', 'verdict': ...}
    seconds: float = 0.0

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
    def score(self) -> str:
        return f"{len(self.killed)}/{len(self.applicable)}"

    @property
    def ok(self) -> bool:
        return self.baseline_ok and len(self.killed) == len(self.applicable)

    def table(self, md: bool = False) -> str:
        head = ["operator", *GATES, "verdict"]
        rows = [[op, *(r.get(g, "n/a") for g in GATES), r["verdict"]] for op, r in self.rows.items()]
        rows.append(["(unwrapped trainer)", *(_baseline_cell(self.baseline, g) for g in GATES),
                     "passes" if self.baseline_ok else "FAILS"])
        if md:
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])

    def as_dict(self) -> dict:
        return dict(trainer=self.trainer, score=self.score, ok=self.ok, seconds=round(self.seconds, 1),
                    verdict=("every operator killed, the unwrapped trainer passes" if self.ok else
                             "FAIL: " + ("the unwrapped trainer fails a gate; " if not self.baseline_ok else "")
                             + (f"survived: {sorted(set(self.applicable) - set(self.killed))}"
                                if len(self.killed) < len(self.applicable) else "")),
                    cases=[str(c) for c in self.cases], baseline={str(k): v for k, v in self.baseline.items()},
                    operators={op: dict(r) for op, r in self.rows.items()},
                    descriptions={op: OPERATORS[op].doc for op in self.rows},
                    table_md=self.table(md=True))


def _baseline_cell(baseline: dict, gate: str) -> str:
    vals = [r[gate] for r in baseline.values() if gate in r]
    if not vals:
        return "n/a"
    bad = [v for v in vals if v not in ("pass", "not reached")]
    return "passes" if not bad else "FAILS"


def run_selftest(adapter, *, max_world: int = 3, device: str = "cpu", progress=None) -> SelftestResult:
    """Run the gates on the unwrapped adapter and on every operator's mutant; see the module docstring."""
    t0 = time.perf_counter()
    single, dist = selftest_cases(adapter, max_world=max_world, device=device)
    cases = single + dist
    plain = adapter.plain is not None
    res = SelftestResult(adapter.locate(), cases, {})
    total, done = len(cases) * (1 + len(OPERATORS)), 0
    for i, case in enumerate(cases):
        res.baseline[i] = _run_gates(adapter, case, plain)
        done += 1
        if progress:
            progress(done, total, "unwrapped trainer")
    for op in OPERATORS.values():
        mutant = op.apply(adapter)
        where = [c for c in cases if op.exists(c) and (c.world > 1 or not op.dist_only)]
        row = {g: "n/a" for g in GATES}
        for case in where:
            for gate, v in _run_gates(mutant, case, plain).items():
                if v.startswith(("kill", "error")):
                    row[gate] = "rejects"
                elif v == "pass" and row[gate] in ("n/a", "not reached"):
                    row[gate] = "passes"
                elif row[gate] == "n/a":
                    row[gate] = v  # "not reached": an earlier gate on that run already rejected it
        done += len(cases)
        if progress:
            progress(done, total, op.name)
        row["verdict"] = ("n/a" if not where else
                          "killed" if any(v == "rejects" for v in row.values()) else "SURVIVED")
        res.rows[op.name] = row
    res.seconds = time.perf_counter() - t0
    return res
