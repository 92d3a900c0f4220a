"""Reported metrics on a mesh (issue 28): the mesh gate judges every rank's float64 metrics against the 1×1×1 big
batch, with the harness's norm of each dp replica's whole gradient (gates/mesh.py mesh_norms: each parameter
name once over the replica's pp stages and tp ranks); a rank may leave out only the loss it does not know. The
planted metrics bugs across ranks (planted/broken_mesh_metrics.py) are rejected by the gates the registry names
(tests/harness/test_planted.py); here what each message must say, and what the metrics gate says of the one
whose parameters the equivalence gate rejects first."""
import pytest

from planted import broken_mesh_metrics, registry as planted
from verify._internal import report
from verify._internal.cases.case import Trace
from verify._internal.gates.distributed import F64, run_distributed
from verify._internal.gates.mesh import check_mesh, mesh_norms
from verify._internal.gates.metrics import judge_world
from verify._internal.ranks.mesh import Mesh
from verify._internal.verdict import Gate, GateFailure

PIPE_CASE = planted.PIPE  # pp=2, 2 chunks × 2 outer steps, K=2


def _trace(*sumsq):
    """A rank's Trace holding only the Observer's Σg² per name, one dict per step."""
    return Trace([], {}, [], [dict(sumsq=s) for s in sumsq])


def test_mesh_norms_count_each_name_once_per_replica():
    """dp=2 × pp=2 × tp=2: stage 0 owns 'a' (whole on both tp ranks: counted once), stage 1 owns 'b'; each replica
    gets its own norm, every rank of it the same."""
    mesh = Mesh(dp=2, pp=2, tp=2)
    case = PIPE_CASE.replace(mesh=mesh, world=2, steps=1)
    traces = [None] * mesh.size
    for d, (a, b) in enumerate(((9.0, 16.0), (1.0, 3.0))):
        for t in range(2):
            traces[mesh.rank(d, 0, t)] = _trace({"a": a})
            traces[mesh.rank(d, 1, t)] = _trace({"b": b})
    norms = mesh_norms(traces, case)
    assert [norms[r] for r in range(8)] == [[5.0] if mesh.coords(r)[0] == 0 else [2.0] for r in range(8)]


def test_mesh_norms_reject_tp_copies_that_disagree():
    mesh = Mesh(tp=2)
    case = PIPE_CASE.replace(mesh=mesh, pipeline_chunks=1, steps=1)
    with pytest.raises(GateFailure) as e:
        mesh_norms([_trace({"w": 1.0}), _trace({"w": 1.5})], case)
    assert e.value.gate is Gate.MESH_EQUIVALENCE and "'w'" in str(e.value) and "step 0" in str(e.value)


@pytest.mark.distributed
def test_a_correct_tp_trainer_passes_and_its_metrics_are_tallied(monkeypatch):
    """The control of the planted tp bug on the registry's TP case: every rank's metrics checked every step, and
    the mesh result feeds the report's metrics tally as a data-parallel one does."""
    r = check_mesh(broken_mesh_metrics.tp_logged, planted.TP)
    checked = r.extra["metrics"]["metrics_checked"]
    ranks_steps = planted.TP.ranks * planted.TP.steps
    assert r.gate is Gate.MESH_EQUIVALENCE and checked == {m: ranks_steps for m in ("loss", "grad_norm", "lr", "rows")}
    monkeypatch.setattr(report, "_STATS", {})  # this process's tally, put back after
    report.record(r)
    assert report._STATS[Gate.REPORTED_METRICS.value]["checked"]["grad_norm"] == ranks_steps


@pytest.mark.distributed
def test_a_pipelines_earlier_stage_may_omit_the_loss_only():
    """examples/pipeline_schedule.py logs the loss on its last stage only (its optimizer_step() returns None on
    the others): the loss is checked there, every other metric on both stages, clipping included."""
    from examples import pipeline_schedule

    r = check_mesh(pipeline_schedule.factory, PIPE_CASE)
    checked, steps = r.extra["metrics"]["metrics_checked"], PIPE_CASE.steps
    assert checked["loss"] == steps and checked["grad_norm"] == checked["clip (applied)"] == 2 * steps, checked


@pytest.mark.distributed
def test_replicated_tp_parameters_counted_tp_times_are_named():
    with pytest.raises(GateFailure) as e:
        check_mesh(broken_mesh_metrics.replicated_counted_tp, planted.TP)
    msg = str(e.value)
    assert e.value.gate is Gate.REPORTED_METRICS and msg.startswith(f"[{Gate.REPORTED_METRICS}] rank "), msg
    assert "grad_norm reported" in msg and "step 0" in msg and "tp rank" in msg, msg
    assert e.value.error is not None and not e.value.error < e.value.bound, msg


@pytest.mark.distributed
def test_a_per_rank_clip_coefficient_is_named_by_the_metrics_gate_too():
    """clip_coef_per_rank: the data-parallel gate rejects its parameters first (the registry); the metrics gate,
    judged on its own on the same runs, names the coefficient each rank applied against the global one."""
    adapter, case = broken_mesh_metrics.clip_coef_per_rank, planted.CLIPPED
    outcomes = run_distributed(adapter, case)
    with pytest.raises(GateFailure) as e:
        judge_world(adapter, case, {o.rank: o.runs[F64].trace for o in outcomes}, outcomes[0].refs["ref64"])
    msg = str(e.value)
    assert e.value.gate is Gate.REPORTED_METRICS and "the clip coefficient applied" in msg and "step 0" in msg, msg
