"""The mesh in the protocol (issue 18 item 1): verify.Mesh's layout, Spec / Adapter validation, the assembly of
what the ranks own (exactly once over pp stages, tp ranks bit-identical), and the mesh gate on a pipelined MLP
(planted/broken_mesh.py): the correct trainer passes, each planted bug is rejected naming the axis."""
import pytest
import torch

import verify
from planted import broken_mesh
from verify._internal.cases.case import Case
from verify._internal.gates.worlds import max_world
from verify._internal.gates.mesh import check_mesh
from verify._internal.ranks.mesh import Mesh, MeshError, assemble
from verify._internal.protocol import AdapterError, Spec
from verify._internal.verdict import Gate, GateFailure, GateSkipped


def test_mesh_layout_is_init_device_meshs():
    m = Mesh(dp=2, pp=3, tp=2)
    assert m.size == 12 and str(m) == "mesh dp=2 pp=3 tp=2" and m.axes() == ("dp", "pp", "tp")
    # tp innermost: rank = (dp_i·pp + pp_i)·tp + tp_i, the row-major order of init_device_mesh's (dp, pp, tp)
    import itertools

    order = list(itertools.product(range(2), range(3), range(2)))
    assert [m.coords(r) for r in range(12)] == order and [m.rank(*c) for c in order] == list(range(12))
    assert Mesh().size == 1 and Mesh().axes() == ()
    for bad in (dict(dp=0), dict(pp=-1), dict(tp=1.5), dict(tp=True)):
        with pytest.raises(ValueError, match="Mesh."):
            Mesh(**bad)
    with pytest.raises(ValueError, match="rank 12 is outside"):
        m.coords(12)


def test_spec_and_adapter_validate_the_mesh_fields():
    assert Spec(accum_steps=6, pipeline_chunks=3, mesh=Mesh(pp=2)).mesh.pp == 2
    with pytest.raises(ValueError, match="pipeline_chunks must be an integer ≥ 1 dividing accum_steps=4, got 3"):
        Spec(accum_steps=4, pipeline_chunks=3)
    with pytest.raises(ValueError, match="Spec.mesh must be a verify.Mesh"):
        Spec(accum_steps=1, mesh=(1, 2, 1))
    a = verify.adapter(data=broken_mesh.DATA, mesh_axes=["tp", "pp"])(broken_mesh.Pipe)
    assert a.mesh_axes == ("pp", "tp") and a.declarations()["mesh_axes"] == ["pp", "tp"]
    assert "mesh_axes" not in verify.adapter(data=broken_mesh.DATA)(broken_mesh.Pipe).declarations()
    for bad in (("xp",), ("pp", "pp"), ("dp",)):
        with pytest.raises(AdapterError, match="mesh_axes must name distinct axes"):
            verify.adapter(data=broken_mesh.DATA, mesh_axes=bad)(broken_mesh.Pipe)
    with pytest.raises(ValueError, match="Case.world must be the mesh's dp"):
        Case(accum_steps=2, micro_batch=1, steps=1, mesh=Mesh(dp=2, pp=2))
    c = Case(accum_steps=4, micro_batch=1, steps=1, world=2, mesh=Mesh(dp=2, pp=2), pipeline_chunks=2)
    assert c.ranks == 4 and c.effective_batch == 8 and "mesh dp=2 pp=2 tp=1 chunks=2" in str(c)
    assert c.spec().mesh == Mesh(dp=2, pp=2) and c.spec().pipeline_chunks == 2
    ref = c.spec(accum_steps=1, dtype=torch.float64)  # a reference: one process, one chunk
    assert ref.mesh == Mesh() and ref.pipeline_chunks == 1


def _t(*v):
    return torch.tensor(v, dtype=torch.float64)


def test_assembly_is_the_union_over_stages_once_and_tp_ranks_agree():
    m = Mesh(dp=2, pp=2, tp=2)
    stage = [{"a": _t(1.0), "b": _t(2.0)}, {"c": _t(3.0)}]
    owned = [dict(stage[m.coords(r)[1]]) for r in range(8)]
    got = assemble(owned, m, "gradient")
    assert len(got) == 2 and all(set(g) == {"a", "b", "c"} for g in got)
    twice = [dict(o) for o in owned]
    twice[m.rank(1, 1, 0)]["a"] = twice[m.rank(1, 1, 1)]["a"] = _t(1.0)
    with pytest.raises(MeshError, match="replica 1: gradient of 'a' owned twice, by stage 0 and stage 1"):
        assemble(twice, m, "gradient")
    apart = [dict(o) for o in owned]
    apart[m.rank(0, 1, 1)]["c"] = _t(3.0 + 1e-12)  # one ulp-ish off: bit for bit is the rule
    with pytest.raises(MeshError, match="replica 0, stage 1: tp ranks 0 and 1 disagree on the full gradient of 'c'"):
        assemble(apart, m, "gradient")
    names = [dict(o) for o in owned]
    del names[m.rank(0, 0, 1)]["b"]
    with pytest.raises(MeshError, match="tp ranks 0 and 1 own different gradient names"):
        assemble(names, m, "gradient")


