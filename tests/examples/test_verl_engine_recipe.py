"""verl's engine actor (examples/verl_engine.py, verl 0.9): ppo_loss divides by the mini-batch's global counts, so a
padded window passes the equivalence gate in every loss_agg_mode (the legacy actor's per-micro-batch count, #5625, is
gone); at world 2 each sync mode matches its own count row, and the bytes-per-step gate rejects the sync on every
micro-batch (0.9.1's trainer yaml: N reductions of the gradient a step) where the deferred one (#7719) passes. The
rows' own failures (one sync mode judged by the other's row) need an adapter defined in the recipe's module."""
import importlib.util

import pytest
from packaging.version import Version

from verify import Case, Gate, GateFailure, check

# ray, wandb, datasets...: a fresh `pip install "xtrain-verify[verl]"` takes ~60-150 s here, so CI does not install it
verl = pytest.importorskip("verl", reason="verl is not installed (the [verl] extra; CI leaves it out)")
engine = pytest.importorskip("examples.verl_engine", reason="this verl has no engine platform plugin (0.9 on)")
# 0.9.0's left_right_2_no_padding imports flash_attn.bert_padding (verl/utils/attention_utils.py); 0.9.1 has a torch one
if Version(verl.__version__) < Version("0.9.1") and importlib.util.find_spec("flash_attn") is None:
    pytest.skip("verl < 0.9.1 pads through flash_attn, not installed", allow_module_level=True)
SWITCH = Version(verl.__version__) >= Version("0.9.1")  # use_no_sync_for_gradient_accumulation (PR #7458)
needs_switch = pytest.mark.skipif(not SWITCH, reason="verl 0.9.0 always defers the sync (#7719): no switch to turn off")

# tests.helpers.tiers.imports_framework, not imported: verl's wheel ships a top-level `tests` package that shadows
# this repository's (a namespace package) wherever verl is installed
imports_framework = pytest.mark.slow

MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
EQUAL = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, precision="bf16")
# window 0: micro-batches of 7, 3 and 8 valid tokens, one completion empty; window 1 likewise uneven
PADDED = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, precision="bf16",
              lengths=(6, 1, 0, 3, 6, 2, 1, 6, 4, 0, 5, 6))
TWO_RANKS = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, precision="bf16", world=2)


@imports_framework
@pytest.mark.parametrize("case", (EQUAL, PADDED), ids=("equal", "padded"))
@pytest.mark.parametrize("mode", MODES)
def test_the_global_counts_pass_the_equivalence_gate(mode, case):
    assert check(Gate.EQUIVALENCE, getattr(engine, mode), case).ratio < 1


@imports_framework
@pytest.mark.parametrize("adapter", ("token_mean", pytest.param("token_mean_sync_every_micro", marks=needs_switch)))
def test_each_sync_mode_matches_its_count_row_at_world_2(adapter):
    assert check(Gate.DP_EQUIVALENCE, getattr(engine, adapter), TWO_RANKS).ratio < 1


@imports_framework
@needs_switch
def test_only_the_deferred_sync_keeps_the_bytes_per_step():
    assert check(Gate.BYTES_PER_STEP, engine.token_mean, TWO_RANKS).ratio < 1
    with pytest.raises(GateFailure, match=r"\[bytes per step\] .*15 gradient collective\(s\) at N=3, .* 7 at N=1"):
        check(Gate.BYTES_PER_STEP, engine.token_mean_sync_every_micro, TWO_RANKS)
