"""Gates 1 and 2: big-batch equivalence and bit-exact accum_steps=1, and proof that they can fail."""
import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from xtrain_core.config import ModelConfig, OptimConfig

from . import stats
from .broken import BROKEN, N1ScaledByOne, factory
from .gates import GateFailure, check_bit_exact, check_equivalence
from .interface import Case, xtrain_factory
from .strategies import cases


@given(cases())
def test_accumulation_equals_big_batch(case):
    c = check_equivalence(xtrain_factory, case)
    stats.record("equivalence", ratio=c.worst_ratio, where=f"{c.worst} @ {case}")


@given(cases(max_accum=1, max_micro_batch=8))
def test_accum1_bit_identical_to_plain(case):
    check_bit_exact(xtrain_factory, case)
    stats.record("bit_exact")


# -- the gates must fail on broken trainers -------------------------------------------------------

@pytest.mark.parametrize("name", [n for n, (_, g) in sorted(BROKEN.items()) if g == "equivalence"])
@settings(max_examples=6)
@given(data=st.data())
def test_equivalence_rejects(name, data):
    """Every drawn case with N ≥ 2 (where these bugs exist) must be rejected."""
    case = data.draw(cases(min_accum=2, max_accum=6))
    if name == "scheduler_step_every_micro" and case.optim.warmup_steps < 2:
        # warm-up over 0 or 1 steps is a constant LR: the bug needs a schedule that moves to exist
        case = dataclasses.replace(case, optim=dataclasses.replace(case.optim, warmup_steps=2))
    with pytest.raises(GateFailure, match=r"^\[equivalence\S*\] .+ case N=\d"):
        check_equivalence(BROKEN[name][0], case)


@settings(max_examples=10)
@given(cases(max_accum=1, max_micro_batch=6))
def test_bit_exact_rejects_other_reduction_at_n1(case):
    """Sum-then-divide is exact when B·S is a power of two (scaling by 2^-k commutes with every rounding),
    so the bug only exists, and is only required to be caught, for other B·S."""
    n = case.micro_batch * case.seq_len
    assume(n & (n - 1) != 0)
    with pytest.raises(GateFailure, match=r"^\[bit-exact accum=1\] (gradient|parameter) .+ not bit-identical, max\|Δ\| = \d"):
        check_bit_exact(BROKEN["n1_different_reduction"][0], case)


def test_scaling_by_one_is_not_a_bug():
    """Control: x * 1.0 is bit-exact (GUIDE §4), so always scaling by 1/N passes the bit-exact gate."""
    case = Case(accum_steps=1, micro_batch=3, seq_len=8, steps=2,
                model=ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16),
                optim=OptimConfig(lr=1e-2, warmup_steps=1))
    check_bit_exact(factory(N1ScaledByOne), case)


def test_missing_scale_message_names_parameter_and_error():
    case = Case(accum_steps=4, micro_batch=2, seq_len=8, steps=1,
                model=ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=1, d_model=8),
                optim=OptimConfig(max_grad_norm=None))
    with pytest.raises(GateFailure, match=r"gradient \(step 0\) of '.+': accumulation error [0-9.e+-]+ >"):
        check_equivalence(BROKEN["missing_1_over_N"][0], case)