def test_a_name_no_stage_owns_fails():
    from verify._internal.ranks.mesh import missing

    missing({"a": _t(1.0)}, ["a"], Mesh(pp=2), 0, "gradient")  # all there: nothing to say
    with pytest.raises(MeshError, match=r"replica 1: parameter after step 0 of \['b'\] owned by no stage"):
        missing({"a": _t(1.0)}, ["a", "b"], Mesh(dp=2, pp=2), 1, "parameter after step 0")


def test_a_mesh_gate_skips_adapters_without_mesh_axes():
    from xtrain_proof import adapters as xtrain

    with pytest.raises(GateSkipped, match="declares no mesh axes"):
        check_mesh(xtrain.adapter, Case(accum_steps=2, micro_batch=1, steps=1, world=1, mesh=Mesh(pp=2)))
    with pytest.raises(ValueError, match=r"uses axes \['tp'\]"):
        check_mesh(broken_mesh.pipe, Case(accum_steps=2, micro_batch=1, steps=1, world=1, mesh=Mesh(tp=2)))


needs_2 = pytest.mark.skipif(max_world() < 2, reason="needs world ≥ 2 (XTRAIN_DIST_MAX_WORLD)")
needs_4 = pytest.mark.skipif(max_world() < 4, reason="needs world ≥ 4 (XTRAIN_DIST_MAX_WORLD)")


def _case(mesh, N, chunks, B=2, K=2):
    return Case(accum_steps=N, micro_batch=B, steps=K, world=mesh.dp, mesh=mesh, pipeline_chunks=chunks)


@pytest.mark.distributed
@pytest.mark.parametrize("mesh, N, chunks", [
    pytest.param(Mesh(pp=2), 4, 2, marks=needs_2), pytest.param(Mesh(pp=2), 3, 1, marks=needs_2),
    pytest.param(Mesh(dp=2, pp=2), 2, 2, marks=needs_4), pytest.param(Mesh(pp=4), 4, 4, marks=needs_4)], ids=str)
def test_a_correct_pipeline_passes(mesh, N, chunks):
    r = check_mesh(broken_mesh.pipe, _case(mesh, N, chunks))
    assert r.gate is Gate.MESH_EQUIVALENCE and 0 < r.ratio < 1


@pytest.mark.distributed
@needs_2
def test_scale_grads_under_outer_accumulation_is_rejected_naming_the_stage():
    """torchtitan #1733: scale_grads=True divides ALL .grad by the chunks after every schedule.step, so outer
    steps 0..S-2 are divided again and again. One outer step is exactly right — the bug needs outer ≥ 2."""
    assert check_mesh(broken_mesh.pipe_ema, _case(Mesh(pp=2), 2, 2)).ratio < 1  # outer = 1: right
    with pytest.raises(GateFailure) as e:
        check_mesh(broken_mesh.pipe_ema, _case(Mesh(pp=2), 4, 2))
    msg = str(e.value)
    assert e.value.gate is Gate.MESH_EQUIVALENCE
    assert msg.startswith("[mesh equivalence] mesh dp=1 pp=2 tp=1, chunks=2, outer=2: gradient (step 0) of '"), msg
    assert "(stage 0)" in msg or "(stage 1)" in msg, msg


@pytest.mark.distributed
@needs_2
@pytest.mark.parametrize("adapter, says", [
    (broken_mesh.pipe_owned_twice, "replica 0: gradient (step 0) of '8.weight' owned twice, by stage 0 and stage 1"),
    (broken_mesh.pipe_no_loss, "replica 0: the last stage (stage 1) returned no loss")], ids=["owned_twice", "no_loss"])
def test_assembly_failures_name_the_replica_and_stage(adapter, says):
    with pytest.raises(GateFailure) as e:
        check_mesh(adapter, _case(Mesh(pp=2), 2, 1))
    assert e.value.gate is Gate.MESH_EQUIVALENCE and says in str(e.value), str(e.value)


