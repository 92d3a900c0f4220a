"""The gates on token-weighted, mixed-precision and long windows: xtrain passes them, and the planted bugs
of planted/broken_numerics.py are rejected wherever they can exist."""
import pytest
from tests.helpers.tiers import dev_first, imports_framework
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planted import broken_numerics as bn
from planted import registry as planted
from xtrain_proof import adapters as xtrain
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure, check_distributed, check_equivalence
from verify._internal.gates.worlds import max_world
from verify._internal.gates.windows import check_partial_sums, check_split_invariance, splits
from verify._internal.cases.strategies import budget, cases, dist_cases
from xtrain_core.config import ModelConfig, OptimConfig

WORLDS = min(3, max_world())
SMALL = xtrain.XtrainOptions(model=ModelConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=1, d_model=8), seq_len=4,
                             optim=OptimConfig(lr=1e-2))



def test_a_lucky_big_batch_loss_does_not_fail_a_correct_fp16_trainer():
    """Drawn by the dev profile: the fp16 big batch's loss came out 1.9e-7 from float64 (another kernel
    path for 7 rows), the correct accumulation's 2.7e-6 > 8×1.9e-7 + F. The autocast loss takes the big
    batch's error over all gradients as its floor, like every single tensor."""
    o = xtrain.XtrainOptions(model=ModelConfig(vocab_size=48, seq_len=24, n_layer=2, n_head=1, d_model=16), seq_len=5,
                             optim=OptimConfig(lr=1e-3, weight_decay=0.0))
    case = Case(accum_steps=7, micro_batch=1, steps=1, seed=600, data_seed=276, options=o, precision="fp16")
    assert check_equivalence(xtrain.adapter, case).ratio < 1


def test_the_loss_has_the_condition_number_of_its_blocks():
    """κ of the loss: max |block loss| / |loss|, beside each parameter's; 1 where the loss is 0 or undefined."""
    import torch

    from verify._internal.cases.case import Trace
    from verify._internal.gates.tolerance import LOSS, conditions

    g = {"w": torch.ones(2, dtype=torch.float64)}
    blocks = [Trace([v], g, []) for v in (-0.494, 0.459, -0.009)]
    assert conditions(blocks, Trace([-0.0146], g, []))[LOSS] == pytest.approx(0.494 / 0.0146)
    assert conditions(blocks, Trace([0.0], g, []))[LOSS] == 1.0
    assert conditions(blocks, Trace([float("nan")], g, []))[LOSS] == 1.0


@imports_framework
@pytest.mark.skipif(__import__("importlib").util.find_spec("trl") is None, reason="trl is not installed")
def test_a_policy_gradient_loss_whose_micro_batches_cancel_is_not_rejected():
    """TRL's grpo loss on this case: block losses -0.494, 0.459, -0.009 of a window loss -0.0146 (κ 33.8). Its
    correct accumulation loses 1.5e-6 relative, against the big batch's lucky 1.4e-8: rejected at κ = 1 (a CI
    run, before the loss had its κ), within 8·eps32·κ now."""
    from examples.trl_grpo import grpo

    case = Case(accum_steps=3, micro_batch=2, steps=1, seed=8922, data_seed=0)
    assert check_equivalence(grpo, case).ratio < 1


def test_splits_enumerates_every_factorization():
    assert splits(4, 2) == [(1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2)]
    assert all(n * b * w == 12 for n, b, w in splits(12, 4)) and len(splits(12, 4)) == 15


@pytest.mark.distributed
@settings(max_examples=budget(25, 4), deadline=None)
@given(data=st.data())
def test_xtrain_tokens_is_split_invariant_on_padded_windows(data):
    case = data.draw(cases(xtrain.tokens_adapter, max_accum=4, max_micro_batch=2, max_steps=2, padded=True))
    check_split_invariance(xtrain.tokens_adapter, case, max_world=WORLDS)


@pytest.mark.distributed
@settings(max_examples=budget(10, 5), deadline=None)
@given(data=st.data())
def test_torch_ddp_tokens_passes_the_data_parallel_gates_on_padded_data(data):
    check_distributed(xtrain.torch_ddp_tokens, data.draw(dist_cases(xtrain.torch_ddp_tokens, max_world=WORLDS)))


def _uneven(case) -> bool:
    """Some step holds rows with different numbers of valid targets, and some valid target at all."""
    E = case.effective_batch
    steps = [case.lengths[k * E:(k + 1) * E] for k in range(case.steps)]
    return any(len(set(s)) > 1 and sum(s) > 0 for s in steps)


def _ranks_uneven(case) -> bool:
    """Some split (N, B, W ≥ 2) of some step's window gives two ranks different valid-token counts (rank r
    takes rows [(n·W + r)·B, (n·W + r + 1)·B) of micro-step n: verify._internal.cases.case.shard)."""
    E = case.effective_batch
    for k in range(case.steps):
        rows = case.lengths[k * E:(k + 1) * E]
        for n, b, w in splits(E, WORLDS):
            counts = {sum(sum(rows[(i * w + r) * b:(i * w + r + 1) * b]) for i in range(n)) for r in range(w)}
            if w > 1 and len(counts) > 1:
                return True
    return False


