"""PYTEST_DONT_REWRITE (no rewritten bytecode is cached next to an installed package)

The mesh gates on the adapter under proof, when it declares mesh axes (Adapter(mesh_axes=("pp",) |
("tp",) | ...)): every drawn dp × pp × tp mesh of 2..XTRAIN_DIST_MAX_WORLD ranks (default 4; 8 opt-in)
with its pipeline chunks and outer steps against the adapter's own 1×1×1 big batch (verify/gates/mesh.py),
and split invariance over mesh shapes: one window on every factorisation of one world. Skipped, saying
why, for adapters without mesh axes.
"""
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from . import report
from ._gpulock import gpu_shared  # noqa: F401
from .gates.distributed import max_world, min_world
from .gates.mesh import check_mesh, check_mesh_splits
from .strategies import cases, gate_budget, mesh_cases, mesh_worlds
from .verdict import Gate

pytestmark = [pytest.mark.verify_gate, pytest.mark.distributed, pytest.mark.usefixtures("gpu_shared")]


def _mesh(adapter, gate: Gate):
    if not adapter.mesh_axes:
        reason = f"{adapter.name} declares no mesh axes (Adapter(mesh_axes=('pp',) | ('tp',) | ...))"
        report.skip(gate, reason)
        pytest.skip(reason)
    if max_world() < 2:
        pytest.skip("needs world ≥ 2 (XTRAIN_DIST_MAX_WORLD / GPUs)")
    if not mesh_worlds(adapter, max(2, min_world()), max_world()):
        reason = (f"{adapter.name}: no mesh of {max(2, min_world())}..{max_world()} ranks over {adapter.mesh_axes} "
                  f"within its mesh_sizes {adapter.mesh_sizes} (XTRAIN_DIST_MAX_WORLD)")
        report.skip(gate, reason)
        pytest.skip(reason)


def test_mesh_equivalent(verify_adapter):
    _mesh(verify_adapter, Gate.MESH_EQUIVALENCE)

    @settings(max_examples=gate_budget("mesh"), deadline=None)
    @given(data=st.data())
    def gates(data):
        case = data.draw(mesh_cases(verify_adapter, min_world=max(2, min_world()), max_world=max_world()), label="case")
        event(str(case.mesh))
        report.record(check_mesh(verify_adapter, case))

    gates()


def test_mesh_split_invariance(verify_adapter):
    """One window (N = chunks × outer micro-steps of B rows per rank of the world) on every mesh of one
    world over the adapter's axes: each gives the 1×1×1 big batch's step."""
    _mesh(verify_adapter, Gate.SPLIT_INVARIANCE)

    @settings(max_examples=gate_budget("mesh_split"), deadline=None)
    @given(data=st.data())
    def splits(data):
        world = data.draw(st.sampled_from(mesh_worlds(verify_adapter, max(2, min_world()), max_world())), label="world")
        chunks = data.draw(st.integers(1, 4), label="pipeline chunks") if "pp" in verify_adapter.mesh_axes else 1
        c = data.draw(cases(verify_adapter, min_accum=1, max_accum=1, max_micro_batch=2, max_steps=2, padded=False),
                      label="case")
        outer = data.draw(st.integers(1, 2), label="outer steps")
        # B·world rows per micro-step: every dp of the world divides them
        case = c.replace(accum_steps=chunks * outer, micro_batch=c.micro_batch * world)
        report.record(check_mesh_splits(verify_adapter, case.replace(pipeline_chunks=chunks), world))

    splits()
