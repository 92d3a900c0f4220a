"""One self-test operator planted in a zoo trainer: the operator is drawn from the trainer's seed among those
whose bug can exist for it (Operator.applies, and a self-test case where it exists), then
verify.run_selftest(adapter, operators=[it]) runs the gates on the unwrapped trainer and on the mutant.

    python -m benchmarks.zoo kill --seed S [--out FILE]     # one JSON line: operator, verdict, cells, seconds
"""
from __future__ import annotations

import json
import random
import time

import verify


def candidates(adapter) -> list[str]:
    """The operators whose bug can exist for `adapter` on the self-test's fixed cases (run_selftest's own
    rule: the operator applies to the adapter and exists on a case of its kind: mesh, long window, world ≥ 2)."""
    from verify.selftest import OPERATORS, mesh_cases, selftest_cases, worlds_of

    worlds = worlds_of() if adapter.data_parallel else []
    single, dist = selftest_cases(adapter, worlds=worlds)
    meshed = mesh_cases(adapter, max(worlds_of() or [1])) if adapter.mesh_axes else []
    cases = single + dist + meshed
    fp16 = "fp16" in adapter.precisions
    out = []
    for name, op in sorted(OPERATORS.items()):
        if not op.applies(adapter) or (op.fp16 and not fp16):
            continue
        if any((c.mesh is not None) == op.mesh and op.exists(c) and (c.world > 1 or not op.dist_only)
               and (c.precision != "fp32") == op.long for c in cases):
            out.append(name)
    return out


# Operators whose mutant is the honest trainer on a recipe: the zoo knows its own choices where the adapter does not
# declare them. lr_previous_step without a schedule: the previous step's LR is this step's, the same numbers logged
# (the run of record at b8e8361 drew it on three such trainers, which "survived": design/zoo.md).
EQUIVALENT = {"lr_previous_step": lambda r: r.schedule == "none"}


def draw_operator(seed: int, adapter) -> str | None:
    """One of candidates(adapter), from the seed; drawn again (same stream) where it is the honest trainer on this
    recipe (EQUIVALENT), so every other seed keeps its operator."""
    names, rng = candidates(adapter), random.Random(f"zoo-kill-{seed}")
    name = rng.choice(names) if names else None
    recipe = getattr(adapter.factory, "recipe", None)
    if name in EQUIVALENT and recipe is not None and EQUIVALENT[name](recipe):
        rest = [n for n in names if n != name]
        name = rng.choice(rest) if rest else None
    return name


def run(seed: int) -> dict:
    """The drawn operator's row and the unwrapped trainer's verdict on the self-test's cases."""
    from benchmarks.zoo import population

    adapter = getattr(population, f"t{seed}")
    op = draw_operator(seed, adapter)
    if op is None:
        return dict(seed=seed, operator=None, verdict="n/a", why="no operator's bug can exist for this trainer")
    t0 = time.perf_counter()
    res = verify.run_selftest(adapter, operators=[op])  # its rank pools close at exit
    d = res.as_dict()
    row = d["operators"][op]
    return dict(seed=seed, operator=op, verdict=row["verdict"], cells={k: v for k, v in row.items() if k != "verdict"},
                baseline_ok=res.baseline_ok, errors=d["errors"], seconds=round(time.perf_counter() - t0, 1),
                description=d["descriptions"][op])


def main(seed: int, out: str | None) -> int:
    import torch

    torch.set_num_threads(1)  # the runner's jobs share the machine: one thread each, as the gates' ranks
    doc = run(seed)
    text = json.dumps(doc)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