@pytest.mark.distributed
@pytest.mark.parametrize("name", dev_first([b.name for b in planted.of_gate("split invariance")]))
@settings(max_examples=budget(30, 3), deadline=None)
@given(data=st.data())
def test_split_invariance_rejects_broken_token_weighting(name, data):
    """Each bug agrees with the big batch while every block of rows holds as many valid tokens as every
    other: on windows whose rows differ it must be rejected, naming the split."""
    adapter = planted.BY_NAME[name].adapter
    case = data.draw(cases(adapter, min_accum=2, max_accum=4, max_micro_batch=2, max_steps=1, padded=True))
    assume(_uneven(case))
    if name == "per_rank_mean":  # visible only where some split gives the ranks different token counts
        assume(WORLDS >= 2 and _ranks_uneven(case))
    if name == "count_divided_twice":  # ÷1 twice is ÷1: a window of one valid token cannot show it
        E = case.effective_batch
        assume(any(sum(case.lengths[k * E:(k + 1) * E]) > 1 for k in range(case.steps)))
    with pytest.raises(GateFailure, match=r"^\[split invariance\] split N=\d+ B=\d+ W=\d+ of a window of \d+ rows: \["):
        check_split_invariance(adapter, case, max_world=WORLDS)


@pytest.mark.parametrize("name", ["unscale_update_every_micro", "manual_unscale_every_micro"])
@settings(max_examples=budget(30, 3), deadline=None)
@given(data=st.data())
def test_equivalence_rejects_grad_scaler_misuse(name, data):
    adapter = getattr(bn, name)
    case = data.draw(cases(adapter, min_accum=2, max_accum=6)).replace(precision="fp16")
    with pytest.raises(GateFailure, match=r"^\[equivalence\] ") as e:
        check_equivalence(adapter, case)
    assert "overflowed" not in str(e.value), str(e.value)  # the misuse itself, not loss scaling
    check_equivalence(xtrain.single, case)  # the same fp16 case passes with the scaler used right


@pytest.mark.slow  # N up to 64 in bf16: ~6 s
def test_xtrain_passes_where_a_bf16_accumulation_buffer_is_rejected():
    """Rounding in a bf16 buffer grows with N (reports/cpu/bf16-accumulation.md plots it): on the long window
    where the planted bf16_accumulation_buffer is rejected (its case in planted/registry.py),
    xtrain's fp32 accumulation of the same bf16 micro-steps passes."""
    case = planted.BY_NAME["bf16_accumulation_buffer"].case
    assert case.accum_steps == 256 and case.precision == "bf16"
    assert check_equivalence(xtrain.single, case).ratio < 0.5


@pytest.mark.slow  # N = 64
def test_a_micro_step_dropped_only_at_n_64_is_found_where_it_happens():
    long = planted.BY_NAME["drop_micro_63"].case  # N = 96: partial sums reject it there (test_planted.py)
    short = long.replace(accum_steps=63)
    check_equivalence(bn.drop_micro_63, short)  # N < 64: the bug does not exist
    check_partial_sums(bn.drop_micro_63, short)
    with pytest.raises(GateFailure, match=r"^\[equivalence\] "):
        check_equivalence(bn.drop_micro_63, long)


def test_a_doubling_accumulator_hidden_by_clipping_is_found_at_micro_step_1():
    """Clipping at 0.01 hides the doubling at the boundary; partial sums reject it at micro-step 1 (the
    registry's case, test_planted.py), where xtrain passes."""
    case = planted.BY_NAME["doubling_buffer"].case
    check_partial_sums(xtrain.single, case)


@settings(max_examples=budget(30, 3), deadline=None)
@given(data=st.data())
def test_partial_sums_hold_for_xtrain_in_every_precision_and_norm(data):
    adapter = data.draw(st.sampled_from([xtrain.single, xtrain.tokens_adapter]))
    case = data.draw(cases(adapter, min_accum=2, max_accum=12, max_steps=1))
    check_partial_sums(adapter, case)


def test_kappas_block_runs_keep_norms_and_no_parameters():
    """κ reads each block gradient's norm and the block's loss: at a billion float64 parameters a kept copy of either
    gradients or parameters per block would cost 8 GiB of host memory each (verify.gpu_gate --scale)."""
    import torch

    from verify._internal.cases.case import Case
    from verify._internal.gates.kappa import block_runs

    case = Case(accum_steps=3, micro_batch=2, steps=1, seed=1, data_seed=2)
    runs = block_runs(xtrain.single, case, "cpu")
    assert len(runs) == 3 and all(r.params == [{}] for r in runs)
    assert all(v.dim() == 0 and v.dtype == torch.float64 for r in runs for v in r.grads0.values())


def test_the_scale_profile_draws_windows_a_billion_parameter_trainer_can_hold():
    from hypothesis import find, settings

    from verify._internal.cases.strategies import SCALE_ACCUM, SCALE_MICRO, SCALE_STEPS, cases
    from verify._internal.settings import current, using

    with using(current().replace(hypothesis_profile="scale")):
        big = find(cases(xtrain.single), lambda c: c.accum_steps >= SCALE_ACCUM and c.micro_batch >= SCALE_MICRO
                   and c.steps >= SCALE_STEPS)
        assert (big.accum_steps, big.micro_batch, big.steps) == (SCALE_ACCUM, SCALE_MICRO, SCALE_STEPS)
        from hypothesis.errors import NoSuchExample

        with pytest.raises(NoSuchExample):  # 300 draws (find's default, 2000, took 7 s of the dev loop)
            find(cases(xtrain.single), lambda c: c.accum_steps > SCALE_ACCUM or c.micro_batch > SCALE_MICRO
                 or c.steps > SCALE_STEPS, settings=settings(max_examples=300, database=None))
