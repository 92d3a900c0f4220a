"""verify/_internal/hints.py: one line per class of failure, read from GateFailure's fields."""
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure
from verify._internal.hints import hint
from verify._internal.ranks.mesh import Mesh
from verify._internal.verdict import Gate


def _fail(gate=Gate.EQUIVALENCE, N=4, W=1, error=None, **kw):
    return GateFailure("[x] y", gate=gate, case=Case(accum_steps=N, micro_batch=1, steps=1, world=W), error=error, **kw)


def test_each_class_of_failure_gets_its_hint():
    assert "N=1" in hint(_fail(N=1, error=1e-3)) and "dropout" in hint(_fail(N=1))
    assert "a missing 1/N" in hint(_fail(N=4, error=3.0000001)) and "error ≈ 3 = N − 1" in hint(_fail(N=4, error=3.0))
    assert "1/N applied twice" in hint(_fail(N=4, error=0.75))
    assert "a missing 1/W" in hint(_fail(Gate.DP_EQUIVALENCE, N=3, W=2, error=1.0))
    assert "1/W applied twice" in hint(_fail(Gate.DP_EQUIVALENCE, N=3, W=4, error=0.75))
    assert "clipping" in hint(_fail(N=4, error=1.2e-2)) and "BatchNorm" in hint(_fail(N=4, error=1.2e-2))
    assert "clipping" in hint(_fail(Gate.SPLIT_INVARIANCE, N=2, error=3e-3))
    tp2 = GateFailure("[x] y", gate=Gate.MESH_EQUIVALENCE, error=1.0,
                      case=Case(accum_steps=3, micro_batch=1, steps=1, mesh=Mesh(tp=2)))
    assert "error ≈ 1 = tp − 1" in hint(tp2) and "a loss × the tp size" in hint(tp2)  # broken_tp.loss_times_tp
    ema = GateFailure("[x] y", gate=Gate.MESH_EQUIVALENCE, error=0.16,  # broken_mesh.scale_grads_ema's error
                      case=Case(accum_steps=4, micro_batch=1, steps=1, mesh=Mesh(pp=2), pipeline_chunks=2))
    assert "scale_grads=True" in hint(ema)
    one_outer = GateFailure("[x] y", gate=Gate.MESH_EQUIVALENCE, error=0.16,  # one schedule step: exact, no lead
                            case=Case(accum_steps=2, micro_batch=1, steps=1, mesh=Mesh(pp=2), pipeline_chunks=2))
    assert "scale_grads" not in (hint(one_outer) or "")


def test_no_hint_where_no_class_fits():
    assert hint(_fail(N=4, error=2.5)) is None and hint(_fail(N=4, error=1e-5)) is None
    assert hint(_fail(N=4, error=float("nan"))) is None and hint(_fail(Gate.BOUNDARY_ONLY, N=4, error=3.0)) is None
    assert hint(GateFailure("[x] y")) is None


def test_the_raisers_own_hint_wins():
    assert hint(_fail(N=4, error=3.0, hint="two runs differ")) == "two runs differ"


def test_a_mesh_failure_at_n1_is_not_read_as_nondeterminism():
    tp2 = GateFailure("[x] y", gate=Gate.MESH_EQUIVALENCE, error=1.0,
                      case=Case(accum_steps=1, micro_batch=1, steps=1, mesh=Mesh(tp=2)))
    assert "tp − 1" in hint(tp2) and "dropout" not in hint(tp2)
    ruled_out = _fail(N=1, error=1e-3)
    ruled_out.deterministic = True  # a re-run found two identical runs equal (verify/_internal/gates/rerun.py)
    assert "dropout" not in (hint(ruled_out) or "")
