"""verl's legacy PPO actor (examples/verl_actor.py), one adapter per loss_agg_mode, at world 1: verl's own 1/N
scaling of equal micro-batches passes the equivalence gate, and a padded window is rejected where the release's
actor normalises each micro-batch by its own count (verl #5625 / #7321; benchmarks/stacks.py). The plugin runs at
worlds 1 and 2 are release-matrix rows (reports/frameworks/verl)."""
import pytest

from verify import Case, Gate, GateFailure, check

# ray, wandb, datasets...: a fresh `pip install "xtrain-verify[verl]"` takes ~150 s here, so CI does not install it
verl = pytest.importorskip("verl", reason="verl is not installed (the [verl] extra; CI leaves it out: ~150 s)")
actor = pytest.importorskip("examples.verl_actor", reason="this verl has no legacy DataParallelPPOActor (0.8 on)")
from packaging.version import Version  # noqa: E402

# tests.helpers.tiers.imports_framework, not imported: verl's wheel ships a top-level `tests` package that shadows
# this repository's (a namespace package) wherever verl is installed
imports_framework = pytest.mark.slow

MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
EQUAL = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, precision="bf16")
# window 0: micro-batches of 7, 3 and 8 valid tokens, one completion empty; window 1 likewise uneven
PADDED = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, precision="bf16",
              lengths=(6, 1, 0, 3, 6, 2, 1, 6, 4, 0, 5, 6))
# the sequence means leave out an empty completion from 0.6 on: then per micro-batch, as the token mean
PER_MICRO = {"token_mean": True, **{m: Version(verl.__version__) >= Version("0.6") for m in MODES[1:]}}


@imports_framework
@pytest.mark.parametrize("mode", MODES)
def test_equal_micro_batches_pass_the_equivalence_gate(mode):
    assert check(Gate.EQUIVALENCE, getattr(actor, mode), EQUAL).ratio < 1


@imports_framework
@pytest.mark.parametrize("mode", MODES)
def test_a_padded_window_shows_the_per_micro_batch_count(mode):
    adapter = getattr(actor, mode)
    if not PER_MICRO[mode]:
        assert check(Gate.EQUIVALENCE, adapter, PADDED).ratio < 1
        return
    with pytest.raises(GateFailure, match=r"\[equivalence\] .*float64 run fails too"):
        check(Gate.EQUIVALENCE, adapter, PADDED)
