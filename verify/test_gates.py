"""PYTEST_DONT_REWRITE (no rewritten bytecode is cached next to an installed package)

The single-process gates on the adapter under proof (--verify-trainer; default xtrain's trainer):
big-batch equivalence over drawn (N, B, K, seeds, options), and accum_steps=1 bit-identical to the
adapter's declared plain step; for adapters with an ignore_index, split invariance on padded windows, the
token-mean claim and empty windows (verify/_internal/gates/tokens.py); long windows (in every declared precision) and
partial sums. Each test is its gate's row of the gate table (verify/_internal/gates/table.py: how it draws, its
budget) run by verify/_internal/prove.py: its known-hard cases first (verify/_internal/cases/corners.py), then random
ones; each passed example goes into the run report.
"""
import pytest

from verify._internal.gpulock import gpu_shared  # noqa: F401  (fixture: GPU gates share the GPU, memory probes do not)
from verify._internal.prove import prove
from verify._internal.verdict import Gate

pytestmark = [pytest.mark.verify_gate, pytest.mark.usefixtures("gpu_shared")]


def test_accumulation_equals_big_batch(verify_adapter, verify_settings):
    """N micro-steps of B rows vs the same trainer at accum_steps=1 on the N·B batch (verify/_internal/gates/single.py)."""
    prove(Gate.EQUIVALENCE, verify_adapter, verify_settings)


def test_accum1_bit_identical_to_plain(verify_adapter, verify_settings):
    """accum_steps=1 vs the adapter's declared plain step, torch.equal (no corners: the seed alone draws)."""
    prove(Gate.BIT_EXACT, verify_adapter, verify_settings)


@pytest.mark.distributed
def test_split_invariance_on_padded_windows(verify_adapter, verify_settings):
    """Adapters with an ignore_index: a padded window (empty sequences, micro-batches, ranks included) gives
    the float64 big batch's token mean under every (N, B, W) split of its rows."""
    prove(Gate.SPLIT_INVARIANCE, verify_adapter, verify_settings)


def test_normaliser(verify_adapter, verify_settings):
    """Each term of the declared objective (verify.Objective; with an ignore_index and nothing declared, a token
    mean) against the counts the harness knows: windows add up by its weight, padding and one sequence's halves
    as it says, the term vs the big batch (verify/_internal/gates/objective.py)."""
    prove(Gate.NORMALISER, verify_adapter, verify_settings)


def test_path_parity(verify_adapter, verify_settings):
    """A switch the adapter declares must not change the result (verify.Parity: activation checkpointing, a fused
    loss, compile): on vs off on the same windows, bit for bit where the math is the same
    (verify/_internal/gates/parity.py)."""
    prove(Gate.PATH_PARITY, verify_adapter, verify_settings)


def test_empty_window_is_no_step(verify_adapter, verify_settings):
    """Adapters with an ignore_index: a window without a valid target leaves the parameters bit-unchanged and
    the next window as if it had not been there — unless the adapter declares empty_windows=False."""
    prove(Gate.EMPTY_WINDOW, verify_adapter, verify_settings)


def test_long_accumulation_and_partial_sums(verify_adapter, verify_settings):
    """N = 64..256 micro-steps: the equivalence gate, and — for trainers with partial_grads() — each
    micro-step's contribution landing exactly once (the gradient after micro-step n vs the float64 big
    batch of micro-batches 0..n); every declared low precision at N = 256. The corner first: K = 2 windows of
    N = 129, a run past 256 micro-steps."""
    prove(Gate.LONG_WINDOW, verify_adapter, verify_settings)


def test_an_overflowing_fp16_window_is_skipped_whole(verify_adapter, verify_settings):
    """fp16, one process on the gate's device: window 0 of K=2 overflows in ONE drawn micro-step
    (verify/_internal/gates/overflow.py; every world, on rank pools: test_gates_dist.py)."""
    prove(Gate.OVERFLOW, verify_adapter, verify_settings, elsewhere=verify_adapter.process_group and (
        "needs a process group even alone: test_gates_dist.py runs the overflow gate"))


def test_reported_metrics(verify_adapter, verify_settings):
    """Adapters that declare Metrics: what metrics() logs each step (loss, pre-clip grad_norm, clip_coef, lr,
    tokens / rows) equals the harness's own value and the big batch's; with a max_norm, the coefficient the
    optimizer saw applied too (verify/_internal/gates/metrics.py); in each declared bf16 / fp16, against that
    run's own unscaled values (its corners: one per precision)."""
    prove(Gate.REPORTED_METRICS, verify_adapter, verify_settings)
