"""The self-test's mesh cases and operators (verify/selftest/mesh_ops.py): every mesh operator that applies is
killed on a correct mesh trainer whose unwrapped run passes, and an interposition that cannot reach the
trainer's reduction leaves the operator SURVIVED — never a kill the gates did not see."""
import pytest

from planted import broken_mesh
from verify._internal.ranks.mesh import Mesh
from verify.selftest import OPERATORS, mesh_cases, run_selftest

MESH_OPS = [n for n, op in OPERATORS.items() if op.mesh]
pytestmark = pytest.mark.distributed


def test_the_mesh_cases_follow_the_axes_and_the_largest_world():
    got = lambda a, top: [(c.mesh, c.pipeline_chunks, c.accum_steps) for c in mesh_cases(a, top)]  # noqa: E731
    assert got(broken_mesh.tp, 4) == [(Mesh(tp=2), 1, 3), (Mesh(dp=2, tp=2), 1, 3)]
    assert got(broken_mesh.tp, 2) == [(Mesh(tp=2), 1, 3), (Mesh(dp=2), 1, 3)]  # 4 ranks do not fit: dp alone
    assert got(broken_mesh.pipe, 4) == [(Mesh(pp=2), 2, 4), (Mesh(dp=2, pp=2), 2, 4)]
    assert got(broken_mesh.pipe, 1) == [] and mesh_cases(broken_mesh.tp.replace(mesh_axes=()), 4) == []
    assert MESH_OPS == ["pipeline_micro_batch_dropped", "dp_reduction_skipped", "reduced_over_wrong_group"]


@pytest.mark.slow  # a self-test run on meshes (end to end: CI's tier, docs/performance.md)
def test_every_mesh_operator_is_killed_on_a_correct_dp_tp_trainer():
    res = run_selftest(broken_mesh.tp, max_world=4, operators=MESH_OPS)
    assert res.ok and res.score == "3/3", res.table()
    assert res.meshes == ["mesh dp=1 pp=1 tp=2", "mesh dp=2 pp=1 tp=2"]


@pytest.mark.slow  # a self-test run on meshes (end to end: CI's tier, docs/performance.md)
def test_a_reduction_out_of_reach_survives():
    """The dp all_reduce through a name bound at import: skipping or rerouting torch.distributed.all_reduce
    changes nothing, the gates pass, the operators survive and the self-test fails naming them."""
    from tests.helpers.mesh_bound import adapter

    res = run_selftest(adapter, max_world=4, operators=MESH_OPS)
    assert res.baseline_ok and not res.ok, res.table()
    assert res.rows["pipeline_micro_batch_dropped"]["verdict"] == "killed"
    assert {op: res.rows[op]["verdict"] for op in MESH_OPS[1:]} == dict.fromkeys(MESH_OPS[1:], "SURVIVED")
    assert "survived: ['dp_reduction_skipped', 'reduced_over_wrong_group']" in res.as_dict()["verdict"]
