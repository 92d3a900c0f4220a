"""One boundary rule (verify/_internal/gates/counts.py): a trainer without a count table row is judged by the default
row, built from its gradient size, through the same check as a declared row; one op-name normaliser
(verify._internal.ranks.comm.family) for rows, declarations and the counter. Fake collectives, no process group."""
import ast
import dataclasses
import itertools
import pathlib
import re

import pytest
from verify._internal.ranks.comm import Collective, family
from verify._internal.gates.counts import SCALARS, CountRow, check_step, excused
from verify._internal.protocol import Expected

ROOT = pathlib.Path(__file__).resolve().parents[2]
_ids = itertools.count()


def _c(op: str, n: int = 1, dtype: str = "Float", group: str = "0") -> Collective:
    return Collective(next(_ids), "fr", "gloo", op, ((n,),), (dtype,), f"{group} ''", "1", 0, group)


def _step(row, micro, boundary, W=2, expected=(), links=None):
    return check_step(row, micro, boundary, 0, W, expected, lambda c: f"{c.op}[{c.numel}]", links=links)


def test_c10d_names_of_one_operation_are_one_family():
    assert {family(op) for op in ("all_reduce", "allreduce_coalesced", "_allreduce_base", "ALLREDUCE")} == {"all_reduce"}
    assert {family(op) for op in ("all_gather", "_allgather_base", "allgather_into_tensor_coalesced")} == {"all_gather"}
    assert family("_reduce_scatter_base") == "reduce_scatter" and family("reduce") == "reduce"


def test_the_default_row_is_built_from_the_gradient_size():
    row = CountRow.default(100, 120)
    assert (row.before, row.boundary, row.elements) == ({}, None, (100, 120 + SCALARS))
    assert _step(row, [[], []], [_c("allreduce_coalesced", 101)]) == ([], None)  # the gradient once + a scalar


def test_the_default_row_keeps_its_messages():
    row = CountRow.default(100, 100)
    _, msg = _step(row, [[_c("all_reduce", 100)], []], [])
    assert msg.startswith("step 0, micro-step 0 of 3: 1 collective(s) before the boundary: all_reduce[100] — "
                          "micro-steps 0..1 must not communicate")
    assert "no gradient all-reduce" in _step(row, [[]], [])[1] and _step(row, [[]], [], W=1) == ([], None)
    assert "cover 60 of 100 gradient elements" in _step(row, [[]], [_c("all_reduce", 60)])[1]
    assert "gradients reduced more than once" in _step(row, [[]], [_c("all_reduce", 100)] * 2)[1]
    assert _step(row, [[]], [_c("broadcast", 999), _c("all_reduce", 100, "Long")])[1].startswith(
        "step 0, boundary (micro-step 1 of 2, grads(), optimizer_step()): no gradient")  # neither carries gradients


def test_a_declaration_excuses_its_family_only():
    counted = (Expected("all_reduce", dtype="integer", why="token count"),)
    used, msg = _step(CountRow.default(10, 10), [[_c("_allreduce_base", 1, "Long")]], [_c("all_reduce", 10)],
                      expected=counted)
    assert msg is None and [(m, e.why) for m, e, _ in used] == [(0, "token count")]
    ok, rest = excused([_c("reduce", 1, "Long"), _c("all_reduce", 1, "Float")], counted, 0, 0, 2)
    assert ok == [] and len(rest) == 2  # another family; the right family but floating


def test_a_declared_row_goes_through_the_same_check():
    fsdp = CountRow("fsdp", before={"all_gather": 2}, boundary={"all_gather": 2, "reduce_scatter": 1}, elements=(8, 9))
    gathers = [_c("_allgather_base", 50), _c("all_gather_into_tensor", 50)]
    assert _step(fsdp, [gathers], gathers + [_c("reduce_scatter", 8)]) == ([], None)  # gathers carry no gradient
    assert "count table row 'fsdp' expects all_gather×2, observed all_gather×1" in _step(fsdp, [gathers[:1]], [])[1]
    assert "the reductions carry 16 floating elements" in _step(fsdp, [gathers], gathers + [_c("reduce_scatter", 16)])[1]


def test_a_rows_side_traffic_is_sized_and_carries_no_gradient():
    """A framework's metrics, reduced per micro-step at the boundary (TRL's compute_loss): declared by size, they
    leave the gradient's elements exact; a collective of another size, or one over the count, is carried."""
    metrics = (Expected("all_reduce", count=4, dtype="floating", numel=2, why="logged means"),)
    row = CountRow("metrics", before={}, boundary=None, elements=(100, 100), carriers=None, side=metrics)
    assert _step(row, [[]], [_c("all_reduce", 2)] * 4 + [_c("all_reduce", 100)]) == ([], None)
    assert "carry 102 floating elements" in _step(row, [[]], [_c("all_reduce", 2)] * 5 + [_c("all_reduce", 100)])[1]
    assert "carry 103 floating elements" in _step(row, [[]], [_c("all_reduce", 3), _c("all_reduce", 100)])[1]
    with pytest.raises(ValueError, match="side entry .* has no numel"):  # unsized, it could excuse a gradient
        CountRow("metrics", side=(Expected("all_reduce", count=4),))


# HSDP: group "1" within the node, group "2" across nodes (comm.group_links' map)
LINKS = {"1": "intra-node", "2": "inter-node"}
HSDP = CountRow("hsdp", before={"all_reduce@intra-node": 1},
                boundary={"all_reduce@intra-node": 1, "all_reduce@inter-node": 1})


