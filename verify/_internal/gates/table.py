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
from verify._internal.verdict import Gate, GateSkipped

__all__ = ["GateRow", "Draw", "TABLE", "why_not", "check", "gate_budget", "random_budget"]


def _always(adapter, settings) -> None:
    return None


@dataclass(frozen=True)
class Draw:
    """How the gate's own test draws and judges (verify/_internal/prove.py runs it: skip, worlds, corners first,
    budget, record)."""
    strategy: Callable
    """strategy(adapter, lo, hi) -> a hypothesis strategy of what one example draws, in corners()' form: a Case, or
    a tuple (Case, *the check's further arguments)."""
    least_world: int = 1
    """On rank pools: the least world of the test's range (2: a gate that needs two ranks)."""
    judge: Callable | None = None
    """judge(adapter, drawn, settings) -> the GateResults to record; None: the row's check on the drawn value."""
    mesh: bool = False
    """The range is the mesh's (any adapter with mesh axes), not bounded by a data-parallel declaration."""
    also: tuple[Gate, ...] = ()
    """Further gates these runs judge: each says why it did not run where the gate does not apply."""
    shrink: bool = True
    """Hypothesis' shrink phase on a failure (off where each attempt replays a long window)."""


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
    draw: Draw | None = None
    """How its own test draws (None: judged on `runs_in`'s runs, or a test that composes several gates)."""
    native: bool = False
    """It judges a trainer that declares Numerics(native=...) (no float64 path) too; else it does not apply there."""

    def __post_init__(self):
        if (self.budget is None) == (self.runs_in is None):
            raise ValueError(f"GateRow {self.gate.value!r}: give a budget (its own test) or runs_in (another's), "
                             f"not {'both' if self.budget else 'neither'}")
        if self.draw is not None and self.budget is None:
            raise ValueError(f"GateRow {self.gate.value!r}: a draw needs a budget (the examples its test draws)")


# -- when a gate does not apply -----------------------------------------------------------------------------

def _plain(a, s):
    return None if a.plain is not None else (
        f"{a.name} declares no plain (no-accumulation) step: declare @verify.adapter(plain=...) to prove "
        f"accum_steps=1 is that step bit for bit")


def _padded(a, s):
    return None if a.ignore_index is not None else (
        f"{a.name} declares no ignore_index: padded, variable-length windows do not apply (declare "
        f"batches=verify.Batches(ignore_index=-100) for a token-weighted trainer)")


def _normaliser(a, s):
    from verify._internal.gates.objective import not_declared

    return not_declared(a)


def _empty(a, s):
    if a.ignore_index is None:
        return f"{a.name} declares no ignore_index: it has no empty windows"
    return None if a.empty_windows else f"{a.name} declares empty_windows=False: never fed a window without a valid target"


def _data_parallel(a, s):
    return None if a.data_parallel else f"{a.name} does not declare data parallelism (distributed=verify.Distributed(data_parallel=True))"


def _two_ranks(a, s):
    return _data_parallel(a, s) or needs_world(2, s)


def _mesh(a, s):
    if not a.mesh_axes:
        return f"{a.name} declares no mesh axes (distributed=verify.Distributed(mesh_axes=('pp',) | ('tp',) | ...))"
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


# -- how each gate's test draws (its corners: cases/corners.py, in the same form) ---------------------------------

def _cases(**bounds) -> Callable:
    def strategy(a, lo, hi):
        from verify._internal.cases.strategies import cases

        return cases(a, **{k: v(a) if callable(v) else v for k, v in bounds.items()})

    return strategy


def _padded_if_tokens(a):
    return a.ignore_index is not None


def _strategy(name: str, **bounds) -> Callable:
    """A strategy of cases/strategies.py over the test's worlds lo..hi."""
    def strategy(a, lo, hi):
        from verify._internal.cases import strategies

        return getattr(strategies, name)(a, min_world=lo, max_world=hi, **bounds)

    return strategy


