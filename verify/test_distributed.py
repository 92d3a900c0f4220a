"""Gates 3 and 4: data-parallel accumulation (boundary-only communication, equivalence to one process on
the big batch) over (N, B_local, world, S, model, K), for xtrain's trainer and torch DDP no_sync, and
proof that the gates reject the bugs users hit.

Runs on warm rank pools (verify/pool.py): gloo on CPU by default; XTRAIN_DIST_BACKEND=nccl on GPUs.
World sizes from XTRAIN_DIST_MIN_WORLD (default 1) to XTRAIN_DIST_MAX_WORLD (default 4; 8 is an opt-in).
"""
import dataclasses

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from xtrain_core.config import ModelConfig, OptimConfig

from .broken_dist import BROKEN_DIST
from .gates import GateFailure
from .gates_dist import (IMPL_FACTORIES, check_boundary_only, check_distributed, check_world1_single_process,
                         max_world, min_world, run_distributed)
from .interface import Case
from .strategies import dist_cases

pytestmark = pytest.mark.distributed

MAX_WORLD, MIN_WORLD = max_world(), min_world()
BROKEN_WORLDS = dict(min_world=max(2, MIN_WORLD), max_world=max(2, MIN_WORLD, min(MAX_WORLD, 3)))
# Distributed examples cost ~10× a single-process one: a share of the profile's budget (ci: 100).
_BUDGET = settings.default.max_examples
MAIN = max(8, _BUDGET // 2)
SECOND = max(5, _BUDGET // 5)
FEW = max(3, _BUDGET // 30)

needs_2 = pytest.mark.skipif(MAX_WORLD < 2, reason="needs world ≥ 2 (XTRAIN_DIST_MAX_WORLD / GPUs)")


@settings(max_examples=MAIN)
@given(case=dist_cases(min_world=MIN_WORLD, max_world=MAX_WORLD))
def test_xtrain_data_parallel(case):
    """Boundary-only (one coalesced all-reduce per step, P gradient elements + 2 loss scalars) and
    equivalent to one process on the N×B_local×W batch; ranks bitwise identical."""
    event(f"world {case.world}")
    event(f"N {case.accum_steps}")
    report = check_distributed(IMPL_FACTORIES["xtrain"], case)
    if case.world > 1:  # coalesced: a tiny model fits one 25 MiB bucket, so ONE call, never one per parameter
        for (rank, dt), steps in report.steps.items():
            assert [len(s.boundary) for s in steps] == [1] * case.steps, (rank, dt, report.per_step(rank, dt))


@settings(max_examples=SECOND)
@given(case=dist_cases(min_world=MIN_WORLD, max_world=MAX_WORLD))
def test_torch_ddp_no_sync(case):
    """The same gates hold for torch's DistributedDataParallel with no_sync() on micro-steps 0..N-2."""
    check_distributed(IMPL_FACTORIES["torch"], case)


@pytest.mark.skipif(MIN_WORLD > 1, reason="XTRAIN_DIST_MIN_WORLD > 1")
@settings(max_examples=SECOND)
@given(case=dist_cases(min_world=1, max_world=1))
def test_world1_is_the_single_process_path(case):
    check_world1_single_process(case)


@needs_2
@pytest.mark.parametrize("impl", ["xtrain", "torch"])
@settings(max_examples=FEW)
@given(case=dist_cases(min_world=max(2, MIN_WORLD), max_world=MAX_WORLD, min_accum=2))
def test_bytes_per_step_independent_of_N(impl, case):
    """The same case at N and at N=1: identical gradient collectives and bytes in every step."""
    one = dataclasses.replace(case, accum_steps=1)
    got = check_distributed(IMPL_FACTORIES[impl], case)
    want = check_distributed(IMPL_FACTORIES[impl], one)
    for key in want.steps:
        a = [(s.boundary_bytes, len(s.boundary)) for s in got.steps[key]]
        b = [(s.boundary_bytes, len(s.boundary)) for s in want.steps[key]]
        assert a == b, f"{impl} rank/dtype {key}: N={case.accum_steps} {a} vs N=1 {b}"
        assert all(s.boundary_elements >= case.model.n_params for s in got.steps[key])


# -- the gates must reject broken trainers --------------------------------------------------------

@needs_2
@pytest.mark.parametrize("name", sorted(BROKEN_DIST))
@settings(max_examples=FEW)
@given(data=st.data())
def test_rejects_broken(name, data):
    """Every drawn case with N ≥ 2 and W ≥ 2 is rejected, and the message names the micro-step and the
    collective."""
    case = data.draw(dist_cases(**BROKEN_WORLDS, min_accum=2, max_accum=5))
    factory, pattern = BROKEN_DIST[name]
    with pytest.raises(GateFailure) as e:
        check_distributed(factory, case)
    assert e.match(pattern), str(e.value)


@needs_2
def test_over_sync_is_numerically_invisible():
    """Why the counter exists: all-reducing every micro-step gives the right numbers (averaging is
    linear), so only the boundary-only gate rejects it."""
    from .broken_dist import make_AllReduceEveryMicro
    from .gates_dist import check_dist_equivalence

    case = Case(accum_steps=4, micro_batch=2, seq_len=8, steps=2, world=2,
                model=ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16),
                optim=OptimConfig(lr=1e-2))
    outcomes = run_distributed(make_AllReduceEveryMicro, case)
    check_dist_equivalence(outcomes, case)  # passes
    with pytest.raises(GateFailure, match=r"micro-step 0 of 4: 1 gradient collective"):
        check_boundary_only(outcomes, case)