def test_meshes_are_every_factorisation_over_the_declared_axes():
    from verify._internal.ranks.mesh import meshes

    assert {(m.dp, m.pp, m.tp) for m in meshes(("dp", "pp"), 4)} == {(1, 4, 1), (2, 2, 1), (4, 1, 1)}
    assert {(m.dp, m.pp, m.tp) for m in meshes(("pp", "tp"), 4)} == {(1, 4, 1), (1, 2, 2), (1, 1, 4)}
    assert [str(m) for m in meshes(("tp",), 3)] == ["mesh dp=1 pp=1 tp=3"]
    assert len(meshes(("dp", "pp", "tp"), 8)) == 10 and all(m.size == 8 for m in meshes(("dp", "pp", "tp"), 8))
    assert [len(m.axes()) for m in meshes(("dp", "pp", "tp"), 8)][:4] == [1, 1, 1, 2]  # the simplest meshes first


def test_mesh_sizes_are_validated_and_bound_what_is_drawn():
    from verify._internal.ranks.mesh import meshes, unsupported

    sizes = {"tp": (2, 4, 8, 16)}
    assert [str(m) for m in meshes(("dp", "tp"), 3, sizes)] == ["mesh dp=3 pp=1 tp=1"]  # no tp=3
    assert {(m.dp, m.tp) for m in meshes(("dp", "tp"), 4, sizes)} == {(1, 4), (4, 1), (2, 2)}
    assert unsupported(Mesh(tp=3), sizes) == "tp=3 is not among the adapter's mesh_sizes['tp'] = (2, 4, 8, 16)"
    assert unsupported(Mesh(dp=3), sizes) is None and broken_mesh.tp16.declarations()["mesh_sizes"] == \
        {"tp": [2, 4, 8, 16]}
    for bad, says in (({"pp": (2,)}, "'pp': (2,)"), ({"tp": (1, 2)}, "'tp': (1, 2)"), ({"tp": ()}, "'tp': ()"),
                      ((2, 4), "(2, 4)")):
        with pytest.raises(AdapterError) as e:
            verify.adapter(data=broken_mesh.DATA, mesh_axes=("dp", "tp"), mesh_sizes=bad)(broken_mesh.Tp)
        assert str(e.value).startswith("mesh_sizes must map axes among dp, tp to sizes ≥ 2, e.g. {'tp': (2, 4)}; got")
        assert says in str(e.value) and len(str(e.value).splitlines()) == 1


def test_an_unsupported_mesh_size_is_a_skip_with_its_reason_not_a_failed_run():
    """Hidden 16 over tp=3 is torch's refusal (an uneven DTensor shard), no fault of the trainer: asked for
    anyway, the gate skips saying which size, before any rank starts."""
    with pytest.raises(GateSkipped, match=r"^mesh_tp16 on mesh dp=1 pp=1 tp=3: tp=3 is not among the adapter's "
                                          r"mesh_sizes\['tp'\] = \(2, 4, 8, 16\)$"):
        check_mesh(broken_mesh.tp16, _case(Mesh(tp=3), 2, 1))


@pytest.mark.distributed
@needs_4
def test_a_tp_model_of_hidden_16_passes_at_world_4():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from verify._internal.cases.strategies import mesh_cases, mesh_worlds

    assert mesh_worlds(broken_mesh.tp16, 2, 4) == [2, 3, 4]  # world 3: dp=3 only

    @settings(max_examples=40, deadline=None, database=None)
    @given(mesh_cases(broken_mesh.tp16, max_world=4))
    def never_tp3(c):
        assert c.mesh.tp in (1, 2, 4)

    never_tp3()
    r = check_mesh(broken_mesh.tp16, _case(Mesh(tp=4), 2, 1))
    assert r.gate is Gate.MESH_EQUIVALENCE and r.ratio < 1


