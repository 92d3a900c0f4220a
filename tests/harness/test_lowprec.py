"""Long windows in every declared precision (issue 16, item 2): gradients accumulated in bf16 / fp16 across
micro-steps are rejected, naming the precision and N; fp32 main gradients under autocast pass."""
import pytest

from planted import broken_lowprec as bl
from planted import registry as planted
from xtrain_proof import adapters as xtrain
from verify._internal.cases.case import Case
from verify._internal.gates import check_equivalence
from verify._internal.gates.windows import check_long_window
from verify._internal.verdict import Gate
from xtrain_core.config import ModelConfig, OptimConfig

OPTS = xtrain.XtrainOptions(model=ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=1, d_model=32), seq_len=16,
                            optim=OptimConfig(lr=1e-2))
TINY = xtrain.XtrainOptions(model=ModelConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=1, d_model=8), seq_len=4,
                            optim=OptimConfig(lr=1e-2))


@pytest.mark.parametrize("name, precision, dtype", [("half_model", "fp16", "torch.float16"),
                                                    ("bf16_params", "bf16", "torch.bfloat16")])
def test_low_precision_parameters_are_rejected_in_their_precision_only(name, precision, dtype):
    """Rejected at N = 4 in their precision (the registry's case: test_planted.py); xtrain's trainer elsewhere."""
    bug = planted.BY_NAME[name]
    adapter, case = bug.adapter, bug.case
    assert case.precision == precision and dtype in bug.pattern
    check_equivalence(adapter, case.replace(accum_steps=1))  # N = 1: nothing accumulates
    other = "bf16" if precision == "fp16" else "fp16"
    check_equivalence(adapter, case.replace(precision=other))  # xtrain's trainer there
    check_equivalence(adapter, case.replace(precision="fp32"))


def test_a_trainer_declaring_fp32_only_runs_no_low_precision_window():
    assert check_long_window(xtrain.single.replace(precisions=("fp32",)), Case(accum_steps=2, micro_batch=1, steps=1,
                                                                              options=TINY)) == []


@pytest.mark.slow  # N = 256 in bf16 and fp16: ~10 s
def test_fp32_main_gradients_pass_where_a_bf16_buffer_is_rejected_at_n_256():
    """The planted buffer low_precision_grad is rejected at N = 256 in bf16 (its case in planted/registry.py,
    test_planted.py); xtrain's fp32 accumulation passes the same case in both low precisions."""
    case = planted.BY_NAME["low_precision_grad"].case
    assert case == Case(accum_steps=256, micro_batch=1, steps=1, options=OPTS, seed=3, data_seed=4)
    results = check_long_window(xtrain.single, case)
    assert [r.case.precision for r in results] == ["bf16", "fp16"] and max(r.ratio for r in results) < 0.5
    # the same buffer passes at N = 64: its rounding has not yet crossed C·err(big) + F·κ
    assert max(r.ratio for r in check_long_window(bl.low_precision_grad, case.replace(accum_steps=64))) < 1


def test_the_low_precision_operator_runs_only_on_the_long_window_case_of_a_low_precision_adapter():
    from verify._internal.gates.windows import LONG_N
    from verify.selftest import OPERATORS, selftest_cases

    single, _ = selftest_cases(xtrain.single)
    assert [(c.accum_steps, c.precision) for c in single if c.accum_steps >= LONG_N] == [(LONG_N, "bf16")]
    single, _ = selftest_cases(xtrain.single.replace(precisions=("fp32",)))
    assert all(c.accum_steps < LONG_N for c in single)  # fp32 only: no low-precision window, the operator is n/a
    assert OPERATORS["low_precision_accumulation"].long


# The self-test kills low_precision_accumulation with the long-window gate (and only there): asserted on xtrain's
# whole self-test, tests/examples/test_examples.py::test_selftest_kills_every_operator (one N = 256 run in CI, not two).
