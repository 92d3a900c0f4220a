"""PYTEST_DONT_REWRITE (no rewritten bytecode is cached next to an installed package)

The data-parallel gates on the adapter under proof, when it declares data parallelism: boundary-only
communication and equivalence to its own one-rank big batch over drawn (N, B_local, world, K, options),
and, for a data-parallel fp16 adapter, the injected-overflow gate at every world (verify/_internal/gates/overflow.py),
on warm rank pools (gloo on CPU; --verify-backend nccl on GPUs, rank r on cuda:r). Worlds from
XTRAIN_DIST_MIN_WORLD (default 1) to XTRAIN_DIST_MAX_WORLD (default 4, capped by GPUs under NCCL). Each gate
draws its known-hard cases first (verify._internal.cases.corners.corners: N ≥ 2 at W ≥ 2, the overflow on the last rank).
"""
import pytest
from hypothesis import assume, event, given, settings

from verify._internal import report
from verify._internal.gpulock import gpu_shared  # noqa: F401
from verify._internal.gates import check_distributed, check_same_bytes
from verify._internal.gates.overflow import check_overflow
from verify._internal.gates.worlds import world_range
from verify._internal.cases.strategies import dist_cases, overflow_cases, with_corners
from verify._internal.gates.table import random_budget
from verify._internal.cases.corners import corners
from verify._internal.verdict import Gate

pytestmark = [pytest.mark.verify_gate, pytest.mark.distributed, pytest.mark.usefixtures("gpu_shared")]


def test_data_parallel_boundary_only_and_equivalent(verify_adapter, verify_settings):
    # one set of runs judges both (and bytes per step needs them): each says why it did not run
    reason = report.not_applicable(verify_adapter, verify_settings, Gate.DP_EQUIVALENCE, Gate.BOUNDARY_ONLY,
                                   Gate.BYTES_PER_STEP)
    if reason:
        pytest.skip(reason)
    lo, hi = world_range(verify_adapter, verify_settings)
    hard = corners(verify_adapter, Gate.DP_EQUIVALENCE, min_world=lo, max_world=hi)

    @settings(max_examples=random_budget(Gate.DP_EQUIVALENCE, hard), deadline=None)
    @given(case=dist_cases(verify_adapter, min_world=lo, max_world=hi))
    def gates(case):
        event(f"world {case.world}")
        report.record(check_distributed(verify_adapter, case))

    with_corners(gates, hard)()


def test_bytes_per_step_independent_of_N(verify_adapter, verify_settings):
    """The same case at N and at N=1 over the SAME global window (N·B rows per rank in one micro-step;
    padded cases keep their lengths): the same boundary collectives and bytes in every step."""
    reason = report.not_applicable(verify_adapter, verify_settings, Gate.BYTES_PER_STEP)
    if reason:
        pytest.skip(reason)

    lo, hi = world_range(verify_adapter, verify_settings, at_least=2)
    hard = corners(verify_adapter, Gate.BYTES_PER_STEP, min_world=lo, max_world=hi)

    @settings(max_examples=random_budget(Gate.BYTES_PER_STEP, hard), deadline=None)
    @given(case=dist_cases(verify_adapter, min_world=lo, max_world=hi, min_accum=2))
    def same_bytes(case):
        report.record(check_same_bytes(verify_adapter, case), Gate.BYTES_PER_STEP)

    with_corners(same_bytes, hard)()


def test_an_overflowing_fp16_window_is_skipped_whole_on_every_rank(verify_adapter, verify_settings):
    """fp16: window 0 of K=2 overflows in ONE drawn micro-step on ONE drawn rank (verify/_internal/gates/overflow.py).
    One process (the GPU gate's CUDA step) runs it in test_gates.py."""
    reason = report.not_applicable(verify_adapter, verify_settings, Gate.OVERFLOW)
    if reason:
        pytest.skip(reason)
    if not verify_adapter.data_parallel:
        pytest.skip("not data-parallel: test_gates.py runs the overflow gate in one process")
    lo, top = world_range(verify_adapter, verify_settings)
    # first the overflow on the LAST rank of the top world: drawn, the rank shrinks to 0, where a skip decided
    # by rank 0 alone is right
    hard = corners(verify_adapter, Gate.OVERFLOW, min_world=lo, max_world=top)

    @settings(max_examples=random_budget(Gate.OVERFLOW, hard), deadline=None)
    @given(drawn=overflow_cases(verify_adapter, min_world=lo, max_world=top))
    def overflow(drawn):
        case, micro, rank = drawn
        assume(0 not in case.empty_steps())  # an empty window has nothing to overflow
        report.record(check_overflow(verify_adapter, case, micro, rank))

    with_corners(overflow, hard, "drawn")()
