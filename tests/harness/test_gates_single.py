"""The single-process gates reject the bugs users hit (planted/broken.py), pass a harmless
control, and say what differs. (The gates' runs on xtrain's trainer are verify/test_gates.py.)"""
import pytest
from tests.helpers.tiers import dev_first
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planted import broken, registry as planted
from xtrain_proof import adapters as xtrain
from xtrain_proof.adapters import XtrainOptions
from verify import Gate
from verify._internal.cases.case import Case
from verify._internal.gates import GateFailure, GateSkipped, check_bit_exact, check_equivalence
from verify._internal.protocol import Adapter
from verify._internal.cases.strategies import cases
from xtrain_core.config import ModelConfig, OptimConfig

SMALL = ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16)


@pytest.mark.parametrize("name", dev_first([b.name for b in planted.of_gate("equivalence", module="broken")]))
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_equivalence_rejects(name, data):
    """Every drawn case with N ≥ 2 (where these bugs exist) must be rejected."""
    adapter = planted.BY_NAME[name].adapter
    case = data.draw(cases(adapter, min_accum=2, max_accum=6))
    if name == "scheduler_step_every_micro" and case.options.optim.warmup_steps < 2:
        # warm-up over 0 or 1 steps is a constant LR: the bug needs a schedule that moves to exist
        o = case.options
        case = case.replace(options=XtrainOptions(model=o.model, seq_len=o.seq_len,
                                                  optim=OptimConfig(**{**o.optim.__dict__, "warmup_steps": 2})))
    with pytest.raises(GateFailure, match=r"^\[equivalence\] .+; case N=\d"):
        check_equivalence(adapter, case)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_bit_exact_rejects_other_reduction_at_n1(data):
    """Sum-then-divide is exact when B·S is a power of two (scaling by 2^-k commutes with every rounding),
    so the bug only exists, and is only required to be caught, for other B·S."""
    adapter = broken.n1_different_reduction
    case = data.draw(cases(adapter, max_accum=1, max_micro_batch=6))
    n = case.micro_batch * case.options.seq_len
    assume(n & (n - 1) != 0)
    with pytest.raises(GateFailure, match=r"^\[bit-exact\] (gradient|parameter) .+ not bit-identical, max\|Δ\| = \d"):
        check_bit_exact(adapter, case)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_a_trainer_that_writes_into_its_batch_is_rejected(data):
    """Hole closed: the harness hands each call its own copy and fails a trainer that edits it in place
    (before, the plain reference read the edited storage and the bit-exact gate passed)."""
    case = data.draw(cases(broken.writes_into_targets, max_accum=3))
    with pytest.raises(GateFailure, match=r"the trainer wrote into its targets \(step 0, micro-step 0 of \d+\)"):
        (check_bit_exact if case.accum_steps == 1 else check_equivalence)(broken.writes_into_targets, case)


def test_scaling_by_one_is_not_a_bug():
    """Control: x * 1.0 is bit-exact in IEEE arithmetic, so always scaling by 1/N passes the bit-exact gate."""
    case = Case(accum_steps=1, micro_batch=3, steps=2,
                options=XtrainOptions(model=SMALL, seq_len=8, optim=OptimConfig(lr=1e-2, warmup_steps=1)))
    check_bit_exact(broken.scaled_by_one, case)


def test_missing_scale_message_names_parameter_and_error():
    case = Case(accum_steps=4, micro_batch=2, steps=1,
                options=XtrainOptions(model=SMALL.__class__(vocab_size=32, seq_len=8, n_layer=1, n_head=1, d_model=8),
                                      seq_len=8, optim=OptimConfig(max_grad_norm=None)))
    with pytest.raises(GateFailure, match=r"gradient \(step 0\) of '.+': accumulation error [0-9.e+-]+ >"):
        check_equivalence(broken.missing_1_over_N, case)


def test_bit_exact_is_skipped_with_a_reason_without_a_plain_step():
    no_plain = Adapter(factory=xtrain.single_factory, data=xtrain.tokens, name="no plain step")
    with pytest.raises(GateSkipped, match="declares no plain .* declare @verify.adapter\\(plain=...\\)"):
        check_bit_exact(no_plain, Case(accum_steps=1, micro_batch=1, steps=1))


def test_reference_is_the_same_trainer_in_float64():
    """Model-agnostic: a trainer whose big-batch semantics differ from xtrain's (here: no clipping at all,
    whatever the options say) is judged against ITS OWN big batch, and passes."""
    from xtrain_core.trainer import AccumTrainer

    def unclipped(spec):
        o = xtrain.options_of(spec)
        return AccumTrainer(xtrain.model_for(spec), OptimConfig(**{**o.optim.__dict__, "max_grad_norm": None}),
                            spec.accum_steps)

    a = Adapter(factory=unclipped, data=xtrain.tokens, name="unclipped")
    case = Case(accum_steps=3, micro_batch=2, steps=2,
                options=XtrainOptions(model=SMALL, seq_len=8, optim=OptimConfig(lr=1e-2, max_grad_norm=0.05)))
    check_equivalence(a, case)


