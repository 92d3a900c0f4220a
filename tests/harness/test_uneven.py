"""Uneven windows (Case.rank_rows): ranks holding different rows and micro-steps, drawn only for an adapter that
declares `uneven`; the data-parallel gate on them (gloo, world 2), the planted trainers of planted/uneven_adapters.py,
and the self-test's equal_rank_weights operator."""
import pytest
import torch
from hypothesis import given, settings

from planted import uneven_adapters as ua
from planted.registry import UNEVEN
from verify import Gate
from verify._internal.cases.case import Case, shard
from verify._internal.cases.strategies import dist_cases
from verify._internal.gates.table import random_budget
from verify._internal.cases.corners import corners
from verify._internal.gates import GateFailure, check_distributed
from verify._internal.gates.distributed import F32
from verify.selftest.operators import OPERATORS

pytestmark = pytest.mark.distributed
EVEN = UNEVEN.replace(rank_rows=None, accum_steps=3, micro_batch=2)
NOT_DECLARED = ua.global_count.replace(uneven=False)


def test_a_case_with_rank_rows_derives_its_window_and_prints_it():
    c = UNEVEN
    assert (c.accum_steps, c.micro_batch, c.effective_batch, c.micro_blocks) == (3, 3, 10, 5)
    assert [c.micro_steps(r) for r in range(2)] == [3, 2] and c.spec(rank=1).accum_steps == 2
    assert "rank_rows=[[2, 2, 2], [3, 1]]" in str(c) and c.as_dict()["rank_rows"] == [[2, 2, 2], [3, 1]]
    assert (EVEN.uneven, EVEN.effective_batch, EVEN.micro_blocks, "rank_rows" in str(EVEN)) == (False, 12, 6, False)
    with pytest.raises(ValueError, match="rank_rows must hold, for each of the world's 2 ranks"):
        Case(accum_steps=1, micro_batch=1, steps=1, world=2, rank_rows=((1,),))


def test_the_ranks_micro_batches_are_the_big_batch_in_order():
    x = torch.arange(10).reshape(10, 1)
    got = [shard(x, x, 3, r, 2, UNEVEN.rank_rows) for r in range(2)]
    assert [[b.flatten().tolist() for b, _ in rank] for rank in got] == [[[0, 1], [5, 6], [8, 9]], [[2, 3, 4], [7]]]
    rows = torch.arange(12).reshape(12, 1)  # even: rank_rows None keeps shard's old layout
    assert [b.flatten().tolist() for b, _ in shard(rows, rows, 3, 1, 2)] == [[2, 3], [6, 7], [10, 11]]


def test_uneven_windows_are_drawn_in_every_profile_only_where_declared():
    hard = corners(ua.global_count, Gate.DP_EQUIVALENCE, min_world=1, max_world=2)  # every profile draws its corners
    assert [c.rank_rows for c in hard if c.uneven] == [((2, 2, 2), (3, 1))]
    assert not any(c.uneven for c in corners(NOT_DECLARED, Gate.DP_EQUIVALENCE, min_world=1, max_world=2))
    seen = {"declared": [], "not": []}

    @settings(max_examples=random_budget(Gate.DP_EQUIVALENCE, hard), deadline=None,
              derandomize=True, database=None)
    @given(a=dist_cases(ua.global_count, min_world=2, max_world=2), b=dist_cases(NOT_DECLARED, min_world=2, max_world=2))
    def draw(a, b):
        seen["declared"].append(a)
        seen["not"].append(b)

    draw()
    uneven = [c for c in seen["declared"] if c.uneven]
    assert uneven and all(len(set(c.rank_rows)) > 1 for c in uneven), seen["declared"]
    assert not any(c.uneven for c in seen["not"])


def test_a_global_count_trainer_passes_and_each_rank_keeps_its_own_boundary():
    r = check_distributed(ua.global_count, UNEVEN)
    steps = r.extra["comm"].steps
    assert [len(steps[(rank, F32)][0].micro) for rank in (0, 1)] == [2, 1]  # micro-steps 0..N_r-2: no collective
    assert r.extra["boundary_collectives"] == [1, 1], r


def test_equal_rank_weights_passes_even_windows_and_is_named_on_uneven_ones():
    check_distributed(ua.equal_rank_weights, EVEN)  # correct where every rank holds the same rows
    with pytest.raises(GateFailure, match=r"rank 0: 6 of 10 rows, weight 1/2 where 0\.6 \(×0\.833\); rank 1: 4 of "
                                          r"10 rows, weight 1/2 where 0\.4 \(×1\.25\)"):
        check_distributed(ua.equal_rank_weights, UNEVEN)


def test_the_operator_exists_only_on_uneven_windows_and_is_killed():
    from verify.selftest import run_selftest

    op = OPERATORS["equal_rank_weights"]
    assert op.exists(UNEVEN) and not op.exists(EVEN) and not op.exists(UNEVEN.replace(rank_rows=((2, 3), (3, 2))))
    res = run_selftest(ua.global_count, max_world=2, operators=["equal_rank_weights"])
    assert res.baseline_ok and res.rows["equal_rank_weights"]["verdict"] == "killed", res.rows