def _split_judge(a, case, s):  # every split of the window's rows over the worlds the adapter may run
    from verify._internal.gates.worlds import max_world

    return [_split(a, case, max_world(s) if a.data_parallel else 1)]


def _event(label: Callable) -> Callable:
    """The row's check, the drawn case's world or mesh noted in hypothesis' statistics."""
    def judge(a, case, s):
        from hypothesis import event

        event(label(case))
        return [TABLE[Gate.MESH_EQUIVALENCE if case.mesh is not None else Gate.DP_EQUIVALENCE].check(a, case)]

    return judge


def _overflow_judge(a, drawn, s):
    from hypothesis import assume

    case, micro, rank = drawn
    assume(0 not in case.empty_steps())  # an empty window has nothing to overflow
    return [TABLE[Gate.OVERFLOW].check(a, case, micro, rank)]


def _long_strategy(a, lo, hi):
    from hypothesis import strategies as st

    from verify._internal.cases.corners import LONG_N
    from verify._internal.cases.strategies import cases

    return st.tuples(cases(a, min_accum=64, max_accum=LONG_N, max_micro_batch=1, max_steps=2),
                     cases(a, min_accum=LONG_N, max_accum=LONG_N, max_micro_batch=1, max_steps=1))


def _long_judge(a, drawn, s):
    """N = 64..256: the equivalence policy (recorded as the long window), each micro-step landing once (partial
    sums, where the trainer has partial_grads(); else the reason), then every declared low precision at N = LONG_N
    (one step: the float64 run, precision-free, already ran K steps above)."""
    from verify._internal.gates.single import check_equivalence
    from verify._internal.gates.windows import check_long_window, check_partial_sums
    from verify._internal.verdict import GateSkipped

    case, low = drawn
    yield check_equivalence(a, case)
    try:
        yield check_partial_sums(a, case)
    except GateSkipped as e:
        yield Gate.PARTIAL_SUMS, str(e)
    yield from check_long_window(a, low)


_TOKENS = _cases(max_accum=4, max_micro_batch=2, min_steps=2, max_steps=2, padded=_padded_if_tokens)

