"""The gates, one row each: what a gate claims, when it applies (and why not), its check, its example budget.

The gate tests (verify/test_gates*.py) skip by `why_not`, draw by `gate_budget` / `random_budget`; the report
prints `claim` as the gate's bound and lists `why_not` as what was not checked; the planted bench runs `check` on
each bug (tests/harness/test_planted.py) and tests/harness/test_gate_table.py holds every row to a planted bug.
Adding a gate: docs/design/gates.md, "Adding a gate".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from verify._internal.cases.strategies import GATE_MIN_EXAMPLES, budget, mesh_worlds
from verify._internal.gates.tolerance import FLOAT64_TEXT, LOSS_MAX_REL, STEP0_TEXT, C
from verify._internal.gates.worlds import needs_world, world_range
from verify._internal.verdict import Gate

__all__ = ["GateRow", "TABLE", "why_not", "check", "gate_budget", "random_budget"]


def _always(adapter, settings) -> None:
    return None


@dataclass(frozen=True)
class GateRow:
    gate: Gate
    claim: str
    """What a pass means, its bound in words (the report's "bound" column)."""
    check: Callable
    """check(adapter, case, *args) -> GateResult, raising GateFailure / GateSkipped (args: the planted row's)."""
    budget: tuple[int, int] | None = None
    """(share, floor) of the profile's examples (strategies.budget) for the gate's own test; None: judged on the
    runs of `runs_in`'s test."""
    runs_in: Gate | None = None
    why_not: Callable = _always
    """why_not(adapter, settings) -> the reason the gate does not apply to this adapter here, or None."""
    operators: tuple[str, ...] = ()
    """The self-test's fault operators aimed at this gate (verify/selftest/operators.py): the bugs it is the first
    to see; none for a gate the self-test does not run (its fixed cases draw no split, partial sum or empty window)."""

    def __post_init__(self):
        if (self.budget is None) == (self.runs_in is None):
            raise ValueError(f"GateRow {self.gate.value!r}: give a budget (its own test) or runs_in (another's), "
                             f"not {'both' if self.budget else 'neither'}")


# -- when a gate does not apply -----------------------------------------------------------------------------

def _plain(a, s):
    return None if a.plain is not None else (
        f"{a.name} declares no plain (no-accumulation) step: declare @verify.adapter(plain=...) to prove "
        f"accum_steps=1 is that step bit for bit")


def _padded(a, s):
    return None if a.ignore_index is not None else (
        f"{a.name} declares no ignore_index: padded, variable-length windows do not apply (declare "
        f"@verify.adapter(ignore_index=-100) for a token-weighted trainer)")


def _normaliser(a, s):
    from verify._internal.gates.objective import not_declared

    return not_declared(a)


def _empty(a, s):
    if a.ignore_index is None:
        return f"{a.name} declares no ignore_index: it has no empty windows"
    return None if a.empty_windows else f"{a.name} declares empty_windows=False: never fed a window without a valid target"


def _data_parallel(a, s):
    return None if a.data_parallel else f"{a.name} does not declare data parallelism (Adapter(data_parallel=True))"


def _two_ranks(a, s):
    return _data_parallel(a, s) or needs_world(2, s)


def _mesh(a, s):
    if not a.mesh_axes:
        return f"{a.name} declares no mesh axes (Adapter(mesh_axes=('pp',) | ('tp',) | ...))"
    reason = needs_world(2, s)
    if reason:
        return reason
    lo, hi = world_range(settings=s, at_least=2)
    if not mesh_worlds(a, lo, hi):
        return (f"{a.name}: no mesh of {lo}..{hi} ranks over {a.mesh_axes} within its mesh_sizes {a.mesh_sizes} "
                f"(XTRAIN_DIST_MAX_WORLD)")
    return None


def _overflow(a, s):
    from verify._internal.gates.overflow import overflow_hook

    hook, why = overflow_hook(a)
    return why if hook is None else None


def _metrics(a, s):
    from verify._internal.gates.metrics import not_declared

    return None if a.metrics is not None else not_declared(a)


def _parity(a, s):
    return None if a.parity is not None else (
        f"{a.name} declares no switch that must leave the result unchanged (declare "
        f"@verify.adapter(parity=verify.Parity(name=..., apply=...)), e.g. activation checkpointing)")


# -- the checks (imported when run: a gate's module loads with its first case) -------------------------------

def _lazy(module: str, name: str) -> Callable:
    def run(*a, **k):
        import importlib

        return getattr(importlib.import_module(module), name)(*a, **k)

    run.__name__ = run.__qualname__ = name
    return run


def _split(adapter, case, max_world: int = 1):
    from verify._internal.gates.windows import check_split_invariance

    return check_split_invariance(adapter, case, max_world=max_world)


def _metrics_check(adapter, case):  # one process: the metrics gate's own runs; W ranks: the data-parallel gate's
    from verify._internal.gates.distributed import check_distributed
    from verify._internal.gates.metrics import check_metrics

    return (check_metrics if case.world == 1 else check_distributed)(adapter, case)


_DIST = _lazy("verify._internal.gates.distributed", "check_distributed")

# The report's order. Each claim is what the report prints as the gate's bound.
TABLE: dict[Gate, GateRow] = {r.gate: r for r in (
    GateRow(Gate.EQUIVALENCE, f"step 0 (fp32 or the autocast precision): {STEP0_TEXT} vs float64 (the loss's "
            f"all-parameter term only under autocast); fp32 losses rel < {LOSS_MAX_REL:g}; float64 K steps: loss rel, "
            f"params / max(1,|p|) ≤ {FLOAT64_TEXT}", _lazy("verify._internal.gates.single", "check_equivalence"), (1, 1),
            operators=("drop_micro_step", "repeat_micro_step", "grads_times_N", "grads_over_N",
                       "optimizer_step_every_micro", "zero_grad_in_micro_loop", "stale_micro_batch",
                       "loss_sum_not_mean", "per_micro_mean", "count_from_first_micro")),
    GateRow(Gate.BIT_EXACT, "torch.equal on every gradient, loss and parameter after K steps",
            _lazy("verify._internal.gates.single", "check_bit_exact"), (1, 1), why_not=_plain,
            operators=("all_positions", "sequences")),
    GateRow(Gate.BOUNDARY_ONLY, "no collective on micro-steps 0..N-2 unless declared; boundary reduces P ≤ E ≤ P + 8 "
            "elements", _DIST, runs_in=Gate.DP_EQUIVALENCE, why_not=_data_parallel,
            operators=("extra_collective_micro_0",)),
    GateRow(Gate.DP_EQUIVALENCE, "the equivalence policy, every rank vs the one-rank big batch; ranks bit-equal", _DIST,
            (2, 8), why_not=_data_parallel,
            operators=("divide_by_world_twice", "per_rank_mean", "equal_rank_weights")),
    GateRow(Gate.BYTES_PER_STEP, "the case at N and its window at N = 1 (N·B rows in one micro-step): every rank's "
            "boundary issues the same gradient collectives carrying the same bytes, every step",
            _lazy("verify._internal.gates.distributed", "check_same_bytes"), (30, 3), why_not=_two_ranks),
    GateRow(Gate.SPLIT_INVARIANCE, "every (N, B, W) with N·B·W = E, padded windows: the equivalence / data-parallel "
            "policy", _split, (10, 3), why_not=_padded),
    GateRow(Gate.LONG_WINDOW, "N = 64..256, one process: the equivalence policy; N = 256 in each declared low precision: "
            "the same policy in that precision, and the window's micro-batches reversed move the gradient by no more "
            "than an fp32 sum's rounding (C·2γ_{N−1}, else measured)",
            _lazy("verify._internal.gates.windows", "check_long_window"), (30, 2),
            operators=("low_precision_accumulation",)),
    GateRow(Gate.PARTIAL_SUMS, f"after every micro-step: partial_grads() vs the float64 big batch of micro-batches "
            f"0..n, rel ≤ {FLOAT64_TEXT}", _lazy("verify._internal.gates.windows", "check_partial_sums"),
            runs_in=Gate.LONG_WINDOW),
    GateRow(Gate.NORMALISER, "float64, same parameters, each term alone: w × the losses of windows A, B add up to "
            "A∪B's (w: the declared normaliser's count); padding and one sequence's halves as it says; rel ≤ "
            f"{FLOAT64_TEXT} (floor: the twins')", _lazy("verify._internal.gates.objective", "check_normaliser"),
            (20, 3), why_not=_normaliser,
            operators=("normaliser_applied_twice", "aux_reset_per_micro")),
    GateRow(Gate.EMPTY_WINDOW, "a window without a valid target: parameters torch.equal; the next window as without it "
            "(float64)", _lazy("verify._internal.gates.tokens", "check_empty_window"), (20, 3), why_not=_empty),
    GateRow(Gate.MESH_EQUIVALENCE, "each dp replica assembled (pp stages own each parameter once, tp ranks bit-equal): "
            "the equivalence policy vs the 1×1×1 big batch; replicas bit-equal",
            _lazy("verify._internal.gates.mesh", "check_mesh"), (10, 3), why_not=_mesh,
            operators=("pipeline_micro_batch_dropped", "dp_reduction_skipped", "reduced_over_wrong_group")),
    GateRow(Gate.MESH_SPLIT_INVARIANCE, "one window on every dp × pp × tp mesh of one world: the mesh equivalence "
            "policy, each vs the same 1×1×1 big batch", _lazy("verify._internal.gates.mesh", "check_mesh_splits"),
            (30, 2), why_not=_mesh),
    GateRow(Gate.REPORTED_METRICS, f"float64 runs, every step: each reported metric vs the harness's own value (the "
            f"pre-clip norm over every element once, min(1, max_norm / norm), the LR the optimizer applied, the "
            f"window's counts) and vs the big batch's report, rel ≤ {FLOAT64_TEXT.split('·max')[0]}; counts exact; a "
            f"bf16 / fp16 case also its run in that precision vs its own unscaled values: norms within "
            f"exp((n + 8)·eps32) − 1 (n elements), the loss within {C:g}·eps_p·max(1, κ)", _metrics_check, (20, 3),
            why_not=_metrics,
            operators=("grad_norm_one_shard", "grad_norm_last_micro", "grad_norm_post_clip", "grad_norm_zero",
                       "grad_norm_per_rank", "lr_previous_step", "count_one_micro", "loss_last_micro")),
    GateRow(Gate.OVERFLOW, "fp16, one micro-batch on one rank overflowing: every rank's parameters torch.equal to "
            "before the window; loss_scale() equal to the big batch's after every window; ranks torch.equal after "
            "every window", _lazy("verify._internal.gates.overflow", "check_overflow"), (10, 3), why_not=_overflow,
            operators=("skip_decided_on_one_rank",)),
    GateRow(Gate.PATH_PARITY, "the declared switch on vs off, same windows and init: every loss, step-0 gradient and "
            "parameter torch.equal (exact), else the equivalence policy with the off side as the big batch",
            _lazy("verify._internal.gates.parity", "check_parity"), (10, 3), why_not=_parity),
)}


def why_not(gate: Gate, adapter, settings=None) -> str | None:
    """Why `gate` does not apply to `adapter` under `settings` (default this process's), or None."""
    from verify._internal.settings import current

    return TABLE[Gate(gate)].why_not(adapter, settings or current())


def check(gate: Gate, adapter, case, *args):
    """One gate on one case, as the plugin runs it (verify.check): the GateResult of a pass; raises GateFailure
    (the verdict, its numbers and its hint) or GateSkipped (the gate does not apply). `args`: the overflow gate's
    (micro-step, rank), split invariance's (max_world,), mesh split invariance's (world,)."""
    return TABLE[Gate(gate)].check(adapter, case, *args)


def gate_budget(gate: Gate, n: int | None = None) -> int:
    """Examples the gate's test draws under the loaded profile (or one of max_examples n): budget(*row.budget),
    never below GATE_MIN_EXAMPLES."""
    return max(GATE_MIN_EXAMPLES, budget(*TABLE[Gate(gate)].budget, n=n))


def random_budget(gate: Gate, values) -> int:
    """The random draws left to a gate test after its corners `values`: they replace drawn cases within
    gate_budget(gate), and at least one random case is always drawn beyond them."""
    return max(1, gate_budget(gate) - len(values))
