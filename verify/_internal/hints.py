"""One line under a gate's verdict: the likely cause, by class of failure.

Read from GateFailure's structured fields (gate, case, error, bound), never from its text; a hint the raiser
set (GateFailure.hint) wins. The classes: N = 1 in one process (nondeterminism), error ≈ N − 1 / 1 − 1/N (the
1/N missing / twice), the same with W, ≈ tp − 1 on a mesh, a pipeline's scale_grads across outer steps, and
1e-3 ≤ error ≤ 0.1 (something per micro-batch that belongs to the window). Factors match within 2 %;
verify/_internal/gates/rerun.py replaces a pattern its re-runs contradict. A hint is a lead, never a verdict.

The table: docs/verify-your-trainer.md; design: docs/design/tolerance.md, "Around the policy".
"""
from __future__ import annotations

from verify._internal.verdict import Gate

__all__ = ["hint"]

# gates whose error is a relative error against the big batch
NUMERIC = (Gate.EQUIVALENCE, Gate.DP_EQUIVALENCE, Gate.SPLIT_INVARIANCE, Gate.LONG_WINDOW, Gate.MESH_EQUIVALENCE,
           Gate.MESH_SPLIT_INVARIANCE)
EXACT = 0.02  # how near a factor an error must be to be called that factor
SMALL = (1e-3, 0.1)


def _near(x: float, target: float) -> bool:
    return target > 0 and abs(x - target) <= EXACT * target


def hint(failure) -> str | None:
    """The likely cause of a GateFailure, one line, or None when its fields name no known class."""
    if getattr(failure, "hint", None):
        return failure.hint
    case, err, gate = getattr(failure, "case", None), getattr(failure, "error", None), getattr(failure, "gate", None)
    if case is None or gate not in NUMERIC:
        return None
    N, W, m = case.accum_steps, case.world, getattr(case, "mesh", None)
    # on a mesh a failure at N=1 is the mesh's (tp, pp), not nondeterminism: the re-run (gates/rerun.py) decides
    mesh = m is not None and (m.tp > 1 or m.pp > 1)
    if N == 1 and W == 1 and not mesh and not getattr(failure, "deterministic", False):
        return ("it fails at N=1, where accumulation does nothing: two runs of your trainer on the same batch differ. "
                "Look for train-mode dropout, nondeterministic kernels (torch.use_deterministic_algorithms(True)) or "
                "random numbers drawn per micro-step; seed everything from Spec.seed")
    if err is None or err != err:  # NaN: nothing to classify
        return None
    for n, x, over in ((N, "N", "micro-steps"), (W, "W", "ranks")):
        if n < 2:
            continue
        if _near(err, n - 1):
            return (f"error ≈ {n - 1} = {x} − 1: the result is {n}× the big batch's — a sum over {over} where a "
                    f"mean belongs (a missing 1/{x})")
        if _near(err, 1 - 1 / n):
            return f"error ≈ {1 - 1 / n:.3g} = 1 − 1/{x}: the result is the big batch's ÷ {n} — 1/{x} applied twice"
    tp = getattr(getattr(case, "mesh", None), "tp", 1)
    if tp > 1 and _near(err, tp - 1):
        return (f"error ≈ {tp - 1} = tp − 1: the result is {tp}× the big batch's — the tp ranks of a replica hold the "
                f"same rows, so nothing may sum or scale over them (a loss × the tp size, a reduction over the tp group)")
    m, c = getattr(case, "mesh", None), getattr(case, "pipeline_chunks", 1)
    if m is not None and m.pp > 1 and c > 1 and N // c > 1:
        return ("a pipeline with several schedule steps per window: torch's schedules default to scale_grads=True, "
                f"dividing EVERY .grad by n_microbatches ({c}) after each step() — the earlier outer steps' gradient "
                "again and again, a moving average (torchtitan #1733); pass scale_grads=False and divide each "
                "micro-batch's loss by N")
    if SMALL[0] <= err <= SMALL[1]:
        return (f"a small error ({err:.1e}), not a factor: something acts per micro-batch that should act on the "
                f"whole window — an optimizer step inside the micro-step loop, gradient clipping inside each "
                f"micro-step, BatchNorm's per-micro-batch statistics (a true non-equivalence: use LayerNorm/GroupNorm "
                f"or frozen statistics), or a per-micro-batch mean")
    return None
