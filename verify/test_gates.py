"""PYTEST_DONT_REWRITE (no rewritten bytecode is cached next to an installed package)

The single-process gates on the adapter under proof (--verify-trainer; default xtrain's trainer):
big-batch equivalence over drawn (N, B, K, seeds, options), and accum_steps=1 bit-identical to the
adapter's declared plain step; for adapters with an ignore_index, split invariance on padded windows, the
token-mean claim and empty windows (verify/_internal/gates/tokens.py); long windows (in every declared precision) and
partial sums. Each gate draws its known-hard cases first (verify._internal.cases.strategies.corners), then random ones.
Each passed example goes into the run report.
"""
import pytest
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

from verify._internal import report
from verify._internal.gpulock import gpu_shared  # noqa: F401  (fixture: GPU gates share the GPU, memory probes do not)
from verify._internal.gates import check_bit_exact, check_equivalence
from verify._internal.gates.windows import LONG_N
from verify._internal.cases.strategies import cases, overflow_cases, seed_only_draws, with_corners
from verify._internal.gates.table import gate_budget, random_budget
from verify._internal.cases.corners import corners
from verify._internal.verdict import Gate

pytestmark = [pytest.mark.verify_gate, pytest.mark.usefixtures("gpu_shared")]


def test_accumulation_equals_big_batch(verify_adapter):
    hard = corners(verify_adapter, Gate.EQUIVALENCE)

    @settings(max_examples=random_budget(Gate.EQUIVALENCE, hard), deadline=None)
    @given(case=cases(verify_adapter, short=True))  # a short last window only where declared (short_last_window)
    def equivalence(case):
        report.record(check_equivalence(verify_adapter, case))

    with_corners(equivalence, hard)()


def test_accum1_bit_identical_to_plain(verify_adapter, verify_settings):
    reason = report.not_applicable(verify_adapter, verify_settings, Gate.BIT_EXACT)
    if reason:
        pytest.skip(reason)

    @settings(max_examples=gate_budget(Gate.BIT_EXACT), deadline=None)
    @given(data=st.data())
    def bit_exact(data):
        case = data.draw(cases(verify_adapter, max_accum=1, max_micro_batch=8), label="case")
        report.record(check_bit_exact(verify_adapter, case))

    with seed_only_draws():  # no corners: the seed alone draws its cases, as with_corners' gates do
        bit_exact()


@pytest.mark.distributed
def test_split_invariance_on_padded_windows(verify_adapter, verify_settings):
    """Adapters with an ignore_index: a padded window (empty sequences, micro-batches, ranks included) gives
    the float64 big batch's token mean under every (N, B, W) split of its rows."""
    from verify._internal.gates.worlds import max_world
    from verify._internal.gates.windows import check_split_invariance

    reason = report.not_applicable(verify_adapter, verify_settings, Gate.SPLIT_INVARIANCE)
    if reason:
        pytest.skip(reason)
    worlds = max_world(verify_settings) if verify_adapter.data_parallel else 1
    hard = corners(verify_adapter, Gate.SPLIT_INVARIANCE)

    # N ≥ 2 so the window has a split; some padding, so its micro-batches' valid-target counts differ
    @settings(max_examples=random_budget(Gate.SPLIT_INVARIANCE, hard), deadline=None)
    @given(case=cases(verify_adapter, min_accum=2, max_accum=6, max_micro_batch=2, max_steps=2, padded=True,
                      some_padding=True))
    def split_invariance(case):
        report.record(check_split_invariance(verify_adapter, case, max_world=worlds))

    with_corners(split_invariance, hard)()


def _token_cases(adapter):
    return cases(adapter, max_accum=4, max_micro_batch=2, min_steps=2, max_steps=2, padded=adapter.ignore_index is not None)


def test_normaliser(verify_adapter, verify_settings):
    """Each term of the declared objective (verify.Objective; with an ignore_index and nothing declared, a token
    mean) against the counts the harness knows: windows add up by its weight, padding and one sequence's halves
    as it says, the term vs the big batch (verify/_internal/gates/objective.py)."""
    from verify._internal.gates.objective import check_normaliser

    reason = report.not_applicable(verify_adapter, verify_settings, Gate.NORMALISER)
    if reason:
        pytest.skip(reason)

    hard = corners(verify_adapter, Gate.NORMALISER)

    @settings(max_examples=random_budget(Gate.NORMALISER, hard), deadline=None)
    @given(case=_token_cases(verify_adapter))
    def normaliser(case):
        report.record(check_normaliser(verify_adapter, case))

    with_corners(normaliser, hard)()


def test_path_parity(verify_adapter, verify_settings):
    """A switch the adapter declares must not change the result (verify.Parity: activation checkpointing, a fused
    loss, compile): on vs off on the same windows, bit for bit where the math is the same
    (verify/_internal/gates/parity.py)."""
    from verify._internal.gates.parity import check_parity

    reason = report.not_applicable(verify_adapter, verify_settings, Gate.PATH_PARITY)
    if reason:
        pytest.skip(reason)
    hard = corners(verify_adapter, Gate.PATH_PARITY)

    @settings(max_examples=random_budget(Gate.PATH_PARITY, hard), deadline=None)
    @given(case=cases(verify_adapter, max_accum=4, max_micro_batch=2, max_steps=2,
                      padded=verify_adapter.ignore_index is not None))
    def parity(case):
        report.record(check_parity(verify_adapter, case))

    with_corners(parity, hard)()


