"""PYTEST_DONT_REWRITE (no rewritten bytecode is cached next to an installed package)

The mesh gates on the adapter under proof, when it declares mesh axes (distributed=verify.Distributed(mesh_axes=("pp",) |
("tp",) | ...)): every drawn dp × pp × tp mesh of 2..XTRAIN_DIST_MAX_WORLD ranks (default 4; 8 opt-in)
with its pipeline chunks and outer steps against the adapter's own 1×1×1 big batch (verify/_internal/gates/mesh.py),
and split invariance over mesh shapes: one window on every factorisation of one world. Each draws its
known-hard cases first (verify._internal.cases.strategies.corners: pp=2 with 2 chunks × 2 outer steps, tp=2). Skipped,
saying why, for adapters without mesh axes.
"""
import pytest

from verify._internal.gpulock import gpu_shared  # noqa: F401
from verify._internal.prove import prove
from verify._internal.verdict import Gate

pytestmark = [pytest.mark.verify_gate, pytest.mark.distributed, pytest.mark.usefixtures("gpu_shared")]


def test_mesh_equivalent(verify_adapter, verify_settings):
    prove(Gate.MESH_EQUIVALENCE, verify_adapter, verify_settings, ranks=True)


def test_mesh_split_invariance(verify_adapter, verify_settings):
    """One window (N = chunks × outer micro-steps of B rows per rank of the world) on every mesh of one
    world over the adapter's axes: each gives the 1×1×1 big batch's step."""
    prove(Gate.MESH_SPLIT_INVARIANCE, verify_adapter, verify_settings, ranks=True)