# -- short last windows (issue 42 item 6; planted/short_adapters.py, its two bugs are registry rows) --------------

def test_a_short_last_window_holds_fewer_rows_and_a_declared_trainer_is_told_so():
    from planted import short_adapters as sa
    from verify._internal.protocol import Spec

    c = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, last_window=2)
    assert [x.shape[0] for x, _ in c.batches(sa.own_count)] == [6, 4]
    assert (c.window_of(0), c.window_of(1), c.rows_of(1), c.as_dict()["last_window"]) == (3, 2, 4, 2)
    assert "last_window=2" in str(c) and [(m, b) for m, _, b in c.layout(1)] == [(0, 2), (1, 2)]
    spec = c.spec(adapter=sa.own_count)  # the big batch: one step per window, on that window's rows
    assert (spec.windows, c.spec(accum_steps=1, adapter=sa.own_count).windows) == ((3, 2), (1, 1))
    assert [spec.window(k) for k in range(3)] == [3, 2, 3]  # past the run: accum_steps
    assert c.spec(adapter=sa.own_count.replace(short_last_window=False)).windows is None
    with pytest.raises(ValueError, match=r"Case.last_window must be 1..2 \(fewer than accum_steps\)"):
        c.replace(last_window=3)
    with pytest.raises(ValueError, match="Case.last_window must be"):
        Case(accum_steps=3, micro_batch=1, steps=1, world=2, last_window=1)
    with pytest.raises(ValueError, match=r"Spec.windows must list each window's micro-batches: accum_steps=3 each"):
        Spec(accum_steps=3, windows=(2, 3))


@pytest.mark.parametrize("name", ["own_count", "window_tokens"])
def test_a_trainer_normalising_by_its_own_window_passes_short_and_full_windows(name):
    """÷ Spec.window(k) micro-batches, or (token-weighted) ÷ the window's valid targets after it: the corners (a
    short one among them, padded for the token one) and drawn cases; the nominal-N bugs are the registry's."""
    from hypothesis import Phase, seed

    from planted import short_adapters as sa
    from verify._internal.cases.strategies import with_corners
    from verify._internal.cases.corners import corners

    adapter = getattr(sa, name)
    hard = corners(adapter, Gate.EQUIVALENCE)
    assert [c.last_window for c in hard] == [None, 2] and bool(hard[1].lengths) == (name == "window_tokens")
    drawn = []

    @seed(3)
    @settings(max_examples=12, database=None, deadline=None, phases=(Phase.explicit, Phase.generate))
    @given(case=cases(adapter, max_accum=4, max_micro_batch=2, short=True))
    def equivalence(case):
        drawn.append(case)
        check_equivalence(adapter, case)

    with_corners(equivalence, hard)()
    assert any(c.last_window for c in drawn[len(hard):]), drawn  # the draws hold short windows too


def test_an_undeclared_adapter_draws_the_same_cases_and_no_short_window():
    from hypothesis import Phase, seed

    from planted import short_adapters as sa
    from verify._internal.cases.strategies import with_corners
    from verify._internal.cases.corners import corners

    undeclared = sa.own_count.replace(short_last_window=False)
    assert [c.last_window for c in corners(undeclared, Gate.EQUIVALENCE)] == [None]

    def drawn(short):
        got = []

        @seed(5)
        @settings(max_examples=30, database=None, deadline=None, phases=(Phase.generate,))
        @given(case=cases(undeclared, short=short))
        def draw(case):
            got.append(case)

        with_corners(draw, [])()
        return got

    asked = drawn(True)
    assert asked == drawn(False) and not any(c.last_window for c in asked)


def test_a_failure_keeps_no_frame_of_the_runs_it_judged():
    """A kept failure (hypothesis keeps each failing example's; the plugin its verdict) must not hold the gate's
    frames, whose locals are every run of the case: at 1.1B parameters three such failures SIGKILLed the host."""
    import traceback

    bug = planted.BY_NAME["missing_1_over_N"]
    with pytest.raises(GateFailure) as e:
        check_equivalence(bug.load(), bug.case)
    frames = [f.name for f in traceback.extract_tb(e.value.__traceback__)]
    assert "_equivalence" not in frames and "run_alone" in frames, frames
    assert e.value.__context__ is None and e.value.__cause__ is None