def test_empty_window_is_no_step(verify_adapter, verify_settings):
    """Adapters with an ignore_index: a window without a valid target leaves the parameters bit-unchanged and
    the next window as if it had not been there — unless the adapter declares empty_windows=False."""
    from verify._internal.gates import check_empty_window

    reason = report.not_applicable(verify_adapter, verify_settings, Gate.EMPTY_WINDOW)
    if reason:
        pytest.skip(reason)

    hard = corners(verify_adapter, Gate.EMPTY_WINDOW)

    @settings(max_examples=random_budget(Gate.EMPTY_WINDOW, hard), deadline=None)
    @given(case=_token_cases(verify_adapter))
    def empty_window(case):
        report.record(check_empty_window(verify_adapter, case))

    with_corners(empty_window, hard)()


def test_long_accumulation_and_partial_sums(verify_adapter):
    """N = 64..256 micro-steps: the equivalence gate, and — for trainers with partial_grads() — each
    micro-step's contribution landing exactly once (the gradient after micro-step n vs the float64 big
    batch of micro-batches 0..n). The corner first: K = 2 windows of N = 129, a run past 256 micro-steps."""
    from verify._internal.gates import GateSkipped
    from verify._internal.gates.windows import check_long_window, check_partial_sums

    # the corner's low-precision window is the drawn one's (N = 256, one window: the policy judges its step 0)
    hard = [(c, c.replace(accum_steps=LONG_N, steps=1)) for c in corners(verify_adapter, Gate.LONG_WINDOW)]

    # No shrink phase: a window cannot shrink below N=64 here, and each attempt replays 64..256 micro-steps
    # plus the float64 references, so hypothesis' shrinker ran into its 300 s cap (transformers 4.45.2:
    # 317 s, still at N=135) while the other gates give the same bug's minimal case in seconds.
    @settings(max_examples=random_budget(Gate.LONG_WINDOW, hard), deadline=None,
              phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target))
    @given(drawn=st.tuples(cases(verify_adapter, min_accum=64, max_accum=LONG_N, max_micro_batch=1, max_steps=2),
                           cases(verify_adapter, min_accum=LONG_N, max_accum=LONG_N, max_micro_batch=1, max_steps=1)))
    def long_windows(drawn):
        case, low = drawn
        report.record(check_equivalence(verify_adapter, case), Gate.LONG_WINDOW)  # its own row, not equivalence's
        try:
            report.record(check_partial_sums(verify_adapter, case))
        except GateSkipped as e:
            report.skip(Gate.PARTIAL_SUMS, str(e))
        # Every declared low precision, at the longest window: a bf16 / fp16 accumulator's error grows with N
        # (one step: the float64 run, precision-free, already ran K steps above).
        for r in check_long_window(verify_adapter, low):
            report.record(r, Gate.LONG_WINDOW)

    with_corners(long_windows, hard, "drawn")()


def test_an_overflowing_fp16_window_is_skipped_whole(verify_adapter, verify_settings):
    """fp16, one process on the gate's device: window 0 of K=2 overflows in ONE drawn micro-step
    (verify/_internal/gates/overflow.py; every world, on rank pools: test_gates_dist.py)."""
    from verify._internal.gates.overflow import check_overflow

    reason = report.not_applicable(verify_adapter, verify_settings, Gate.OVERFLOW)
    if reason:
        pytest.skip(reason)
    if verify_adapter.process_group:
        pytest.skip("needs a process group even alone: test_gates_dist.py runs the overflow gate")

    hard = corners(verify_adapter, Gate.OVERFLOW)  # the overflow in the boundary's micro-step first

    @settings(max_examples=random_budget(Gate.OVERFLOW, hard), deadline=None)
    @given(drawn=overflow_cases(verify_adapter))
    def overflow(drawn):
        case, micro, rank = drawn
        assume(0 not in case.empty_steps())  # an empty window has nothing to overflow
        report.record(check_overflow(verify_adapter, case, micro, rank))

    with_corners(overflow, hard, "drawn")()


def test_reported_metrics(verify_adapter, verify_settings):
    """Adapters that declare Metrics: what metrics() logs each step (loss, pre-clip grad_norm, clip_coef, lr,
    tokens / rows) equals the harness's own value and the big batch's; with a max_norm, the coefficient the
    optimizer saw applied too (verify/_internal/gates/metrics.py); in each declared bf16 / fp16, against that
    run's own unscaled values (its corners: one per precision)."""
    from verify._internal.gates.metrics import check_metrics

    reason = report.not_applicable(verify_adapter, verify_settings, Gate.REPORTED_METRICS)
    if reason:
        pytest.skip(reason)
    hard = corners(verify_adapter, Gate.REPORTED_METRICS)

    @settings(max_examples=random_budget(Gate.REPORTED_METRICS, hard), deadline=None)
    @given(case=cases(verify_adapter, max_accum=4, max_micro_batch=2, min_steps=2, max_steps=3))
    def metrics(case):  # the float64 runs; a drawn bf16 / fp16 also that precision's run, against its own values
        report.record(check_metrics(verify_adapter, case))

    with_corners(metrics, hard)()
