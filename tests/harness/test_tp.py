"""Tensor parallel (issue 18 items 4-5): the trainer the TP planted bugs are planted in (planted/broken_tp.py,
examples/tensor_parallel.py's) passes the mesh gate on the registry's own TP case, so each planted bug's
rejection there (tests/harness/test_planted.py) is the bug's alone; at Mesh() every bug is the plain model."""
import pytest

from planted import broken_tp, registry as planted
from verify._internal.gates.mesh import check_mesh
from verify._internal.verdict import Gate

pytestmark = pytest.mark.distributed


def test_the_control_passes_the_planted_bugs_case():
    r = check_mesh(broken_tp.tensor_parallel, planted.TP)
    assert r.gate is Gate.MESH_EQUIVALENCE and r.ratio < 1


def test_the_bugs_exist_only_across_tp_ranks():
    """At one tp rank the shard is the whole head, the tp size 1 and the world the dp group: each bug is the
    control's trainer, so no bug can be seen by a gate that never splits tp."""
    from verify import Spec

    spec = Spec(accum_steps=1)
    for a in (broken_tp.shard_local_count, broken_tp.loss_times_tp, broken_tp.boundary_over_world):
        t = a(spec)
        assert t.count(__import__("torch").arange(12)) == 12 and t.loss_factor() == 1 and t.boundary_group() is None
