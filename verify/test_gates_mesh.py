"""PYTEST_DONT_REWRITE (no rewritten bytecode is cached next to an installed package)

The mesh gates on the adapter under proof, when it declares mesh axes (Adapter(mesh_axes=("pp",) |
("tp",) | ...)): every drawn dp × pp × tp mesh of 2..XTRAIN_DIST_MAX_WORLD ranks (default 4; 8 opt-in)
with its pipeline chunks and outer steps against the adapter's own 1×1×1 big batch (verify/_internal/gates/mesh.py),
and split invariance over mesh shapes: one window on every factorisation of one world. Each draws its
known-hard cases first (verify._internal.cases.strategies.corners: pp=2 with 2 chunks × 2 outer steps, tp=2). Skipped,
saying why, for adapters without mesh axes.
"""
import pytest
from hypothesis import event, given, settings

from verify._internal import report
from verify._internal.gpulock import gpu_shared  # noqa: F401
from verify._internal.gates.worlds import world_range
from verify._internal.gates.mesh import check_mesh, check_mesh_splits
from verify._internal.cases.strategies import mesh_cases, mesh_split_cases, with_corners
from verify._internal.gates.table import random_budget
from verify._internal.cases.corners import corners
from verify._internal.verdict import Gate

pytestmark = [pytest.mark.verify_gate, pytest.mark.distributed, pytest.mark.usefixtures("gpu_shared")]


def _drawn(adapter, settings, gate: Gate):
    """(lo, hi, the corners) of a mesh gate's test, after skipping it where the gate does not apply."""
    reason = report.not_applicable(adapter, settings, gate)
    if reason:
        pytest.skip(reason)
    lo, hi = world_range(settings=settings, at_least=2)
    return lo, hi, corners(adapter, gate, min_world=lo, max_world=hi)


def test_mesh_equivalent(verify_adapter, verify_settings):
    lo, hi, hard = _drawn(verify_adapter, verify_settings, Gate.MESH_EQUIVALENCE)

    @settings(max_examples=random_budget(Gate.MESH_EQUIVALENCE, hard), deadline=None)
    @given(case=mesh_cases(verify_adapter, min_world=lo, max_world=hi))
    def gates(case):
        event(str(case.mesh))
        report.record(check_mesh(verify_adapter, case))

    with_corners(gates, hard)()


def test_mesh_split_invariance(verify_adapter, verify_settings):
    """One window (N = chunks × outer micro-steps of B rows per rank of the world) on every mesh of one
    world over the adapter's axes: each gives the 1×1×1 big batch's step."""
    lo, hi, hard = _drawn(verify_adapter, verify_settings, Gate.MESH_SPLIT_INVARIANCE)

    @settings(max_examples=random_budget(Gate.MESH_SPLIT_INVARIANCE, hard), deadline=None)
    @given(drawn=mesh_split_cases(verify_adapter, min_world=lo, max_world=hi))
    def splits(drawn):
        case, world = drawn
        report.record(check_mesh_splits(verify_adapter, case, world))

    with_corners(splits, hard, "drawn")()