# The report's order. Each claim is what the report prints as the gate's bound.
TABLE: dict[Gate, GateRow] = {r.gate: r for r in (
    GateRow(Gate.EQUIVALENCE, f"step 0 (fp32 or the autocast precision): {STEP0_TEXT} vs float64 (the loss's "
            f"all-parameter term only under autocast); fp32 losses rel < {LOSS_MAX_REL:g}; float64 K steps: loss rel, "
            f"params / max(1,|p|) ≤ {FLOAT64_TEXT}", _lazy("verify._internal.gates.single", "check_equivalence"), (1, 1),
            draw=Draw(_cases(short=True)),  # a short last window only where declared (short_last_window)
            operators=("drop_micro_step", "repeat_micro_step", "grads_times_N", "grads_over_N",
                       "optimizer_step_every_micro", "zero_grad_in_micro_loop", "stale_micro_batch",
                       "loss_sum_not_mean", "per_micro_mean", "count_from_first_micro"), native=True),
    GateRow(Gate.BIT_EXACT, "torch.equal on every gradient, loss and parameter after K steps",
            _lazy("verify._internal.gates.single", "check_bit_exact"), (1, 1), why_not=_plain,
            draw=Draw(_cases(max_accum=1, max_micro_batch=8)),
            operators=("all_positions", "sequences"), native=True),
    GateRow(Gate.BOUNDARY_ONLY, "no collective on micro-steps 0..N-2 unless declared; boundary reduces P ≤ E ≤ P + 8 "
            "elements", _DIST, runs_in=Gate.DP_EQUIVALENCE, why_not=_data_parallel,
            operators=("extra_collective_micro_0",)),
    GateRow(Gate.DP_EQUIVALENCE, "the equivalence policy, every rank vs the one-rank big batch; ranks bit-equal", _DIST,
            (2, 8), why_not=_data_parallel,
            draw=Draw(_strategy("dist_cases"), judge=_event(lambda c: f"world {c.world}"),
                      also=(Gate.BOUNDARY_ONLY, Gate.BYTES_PER_STEP)),  # one set of runs judges the three
            operators=("divide_by_world_twice", "per_rank_mean", "equal_rank_weights")),
    GateRow(Gate.BYTES_PER_STEP, "the case at N and its window at N = 1 (N·B rows in one micro-step): every rank's "
            "boundary issues the same gradient collectives carrying the same bytes, every step",
            _lazy("verify._internal.gates.distributed", "check_same_bytes"), (30, 3), why_not=_two_ranks,
            draw=Draw(_strategy("dist_cases", min_accum=2), least_world=2)),
    GateRow(Gate.SPLIT_INVARIANCE, "every (N, B, W) with N·B·W = E, padded windows: the equivalence / data-parallel "
            "policy", _split, (10, 3), why_not=_padded,
            # N ≥ 2 so the window has a split; some padding, so its micro-batches' valid-target counts differ
            draw=Draw(_cases(min_accum=2, max_accum=6, max_micro_batch=2, max_steps=2, padded=True, some_padding=True),
                      judge=_split_judge)),
    GateRow(Gate.LONG_WINDOW, "N = 64..256, one process: the equivalence policy; N = 256 in each declared low precision: "
            "the same policy in that precision, and the window's micro-batches reversed move the gradient by no more "
            "than an fp32 sum's rounding (C·2γ_{N−1}, else measured)",
            _lazy("verify._internal.gates.windows", "check_long_window"), (30, 2),
            # No shrink phase: a window cannot shrink below N=64 here, and each attempt replays 64..256 micro-steps
            # plus the float64 references, so hypothesis' shrinker ran into its 300 s cap (transformers 4.45.2: 317 s,
            # still at N=135) while the other gates give the same bug's minimal case in seconds.
            draw=Draw(_long_strategy, judge=_long_judge, shrink=False),
            operators=("low_precision_accumulation",)),
    GateRow(Gate.PARTIAL_SUMS, f"after every micro-step: partial_grads() vs the float64 big batch of micro-batches "
            f"0..n, rel ≤ {FLOAT64_TEXT}", _lazy("verify._internal.gates.windows", "check_partial_sums"),
            runs_in=Gate.LONG_WINDOW),
    GateRow(Gate.NORMALISER, "float64, same parameters, each term alone: w × the losses of windows A, B add up to "
            "A∪B's (w: the declared normaliser's count); padding and one sequence's halves as it says; rel ≤ "
            f"{FLOAT64_TEXT} (floor: the twins')", _lazy("verify._internal.gates.objective", "check_normaliser"),
            (20, 3), why_not=_normaliser, draw=Draw(_TOKENS),
            operators=("normaliser_applied_twice", "aux_reset_per_micro")),
    GateRow(Gate.EMPTY_WINDOW, "a window without a valid target: parameters torch.equal; the next window as without it "
            "(float64)", _lazy("verify._internal.gates.tokens", "check_empty_window"), (20, 3), why_not=_empty,
            draw=Draw(_TOKENS)),
    GateRow(Gate.MESH_EQUIVALENCE, "each dp replica assembled (pp stages own each parameter once, tp ranks bit-equal): "
            "the equivalence policy vs the 1×1×1 big batch; replicas bit-equal",
            _lazy("verify._internal.gates.mesh", "check_mesh"), (10, 3), why_not=_mesh,
            draw=Draw(_strategy("mesh_cases"), least_world=2, judge=_event(lambda c: str(c.mesh)), mesh=True),
            operators=("pipeline_micro_batch_dropped", "dp_reduction_skipped", "reduced_over_wrong_group")),
    GateRow(Gate.MESH_SPLIT_INVARIANCE, "one window on every dp × pp × tp mesh of one world: the mesh equivalence "
            "policy, each vs the same 1×1×1 big batch", _lazy("verify._internal.gates.mesh", "check_mesh_splits"),
            (30, 2), why_not=_mesh, draw=Draw(_strategy("mesh_split_cases"), least_world=2, mesh=True)),
    GateRow(Gate.REPORTED_METRICS, f"float64 runs, every step: each reported metric vs the harness's own value (the "
            f"pre-clip norm over every element once, min(1, max_norm / norm), the LR the optimizer applied, the "
            f"window's counts) and vs the big batch's report, rel ≤ {FLOAT64_TEXT.split('·max')[0]}; counts exact; a "
            f"bf16 / fp16 case also its run in that precision vs its own unscaled values: norms within "
            f"exp((n + 8)·eps32) − 1 (n elements), the loss within {C:g}·eps_p·max(1, κ)", _metrics_check, (20, 3),
            why_not=_metrics, draw=Draw(_cases(max_accum=4, max_micro_batch=2, min_steps=2, max_steps=3)),
            operators=("grad_norm_one_shard", "grad_norm_last_micro", "grad_norm_post_clip", "grad_norm_zero",
                       "grad_norm_per_rank", "lr_previous_step", "count_one_micro", "loss_last_micro")),
    GateRow(Gate.OVERFLOW, "fp16, one micro-batch on one rank overflowing: every rank's parameters torch.equal to "
            "before the window; loss_scale() equal to the big batch's after every window; ranks torch.equal after "
            "every window", _lazy("verify._internal.gates.overflow", "check_overflow"), (10, 3), why_not=_overflow,
            draw=Draw(_strategy("overflow_cases"), judge=_overflow_judge),
            operators=("skip_decided_on_one_rank",)),
    GateRow(Gate.PATH_PARITY, "the declared switch on vs off, same windows and init: every loss, step-0 gradient and "
            "parameter torch.equal (exact), else the equivalence policy with the off side as the big batch",
            _lazy("verify._internal.gates.parity", "check_parity"), (10, 3), why_not=_parity,
            draw=Draw(_cases(max_accum=4, max_micro_batch=2, max_steps=2, padded=_padded_if_tokens))),
)}