def test_counts_are_called_with_no_mesh_in_the_data_parallel_gates_and_must_be_count_rows():
    """The counts(case) contract (verify._internal.protocol): case.mesh None -> a CountRow, a mesh -> {axis: row}; an
    adapter that declares data_parallel and mesh_axes gets both calls. A duck-typed row is a one-line error
    naming what came back, not an AttributeError deep in the counter."""
    from verify._internal.gates.counts import CountRow, declared_row

    seen = []

    def counts(case):
        seen.append(case.mesh)
        row = CountRow("boundary-only", before={}, boundary=None)
        return row if case.mesh is None else {"tp": row}

    both = verify.adapter(data=broken_mesh.DATA, data_parallel=True, mesh_axes=("dp", "tp"), counts=counts)(broken_mesh.Tp)
    assert isinstance(declared_row(both, Case(accum_steps=2, micro_batch=1, steps=1, world=2)), CountRow)
    assert set(declared_row(both, _case(Mesh(tp=2), 2, 1))) == {"tp"} and seen == [None, Mesh(tp=2)]

    class Row:  # a row of the user's own, with CountRow's fields but not its type
        mode, before, boundary = "mine", {}, None

    duck = verify.adapter(data=broken_mesh.DATA, data_parallel=True, counts=lambda case: Row(), name="duck")(broken_mesh.Tp)
    with pytest.raises(AdapterError) as e:
        declared_row(duck, Case(accum_steps=2, micro_batch=1, steps=1, world=2))
    line = str(e.value)
    assert line.startswith("duck: counts(case) for a data-parallel case (case.mesh is None): counts= must return "
                           "verify.CountRow, got Row <") and line.endswith("; build the row with verify.CountRow("
                                                                           "mode, before=..., boundary=...)")
    from verify._internal.gates.mesh_counts import _row

    with pytest.raises(AdapterError, match=r"^counts\(case\)\['tp'\]\(0, 0, 1\) \(dp_i, pp_i, tp_i\): counts= must "
                                           r"return verify.CountRow, got Row"):
        _row({"tp": lambda *c: Row()}, "tp", (0, 0, 1))


def test_mesh_cases_draw_valid_meshes_within_the_world():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from verify._internal.cases.strategies import mesh_cases

    tp_only = verify.adapter(data=broken_mesh.DATA, mesh_axes=("tp",))(broken_mesh.Pipe)

    @settings(max_examples=60, deadline=None, database=None)
    @given(st.data())
    def draw(data):
        a = data.draw(st.sampled_from([broken_mesh.pipe, tp_only]))
        c = data.draw(mesh_cases(a, max_world=4))
        m = c.mesh
        assert 2 <= m.size <= 4 and set(m.axes()) <= set(a.mesh_axes) and c.world == m.dp
        assert c.accum_steps % c.pipeline_chunks == 0 and (c.pipeline_chunks == 1 or m.pp > 1)
        assert c.lengths is None and c.spec().mesh == m and c.spec().pipeline_chunks == c.pipeline_chunks

    draw()


@pytest.mark.distributed
@needs_4
def test_split_invariance_over_mesh_shapes():
    """One window of 4·2·2 rows on every mesh of 4 ranks over (dp, pp): each gives the big batch's step; the
    moving average of scale_grads fails on the first pipelined mesh, named."""
    from verify._internal.gates.mesh import check_mesh_splits

    base = Case(accum_steps=4, micro_batch=4, steps=1, pipeline_chunks=2, seed=1, data_seed=2)
    r = check_mesh_splits(broken_mesh.pipe, base, 4)
    assert r.gate is Gate.MESH_SPLIT_INVARIANCE and r.extra["splits"] == 3 and r.ratio < 1
    with pytest.raises(GateFailure) as e:
        check_mesh_splits(broken_mesh.pipe_ema, base, 4)
    assert e.value.gate is Gate.MESH_SPLIT_INVARIANCE
    assert str(e.value).startswith("[mesh split invariance] mesh dp=1 pp=4 tp=1 of a window of 16 rows: [mesh equivalence] "
                                   "mesh dp=1 pp=4 tp=1, chunks=2, outer=2: "), str(e.value)


# -- counts per axis (verify/_internal/gates/mesh_counts.py) ----------------------------------------------------------

def _c(op, pg, t=0):
    from verify._internal.ranks.comm import Collective

    return Collective(record_id=t, source="fr", backend="gloo", op=op, sizes=((1,),), dtypes=("Float",), pg=pg,
                      thread="?", time_ns=t)


def test_a_collective_is_on_the_axis_of_its_group():
    from verify._internal.gates.mesh_counts import axis_of

    m = Mesh(dp=2, pp=2)
    assert [axis_of(_c("all_reduce", f"{i} 'mesh_{a}'"), m) for i, a in enumerate(("dp", "pp", "tp"))] == ["dp", "pp", "tp"]
    # init_device_mesh reuses the default group for an axis that spans the world; otherwise it is no axis
    assert axis_of(_c("barrier", "0 'default_pg'"), m) is None and axis_of(_c("send", "0 'default_pg'"), Mesh(pp=4)) == "pp"
    assert axis_of(_c("all_reduce", "7 'my_private_group'"), Mesh(tp=2)) is None


