"""PYTEST_DONT_REWRITE (no rewritten bytecode is cached next to an installed package)

The data-parallel gates on the adapter under proof, when it declares data parallelism: boundary-only
communication and equivalence to its own one-rank big batch over drawn (N, B_local, world, K, options),
and, for a data-parallel fp16 adapter, the injected-overflow gate at every world (verify/_internal/gates/overflow.py),
on warm rank pools (gloo on CPU; --verify-backend nccl on GPUs, rank r on cuda:r). Worlds from
XTRAIN_DIST_MIN_WORLD (default 1) to XTRAIN_DIST_MAX_WORLD (default 4, capped by GPUs under NCCL). Each gate
draws its known-hard cases first (verify._internal.cases.corners.corners: N ≥ 2 at W ≥ 2, the overflow on the last rank).
"""
import pytest

from verify._internal.gpulock import gpu_shared  # noqa: F401
from verify._internal.prove import prove
from verify._internal.verdict import Gate

pytestmark = [pytest.mark.verify_gate, pytest.mark.distributed, pytest.mark.usefixtures("gpu_shared")]


def test_data_parallel_boundary_only_and_equivalent(verify_adapter, verify_settings):
    """One set of runs judges boundary-only, data-parallel equivalence (and, paired with its window at N = 1, bytes
    per step): each says why it did not run where they do not apply."""
    prove(Gate.DP_EQUIVALENCE, verify_adapter, verify_settings, ranks=True)


def test_bytes_per_step_independent_of_N(verify_adapter, verify_settings):
    """The same case at N and at N=1 over the SAME global window (N·B rows per rank in one micro-step;
    padded cases keep their lengths): the same boundary collectives and bytes in every step."""
    prove(Gate.BYTES_PER_STEP, verify_adapter, verify_settings, ranks=True)


def test_an_overflowing_fp16_window_is_skipped_whole_on_every_rank(verify_adapter, verify_settings):
    """fp16: window 0 of K=2 overflows in ONE drawn micro-step on ONE drawn rank (verify/_internal/gates/overflow.py),
    the overflow on the LAST rank of the top world first (drawn, the rank shrinks to 0, where a skip decided by rank
    0 alone is right). One process (the GPU gate's CUDA step) runs it in test_gates.py."""
    prove(Gate.OVERFLOW, verify_adapter, verify_settings, ranks=True, elsewhere=not verify_adapter.data_parallel and (
        "not data-parallel: test_gates.py runs the overflow gate in one process"))