def test_a_row_counts_a_family_per_link_where_its_keys_name_one():
    intra, inter = _c("all_reduce", 9, group="1"), _c("allreduce_coalesced", 9, group="2")
    assert _step(HSDP, [[intra]] * 2, [intra, inter], links=LINKS) == ([], None)
    _, msg = _step(HSDP, [[intra, inter], [intra]], [intra, inter], links=LINKS)
    assert msg == ("step 0, micro-step 0 of 3 (before the boundary): count table row 'hsdp' expects "
                   "all_reduce@intra-node×1, observed all_reduce@inter-node×1, all_reduce@intra-node×1: "
                   "allreduce_coalesced[9] (inter-node); all_reduce[9] (intra-node)")
    _, msg = _step(HSDP, [[intra]], [intra, intra], links=LINKS)  # the cross-node reduction went within the node
    assert "expects all_reduce@inter-node×1, all_reduce@intra-node×1, observed all_reduce@intra-node×2" in msg
    assert "observed all_reduce@inter-node×1" in _step(HSDP, [[_c("all_reduce", group="9")]], [], links=LINKS)[1]  # an
    # unknown group counts as inter-node (comm.link_of); a family the row names without a link counts every link:
    plain = CountRow("plain", boundary={"all_reduce": 2})
    assert _step(plain, [[]], [intra, inter], links=LINKS) == ([], None) == _step(plain, [[]], [intra, inter])


def test_a_row_names_its_links_right_and_the_check_gets_them():
    with pytest.raises(ValueError, match=r"before key 'all_reduce@nvlink' names link 'nvlink'; use "
                                         r"all_reduce@intra-node or all_reduce@inter-node"):
        CountRow("x", before={"all_reduce@nvlink": 1})
    with pytest.raises(ValueError, match=r"boundary key 'all_reduce' has no link while another key names one"):
        CountRow("x", before={"all_reduce@intra-node": 1}, boundary={"all_reduce": 2})
    with pytest.raises(ValueError, match=r"counts all_reduce per link, and no group -> link map was given"):
        _step(HSDP, [[_c("all_reduce")]], [])


def _folds_op_names(tree) -> list[int]:
    """Lines that fold an op name by hand: `<...op>.lower()` / `.replace(...)` / `.upper()`."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("lower", "upper", "replace", "casefold")
            and re.search(r"(^|\.)op$", ast.unparse(n.func.value).split("(")[0])]


def test_one_op_normaliser():
    """Only verify/_internal/ranks/comm.py folds op names (case, underscores): everything else calls comm.family."""
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "verify").rglob("*.py")) if p.name != "comm.py"
           for line in _folds_op_names(ast.parse(p.read_text(encoding="utf-8")))]
    assert not bad, bad
    assert sorted(_folds_op_names(ast.parse("def _norm(op):\n    return op.replace('_', '').lower()\nc.op.lower()"))) == [2, 3]


def test_a_rows_reduce_scatter_is_read_as_what_gloo_records():
    """gloo has no reduce-scatter: torch runs one as an all-reduce and the recorder writes that (comm.RECORDED_AS). A row
    names what the trainer calls, once: on gloo its reduce_scatter counts as all_reduce, ranges and links included;
    elsewhere it stays a reduce_scatter, and a wrong count fails on both."""
    from verify._internal.gates.counts import as_recorded

    zero = CountRow("zero", before={}, boundary={"reduce_scatter": 1, "all_gather": 1, "all_reduce": 1})
    gloo = [_c("all_reduce", 8), _c("all_gather", 8), _c("all_reduce", 1)]
    assert _step(zero, [[]], gloo) == ([], None)
    nccl = [dataclasses.replace(c, backend="nccl") for c in gloo]
    _, msg = _step(zero, [[]], nccl)  # on NCCL an all-reduce is no reduce-scatter
    assert "expects all_gather×1, all_reduce×1, reduce_scatter×1, observed all_gather×1, all_reduce×2" in msg
    assert "records" not in msg and _step(zero, [[]], [nccl[1], nccl[2], _c_nccl("_reduce_scatter_base", 8)]) == ([], None)
    _, msg = _step(zero, [[]], gloo[1:])  # one all-reduce short on gloo
    assert msg.endswith("(gloo records each reduce_scatter as an all_reduce, so the row's reduce_scatter counts as "
                        "all_reduce here: docs/design/distributed.md, \"Count tables\")"), msg
    assert as_recorded({"reduce_scatter": (1, None), "all_reduce": 2, "reduce_scatter@inter-node": 1}, "gloo") == \
        {"all_reduce": (3, None), "all_reduce@inter-node": 1}
    assert as_recorded({"reduce_scatter": 1}, "nccl") == {"reduce_scatter": 1}
    # an Expected names the call too; a row may not link one family and leave its gloo twin bare
    ok, rest = excused([_c("all_reduce", 4)], (Expected("reduce_scatter", dtype="floating"),), 0, 0, 2)
    assert len(ok) == 1 and rest == []
    with pytest.raises(ValueError, match=r"key 'all_reduce' has no link while a family gloo records as the same one "
                                         r"names a link"):
        CountRow("x", before={"reduce_scatter@intra-node": 1}, boundary={"all_reduce": 1})


def _c_nccl(op: str, n: int = 1) -> Collective:
    return dataclasses.replace(_c(op, n), backend="nccl")