def test_outer_steps_group_a_schedules_micro_steps():
    from verify._internal.gates.mesh_counts import outer_units

    micro = [[_c("send", "", m)] for m in range(5)]  # N = 6 micro-steps, chunks 2: outer steps {0,1} {2,3} {4,5}
    units, last = outer_units(micro, [_c("all_reduce", "", 9)], 2)
    assert [[c.time_ns for c in u] for u in units] == [[0, 1], [2, 3]] and [c.time_ns for c in last] == [4, 9]


@pytest.mark.distributed
@needs_2
def test_p2p_is_counted_once_on_gloo():
    """gloo's flight recorder records no send / recv: the hook on ProcessGroup.send / recv does, once."""
    from verify._internal.ranks.pool import get_pool

    got = get_pool(2).run(_p2p_job)
    assert got == [["send", "send"], ["recv", "recv"]], got


def _p2p_job(ctx):
    import torch.distributed as dist

    ctx.recorder.read()
    t = torch.ones(2)
    if ctx.rank == 0:
        dist.send(t, 1)
        dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1)])[0].wait()
    else:
        dist.recv(t, 0)
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)])[0].wait()
    return [c.op for c in ctx.recorder.read()]


@pytest.mark.distributed
@pytest.mark.parametrize("mesh, N", [pytest.param(Mesh(tp=2), 3, marks=needs_2),
                                     pytest.param(Mesh(dp=2, tp=2), 2, marks=needs_4)], ids=str)
def test_a_correct_tensor_parallel_trainer_passes_with_its_counts(mesh, N):
    r = check_mesh(broken_mesh.tp, _case(mesh, N, 1))
    assert r.ratio < 1 and r.extra["counts"]["judged"] == ["dp", "tp"] and not r.extra["counts"]["unjudged"]
    assert r.extra["counts"]["seen"][(0, "tp")] == {"all_reduce": 2 * 2 * N}  # fp32 + float64 runs × K=2 × N


@pytest.mark.distributed
@needs_2
def test_an_axis_without_a_row_is_reported_unjudged_and_rows_are_keyed_by_axis():
    assert check_mesh(broken_mesh.pipe_uncounted, _case(Mesh(pp=2), 2, 2)).extra["counts"]["unjudged"] == ["pp"]
    with pytest.raises(ValueError, match="keyed by axis"):
        check_mesh(broken_mesh.pipe_bad_counts, _case(Mesh(pp=2), 2, 2))


