"""The data-parallel gates on xtrain's own trainers, and proof that they reject the bugs users hit
(planted/broken_dist.py) with a message naming the micro-step and the collective.
(The gates' runs on the default adapter are verify/test_gates_dist.py.)"""
import pytest
from tests.helpers.tiers import dev_first
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planted import broken_dist, registry as planted
from tests.helpers import dist_jobs
from xtrain_proof import adapters as xtrain
from xtrain_proof.adapters import XtrainOptions
from verify._internal.cases.case import Case
from verify._internal.gates import (GateFailure, check_boundary_only, check_dist_equivalence, check_distributed, run_distributed)
from verify._internal.gates.worlds import max_world, min_world
from verify._internal.ranks.pool import get_pool
from verify._internal.cases.strategies import budget, dist_cases
from xtrain_core.config import ModelConfig, OptimConfig

pytestmark = pytest.mark.distributed

MAX_WORLD, MIN_WORLD = max_world(), min_world()
BROKEN_WORLDS = dict(min_world=max(2, MIN_WORLD), max_world=max(2, MIN_WORLD, min(MAX_WORLD, 3)))
needs_2 = pytest.mark.skipif(MAX_WORLD < 2, reason="needs world ≥ 2 (XTRAIN_DIST_MAX_WORLD / GPUs)")
SMALL = XtrainOptions(model=ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16), seq_len=8,
                      optim=OptimConfig(lr=1e-2))



@needs_2
@pytest.mark.parametrize("adapter", [xtrain.adapter, xtrain.tokens_adapter], ids=["mean", "tokens"])
@settings(max_examples=budget(10, 5), deadline=None)
@given(data=st.data())
def test_xtrain_sends_one_coalesced_all_reduce_per_step(adapter, data):
    """A small model fits one 25 MiB bucket: ONE all-reduce per optimizer step, never one per parameter —
    and under loss_norm="tokens" (padded data) still one: the global token count rides in it, where
    torchtitan adds an all-reduce and Transformers an all_gather before the step."""
    case = data.draw(dist_cases(adapter, min_world=max(2, MIN_WORLD), max_world=MAX_WORLD))
    r = check_distributed(adapter, case)
    for (rank, dt), steps in r.extra["comm"].steps.items():
        assert [len(s.reduced) for s in steps] == [1] * case.steps, (rank, dt, r.extra["comm"].per_step(rank, dt))


@settings(max_examples=budget(5, 5), deadline=None)
@given(data=st.data())
def test_torch_ddp_no_sync(data):
    """The same gates hold for torch's DistributedDataParallel with no_sync() on micro-steps 0..N-2."""
    check_distributed(xtrain.torch_ddp, data.draw(dist_cases(xtrain.torch_ddp, min_world=MIN_WORLD, max_world=MAX_WORLD)))


@pytest.mark.skipif(MIN_WORLD > 1, reason="XTRAIN_DIST_MIN_WORLD > 1")
@settings(max_examples=budget(5, 5), deadline=None)
@given(data=st.data())
def test_world1_is_the_single_process_path(data):
    """DistAccumTrainer at world 1: no collective, and every loss, step-0 gradient and parameter after
    every step bit-identical (torch.equal) to AccumTrainer's."""
    from verify._internal.gates.tolerance import Judge

    case = data.draw(dist_cases(xtrain.adapter, min_world=1, max_world=1))
    got, want, n = get_pool(1).run(dist_jobs.world1_job, case)[0]
    assert n == 0, f"{n} collective(s) issued with nobody to talk to; case {case}"
    Judge("world 1 = single process", case).bit_exact(got, want, "DistAccumTrainer")


# -- the gates must reject broken trainers --------------------------------------------------------

@needs_2
@pytest.mark.parametrize("name", dev_first([b.name for b in planted.of_gate("boundary-only", "data-parallel equivalence",
                                                                             module="broken_dist") if "fsdp2" not in b.name]))
@settings(max_examples=budget(30, 3), deadline=None)
@given(data=st.data())
def test_rejects_broken(name, data):
    """Every drawn case with N ≥ 2 and W ≥ 2 is rejected, and the message names the micro-step and the
    collective."""
    adapter, pattern = planted.BY_NAME[name].adapter, planted.BY_NAME[name].pattern
    case = data.draw(dist_cases(adapter, **BROKEN_WORLDS, min_accum=2, max_accum=5))
    with pytest.raises(GateFailure) as e:
        check_distributed(adapter, case)
    assert e.match(pattern), str(e.value)


@needs_2
def test_over_sync_is_numerically_invisible():
    """Why the counter exists: all-reducing every micro-step gives the right numbers (averaging is
    linear), so only the boundary-only gate rejects it."""
    case = Case(accum_steps=4, micro_batch=2, steps=2, world=2, options=SMALL)
    outcomes = run_distributed(broken_dist.all_reduce_every_micro, case)
    check_dist_equivalence(outcomes, case)  # passes
    with pytest.raises(GateFailure, match=r"micro-step 0 of 4: 1 collective\(s\) before the boundary"):
        check_boundary_only(outcomes, case)


@needs_2
def test_undeclared_ddp_bucket_rebuild_is_a_failure():
    """The boundary-only rule is 'no collective at all' on micro-steps 0..N-2: DDP's one-time bucket
    rebuild (integer broadcasts at micro-step 0 of step 1) passes only because its adapter declares it."""
    case = Case(accum_steps=3, micro_batch=1, steps=2, world=2, options=SMALL)
    outcomes = run_distributed(xtrain.torch_ddp, case)
    check_boundary_only(outcomes, case, expected=xtrain.torch_ddp.expected)  # declared: passes
    with pytest.raises(GateFailure, match=r"step 1, micro-step 0 of 3: 2 collective\(s\) before the boundary: "
                                          r"\S+:broadcast int32"):
        check_boundary_only(outcomes, case, expected=())


@needs_2
def test_bytes_per_step_counted_for_the_report():
    case = Case(accum_steps=2, micro_batch=1, steps=2, world=2, options=SMALL)
    r = check_distributed(xtrain.adapter, case)
    P = SMALL.model.n_params
    assert r.extra["gradient_bytes"] == 4 * P
    assert r.extra["boundary_bytes"] == [4 * (P + 2)] * 2  # the gradients once, plus the two loss slots
    assert r.extra["boundary_collectives"] == [1, 1]
    assert torch.float32  # noqa: B015 (keeps the import honest on minimal torch builds)


@needs_2
def test_a_bf16_big_batch_far_from_its_reference_is_said_unjudged_on_every_rank_gate():
    """Judge.sees under autocast: not refused (an honest bf16 big batch can come near 1/C), and the data-parallel
    gate's result carries the note as the one-process gate's does (the report's "Not checked" lines read it)."""
    r = check_distributed(broken_dist.other_reference, planted.BY_NAME["dist_other_reference"].case.replace(
        precision="bf16"))
    assert "admits any gradient; the float64 checks judged" in (r.extra.get("unjudged") or ""), r.extra