def why_not(gate: Gate, adapter, settings=None) -> str | None:
    """Why `gate` does not apply to `adapter` under `settings` (default this process's), or None."""
    from verify._internal.settings import current

    row = TABLE[Gate(gate)]
    return _not_native(adapter, row) or row.why_not(adapter, settings or current())


def _not_native(adapter, row: GateRow) -> str | None:
    """Why a gate that judges against float64 runs does not apply to a trainer without a float64 path."""
    if getattr(adapter, "native", None) is None or row.native:
        return None
    return (f"{adapter.name} declares Numerics(native={adapter.native!r}): the {row.gate.value} gate judges against "
            f"float64 runs, which this trainer has no path for")


def check(gate: Gate, adapter, case, *args):
    """One gate on one case, as the plugin runs it (verify.check): the GateResult of a pass; raises GateFailure
    (the verdict, its numbers and its hint) or GateSkipped (the gate does not apply). `args`: the overflow gate's
    (micro-step, rank), split invariance's (max_world,), mesh split invariance's (world,)."""
    row = TABLE[Gate(gate)]
    reason = _not_native(adapter, row)
    if reason:
        raise GateSkipped(reason)
    return row.check(adapter, case, *args)


def gate_budget(gate: Gate, n: int | None = None) -> int:
    """Examples the gate's test draws under the loaded profile (or one of max_examples n): budget(*row.budget),
    never below GATE_MIN_EXAMPLES."""
    return max(GATE_MIN_EXAMPLES, budget(*TABLE[Gate(gate)].budget, n=n))


def random_budget(gate: Gate, values) -> int:
    """The random draws left to a gate test after its corners `values`: they replace drawn cases within
    gate_budget(gate), and at least one random case is always drawn beyond them."""
    return max(1, gate_budget(gate) - len(values))