def test_a_cp_axis_numbers_ranks_inside_each_stage_and_slices_each_row():
    """cp sits between pp and tp: rank = ((dp_i·pp + pp_i)·cp + cp_i)·tp + tp_i; coords stay (dp_i, pp_i, tp_i),
    cp_of names the cp index; cp rank c holds tokens [c·S/cp, (c+1)·S/cp) of every row; a cp that does not divide
    the rows' length is refused."""
    import torch

    from verify._internal.ranks.mesh import cp_slice, meshes

    m = Mesh(dp=2, cp=2, tp=2)
    assert m.size == 8 and [m.cp_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [m.coords(r) for r in (0, 3, 5)] == [(0, 0, 0), (0, 0, 1), (1, 0, 1)] and m.rank(1, 0, 1, 1) == 7
    assert m.stage_ranks(1, 0) == [4, 5, 6, 7] and str(m) == "mesh dp=2 pp=1 tp=2 cp=2"
    x = torch.arange(16).view(2, 8)
    assert torch.equal(cp_slice(x, x, Mesh(cp=4), 2)[0], torch.tensor([[4, 5], [12, 13]]))
    with pytest.raises(ValueError, match="cp=3 does not divide the rows' 8 tokens"):
        cp_slice(x, x, Mesh(cp=3), 0)
    assert Mesh(dp=2, cp=2) in meshes(("dp", "cp"), 4) and Mesh(cp=4) in meshes(("dp", "cp"), 4)
    assert all(m.tp == 1 and m.pp == 1 for m in meshes(("dp", "cp"), 4))


# -- padded meshes (issue 42 item 4): a token-weighted trainer's corners pad where a per-rank count shows ------------

def _valid_per_rank(adapter, case):
    """[(window, replica, cp rank, valid targets)] of the case's batches, cut as the harness cuts them."""
    from verify._internal.cases.case import shard
    from verify._internal.ranks.mesh import cp_slice

    out = []
    for k, (x, y) in enumerate(case.batches(adapter)):
        for d in range(case.mesh.dp):
            for c in range(case.mesh.cp):
                ys = [cp_slice(xb, yb, case.mesh, case.mesh.rank(d, 0, 0, c))[1]
                      for xb, yb in shard(x, y, case.accum_steps, d, case.mesh.dp)]
                out.append((k, d, c, sum(int((t != adapter.ignore_index).sum()) for t in ys)))
    return out


def test_token_weighted_mesh_corners_pad_the_last_cp_rank_and_one_replica():
    from examples import context_parallel as cpx
    from verify._internal.cases.corners import corners

    cp, dp = corners(cpx.factory, Gate.MESH_EQUIVALENCE, min_world=2, max_world=4)
    assert (cp.mesh, dp.mesh) == (Mesh(cp=2), Mesh(dp=2)) and cp.lengths and dp.lengths
    n = {(k, c): v for k, _, c, v in _valid_per_rank(cpx.factory, cp)}
    assert 0 < n[(0, 1)] < n[(0, 0)] and n[(1, 1)] == 0 < n[(1, 0)]  # right padding: the last cp rank's tokens
    per = {(k, d): v for k, d, _, v in _valid_per_rank(cpx.factory, dp)}
    assert per[(0, 1)] < per[(0, 0)] and dp.lengths[(1 * 2 + 1) * 2:][:2] == (0, 0)  # replica 1's micro-batch 1 empty
    (split, world), = corners(cpx.factory, Gate.MESH_SPLIT_INVARIANCE, min_world=2, max_world=4)
    assert world == 2 and split.lengths and len(split.lengths) == split.steps * split.effective_batch
    assert [c.lengths for c in corners(broken_mesh.pipe, Gate.MESH_EQUIVALENCE, min_world=2, max_world=2)] == [None]  # no padding


def test_mesh_cases_draw_padding_for_a_token_weighted_adapter():
    from hypothesis import given, settings

    from examples import context_parallel as cpx
    from verify._internal.cases.strategies import mesh_cases, mesh_split_cases

    seen = []

    # a fixed draw: a random one drew 40 cases all padded (or none) once, in a serial run
    @settings(max_examples=40, deadline=None, database=None, derandomize=True)
    @given(mesh_cases(cpx.factory, max_world=4), mesh_split_cases(cpx.factory, max_world=4))
    def draw(c, split):
        for case in (c, split[0]):
            assert case.lengths is None or len(case.lengths) == case.steps * case.effective_batch
        seen.append(c.lengths is not None and c.mesh.cp > 1 and any(n < 8 for n in c.lengths))

    draw()
    assert any(seen) and not all(seen)


@pytest.mark.distributed
@needs_2
def test_a_per_rank_token_mean_over_cp_or_dp_is_rejected_on_padded_rows_and_named_by_the_re_run():
    """Each cp rank's own token mean averaged over cp (each replica's over dp) is exact on unpadded rows: the corners'
    padding rejects it, the re-run without padding passes and names the count's axis. The recipe passes them all."""
    from examples import context_parallel as cpx
    from planted import cp_adapters as ca
    from verify._internal.cases.corners import corners
    from verify._internal.gates.mesh import check_mesh_splits
    from verify._internal.gates.rerun import diagnose

    cp, dp = corners(cpx.factory, Gate.MESH_EQUIVALENCE, min_world=2, max_world=2)
    for case in (cp, dp):
        assert check_mesh(cpx.factory, case).ratio < 1
    (split, world), = corners(cpx.factory, Gate.MESH_SPLIT_INVARIANCE, min_world=2, max_world=2)
    assert check_mesh_splits(cpx.factory, split, world).extra["splits"] == 2
    for bug, case, axis in ((ca.cp_rank_token_mean, cp, "a per-rank token count on the cp axis"),
                            (ca.dp_replica_token_mean, dp, "a per-replica token count on the dp axis")):
        check_mesh(bug, case.replace(lengths=None))  # exact unpadded
        with pytest.raises(GateFailure) as e:
            check_mesh(bug, case)
        assert e.value.gate is Gate.MESH_EQUIVALENCE and str(e.value).startswith(f"[mesh equivalence] {case.mesh}, ")
        line, seen = diagnose(bug, e.value)
        assert seen["unpadded"] is True and axis in line and "unpadded passes" in line, line
