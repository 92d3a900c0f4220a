"""The token-mean claim and empty windows (verify/_internal/gates/tokens.py): xtrain's token-weighted trainers pass;
the planted bugs of planted/broken_tokens.py — which every split-based gate passes — are rejected,
each naming its gate; the empty_windows declaration is honoured by the strategies and the gate."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import verify
from planted import count_adapters as _ca
from planted import broken_tokens as bt
from planted import registry as planted
from xtrain_proof import adapters as xtrain
from verify._internal.cases.case import Case
from verify._internal.gates.windows import LONG_N
from verify._internal.gates import GateFailure, GateSkipped, check_empty_window, check_equivalence, check_normaliser
from verify._internal.gates.tokens import windows_case
from verify._internal.gates.windows import check_split_invariance
from verify._internal.protocol import AdapterError, Expected
from verify._internal.cases.strategies import budget, cases, padding
from verify._internal.verdict import Gate
from xtrain_core.config import ModelConfig, OptimConfig

SMALL = xtrain.XtrainOptions(model=ModelConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=1, d_model=8), seq_len=4,
                             optim=OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2), loss_norm="tokens")
# windows A (rows 0-5) and B (rows 6-11) of 4 targets per row: uneven rows, an empty row and micro-batch
CASE = Case(accum_steps=3, micro_batch=2, steps=2, options=SMALL, seed=1, data_seed=2,
            lengths=(4, 0, 2, 1, 3, 0, 0, 0, 4, 4, 1, 2))


def _token_cases(adapter):
    return cases(adapter, max_accum=4, max_micro_batch=2, min_steps=2, max_steps=2, padded=True)


@settings(max_examples=budget(10, 4), deadline=None)
@given(data=st.data())
def test_xtrain_token_weighting_keeps_the_claim(data):
    case = data.draw(_token_cases(xtrain.tokens_adapter))
    assert check_normaliser(xtrain.tokens_adapter, case).ratio < 1
    check_empty_window(xtrain.tokens_adapter, case)


@pytest.mark.slow  # two one-rank pools
@pytest.mark.distributed
@pytest.mark.parametrize("adapter", [xtrain.torch_ddp_tokens, xtrain.fsdp2_tokens], ids=["ddp", "fsdp2"])
def test_process_group_token_trainers_keep_the_claim(adapter):
    """Adapters that need a group even alone run both checks on a one-rank pool."""
    assert check_normaliser(adapter, CASE).ratio < 1
    check_empty_window(adapter, CASE)


def test_the_claim_holds_at_the_case_the_windows_are_built_from():
    r = check_normaliser(xtrain.tokens_adapter, CASE)
    assert r.extra["valid"] == (10, 11) and r.ratio < 1e-3, r


def _windows(case):
    E = case.effective_batch
    return case.lengths[:E], case.lengths[E:2 * E]


def _exists(name, case) -> bool:
    """Where each count bug changes the result at all (it is a constant factor elsewhere)."""
    a, b = _windows(windows_case(bt.all_positions, case))
    S = case.options.seq_len
    na, nb = sum(a), sum(b)
    if name == "all_positions":
        return na + nb > 0
    if name == "count_plus_one":  # with one window empty, n·Σ/(n+1) is the union's too
        return na > 0 and nb > 0
    if name == "sequences":  # Σ/rows = S·(token mean) on full rows: valid targets per sequence must differ
        rows = lambda w: sum(1 for n in w if n)  # noqa: E731
        return na > 0 and nb > 0 and na * rows(b) != nb * rows(a) and S > 0
    if name == "empty_stepped":  # N=1 backwards nothing on an empty window: AdamW skips gradient-less
        # parameters, and only the schedule shows the step in window B: the gate compares B at schedule step 2
        # (after A and the empty window) with B at step 1, and the warm-up min(1, (s+1)/w) differs there only
        # for w ≥ 3 (w = 2 is at full LR from step 1 on)
        return (case.accum_steps >= 2 and na + nb > 0) or (case.options.optim.warmup_steps >= 3 and nb > 0)
    return True  # empty_div_by_zero: 0/0 on every empty window


@pytest.mark.parametrize("name", [b.name for b in planted.of_gate("normaliser", "empty window", module="broken_tokens")])
@settings(max_examples=budget(10, 3), deadline=None)
@given(data=st.data())
def test_planted_token_bugs_are_rejected_by_their_gate(name, data):
    adapter, gate = planted.BY_NAME[name].adapter, planted.BY_NAME[name].gate
    case = data.draw(_token_cases(adapter))
    assume(_exists(name, case))
    check = check_normaliser if gate is Gate.NORMALISER else check_empty_window
    with pytest.raises(GateFailure, match=rf"^\[{gate}\] ") as e:
        check(adapter, case)
    assert e.value.gate is gate and e.value.case is not None


@pytest.mark.parametrize("name", ["all_positions", "count_plus_one", "sequences"])
def test_the_wrong_counts_pass_every_split_the_other_gates_try(name):
    """Why the token-mean gate exists: these counts are split-consistent, so split invariance (every (N, B)
    of the window against the trainer's own big batch) passes them on the very window that rejects them."""
    adapter = planted.BY_NAME[name].adapter
    case = CASE.replace(accum_steps=2, micro_batch=3)
    check_split_invariance(adapter, case.replace(steps=1, lengths=case.lengths[:6]))
    with pytest.raises(GateFailure, match=r"^\[normaliser\] term .loss. \(token_mean[^)]*\): additivity over windows A \(10 valid targets\) and B \(11\)"):
        check_normaliser(adapter, case)


def test_padding_that_is_counted_is_named():
    """Every target position counted: extra rows without a valid target change the loss (window A alone,
    with B empty, so additivity has nothing to add)."""
    case = CASE.replace(lengths=CASE.lengths[:6] + (0,) * 6)
    with pytest.raises(GateFailure, match=r"^\[normaliser\] term .loss. \(token_mean[^)]*\): (additivity|padding: window A \(10 valid targets\) plus 6 rows)"):
        check_normaliser(bt.all_positions, case)
    with pytest.raises(GateFailure, match=r"^\[normaliser\] term .loss. \(token_mean[^)]*\): padding: window A \(10 valid targets\) plus 6 rows without "
                                          r"a valid target, inside every micro-batch"):
        check_normaliser(bt.all_positions, case.replace(lengths=CASE.lengths[:6] * 2))


# An empty window that moves the parameters (NaN, or a step on a zero gradient) is named: the planted
# bugs empty_div_by_zero and empty_stepped on CASE, in planted/registry.py (test_planted.py).


def test_an_empty_window_that_only_advances_the_schedule_is_named():
    """Weight decay off, the window before it empty too: no parameter moves on the empty window (AdamW on
    zero gradients and zero moments), but its step count and LR warm-up advance, so the next window differs."""
    o = SMALL.optim
    opts = xtrain.XtrainOptions(model=SMALL.model, seq_len=4, loss_norm="tokens",
                                optim=OptimConfig(lr=o.lr, weight_decay=0.0, warmup_steps=3))
    case = CASE.replace(options=opts, lengths=(0,) * 6 + CASE.lengths[6:])
    with pytest.raises(GateFailure, match=r"^\[empty window\] window B after an empty window, vs B right after A"):
        check_empty_window(bt.empty_stepped, case)
    check_empty_window(xtrain.tokens_adapter, case)


def test_windows_case_builds_two_padded_windows_of_one_process():
    c = windows_case(xtrain.tokens_adapter, Case(accum_steps=2, micro_batch=1, world=2, steps=1, options=SMALL,
                                                 lengths=(4, 3, 2, 1)))
    assert (c.world, c.micro_batch, c.steps, c.lengths) == (1, 2, 2, (4, 3, 2, 1, 1, 2, 3, 4))
    full = windows_case(xtrain.tokens_adapter, Case(accum_steps=2, micro_batch=1, steps=3, options=SMALL))
    assert full.lengths == (4,) * 4 and full.steps == 2


def test_adapters_without_an_ignore_index_are_skipped_saying_why():
    for check in (check_normaliser, check_empty_window):
        with pytest.raises(GateSkipped, match="declares no (objective and no )?ignore_index"):
            check(xtrain.single, CASE.replace(lengths=None))


# -- Adapter(empty_windows=False): never fed an empty window --------------------------------------------

_NO_EMPTY = bt.empty_div_by_zero.replace(empty_windows=False)


def test_empty_windows_false_is_a_declaration_and_skips_the_empty_window_check():
    assert _NO_EMPTY.declarations()["empty_windows"] is False
    assert "empty_windows" not in xtrain.tokens_adapter.declarations()
    with pytest.raises(GateSkipped, match="declares empty_windows=False"):
        check_empty_window(_NO_EMPTY, CASE)
    with pytest.raises(AdapterError, match="empty_windows must be True or False"):
        xtrain.tokens_adapter.replace(empty_windows="no")


@settings(max_examples=budget(4, 25), deadline=None)
@given(data=st.data())
def test_strategies_never_draw_an_empty_window_where_it_is_declared(data):
    N, B, W, K = (data.draw(st.integers(1, 4)) for _ in range(4))
    lengths = data.draw(padding(steps=K, accum_steps=N, micro_batch=B, world=W, seq_len=3, empty_windows=False))
    E = N * B * W
    assert all(sum(lengths[k * E:(k + 1) * E]) > 0 for k in range(K))
    case = data.draw(_token_cases(_NO_EMPTY))
    assert case.empty_steps() == set()
    check_normaliser(_NO_EMPTY, case)  # the count is right; only its empty windows are wrong


def test_an_all_empty_draw_stays_possible_by_default():
    """The default strategy can still shrink to windows without a valid target (they are a case to prove)."""
    from hypothesis import find

    lengths = find(padding(steps=1, accum_steps=2, micro_batch=1, world=1, seq_len=3), lambda ls: sum(ls) == 0)
    assert lengths == (0, 0)


# -- the self-test's token operators (verify/selftest/operators.py) --------------------------------------

TOKEN_OPS = ["per_micro_mean", "count_from_first_micro", "per_rank_mean", "all_positions",
             "sequences"]
# one process, no plain step: only the token-mean gate can see a count that every split keeps
alone_no_plain = xtrain.tokens_adapter.replace(factory=xtrain.single_factory, data_parallel=False, plain=None,
                                               precisions=("fp32",), name="xtrain tokens, one process, no plain step",
                                               defaults=SMALL,
                                               ref="tests.harness.test_tokens:alone_no_plain")


# xtrain's token-weighted trainer with a small model as its defaults (the self-test's cases are built from them)
tokens_small = xtrain.tokens_adapter.replace(defaults=SMALL, name="xtrain, loss_norm=tokens, small",
                                             ref="tests.harness.test_tokens:tokens_small")


@pytest.mark.slow  # the self-test's cases at worlds 1 and 2 (the full-size run: docs/verify-your-trainer.md, the self-test)
@pytest.mark.distributed
def test_selftest_kills_every_token_operator_on_xtrains_token_trainer():
    from verify.selftest import run_selftest

    res = run_selftest(tokens_small, max_world=2, operators=TOKEN_OPS)
    assert res.ok and res.score == "5/5" and res.worlds == [1, 2], res.table()
    assert "passes at worlds 1, 2" in res.table() and all(c.lengths for c in res.cases if c.accum_steps < LONG_N)


def test_only_the_token_mean_gate_sees_split_consistent_counts():
    from verify.selftest import run_selftest

    res = run_selftest(alone_no_plain, operators=TOKEN_OPS, every_case=True)  # "passes" needs every case run
    assert res.ok and res.score == "4/4" and res.worlds == [], res.table()  # per_rank_mean: no ranks here
    for op in ("all_positions", "sequences"):
        assert res.rows[op][Gate.NORMALISER] == "rejects" and res.rows[op]["equivalence"] == "passes", res.table()
    assert res.rows["per_rank_mean"]["verdict"] == "n/a"


def test_token_operators_do_not_apply_without_an_ignore_index():
    """xtrain's adapter declares no ignore_index: none of its self-test cases is padded, no case runs the normaliser
    gate, and no token operator's bug exists on any case (each is n/a; the run of xtrain's whole self-test, baseline
    and every operator: tests/examples/test_examples.py)."""
    from verify.selftest import OPERATORS, _checks, cases_of, selftest_cases, worlds_of

    single, dist = selftest_cases(xtrain.single, worlds=worlds_of())
    cases = single + dist
    assert cases and not any(c.lengths for c in cases)
    assert not any(Gate.NORMALISER in cols for i, c in enumerate(cases)
                   for _, _, cols in _checks(xtrain.single, c, True, i >= len(single)))
    assert {op: cases_of(OPERATORS[op], xtrain.single, cases, True) for op in TOKEN_OPS} == {op: [] for op in TOKEN_OPS}
    # the same selection on the token-mean adapter finds each operator's cases: the test above can fail
    tokens = xtrain.tokens_adapter
    single, dist = selftest_cases(tokens, worlds=worlds_of())
    assert all(cases_of(OPERATORS[op], tokens, single + dist, True) for op in TOKEN_OPS)



# its per-micro-step count all_reduce declared at worlds 2 and 3 only: a one-rank group shows it undeclared
declared_above_world_1 = _ca.counted.replace(
    expected=tuple(Expected("all_reduce", dtype="integer", world=w, why=_ca.COUNT) for w in (2, 3)),
    ref="tests.harness.test_tokens:declared_above_world_1")


@pytest.mark.slow  # ~9 s: pools of worlds 1 and 2
@pytest.mark.distributed
def test_the_unwrapped_trainer_passes_only_if_it_passes_at_every_world():
    """The self-test runs the worlds the gates draw, W=1 included: a trainer wrong only in a one-rank group
    (Accelerate's DDP at W=1 never enters no_sync) is not reported as passing."""
    from verify.selftest import run_selftest

    res = run_selftest(declared_above_world_1, max_world=2, operators=[])
    assert res.worlds == [1, 2] and not res.ok and not res.baseline_ok
    w1, w2 = (res.baseline[i] for i, c in enumerate(res.cases) if i >= res.n_single)
    assert w1[Gate.BOUNDARY_ONLY].startswith("kill: [boundary-only]") and w2[Gate.BOUNDARY_ONLY] == "pass", (w1, w2)
    assert "FAILS at world 1" in res.table() and "FAILS at worlds" not in res.table()
    assert res.as_dict()["verdict"] == "FAIL: the unwrapped trainer fails a gate at world 1"


# -- a loss computed in float32 inside float64 runs (HF's logits.float()), not declared ---------------------

class Fp32LossTokens:
    """HF-style: the window is prefetched, each micro-batch backwards Σ CE / the window's valid count, with the
    logits cast to float32 (a float32 loss in a float64 run). `extra` is added to the count (a planted bug)."""
    extra = 0

    def __init__(self, spec):
        torch.manual_seed(spec.seed)
        self.model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Tanh(), torch.nn.Linear(8, 11)).to(
            spec.device, spec.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.n, self.window, self.loss = spec.accum_steps, [], None

    def micro_step(self, x, y, micro):
        self.window.append((x, y))
        if micro < self.n - 1:
            return
        count = sum(int((t != -100).sum()) for _, t in self.window)
        self.loss = torch.zeros((), dtype=torch.float32)
        for xs, ys in self.window:
            if count:
                logits = self.model(xs).float()
                part = F.cross_entropy(logits.flatten(0, 1), ys.flatten(), ignore_index=-100, reduction="sum") / (
                    count + self.extra)
                part.backward()
                self.loss = self.loss + part.detach()
        self.window = []
        self.count = count

    def grads(self):
        return {k: p.grad for k, p in self.model.named_parameters() if p.grad is not None}

    def optimizer_step(self):
        if self.count:
            self.opt.step()
        self.opt.zero_grad()
        return self.loss if self.count else torch.tensor(float("nan"))

    def params(self):
        return dict(self.model.named_parameters())


class Fp32LossCountPlusOne(Fp32LossTokens):
    extra = 1


class Fp32Count(Fp32LossTokens):
    """A float64 loss, its window's 1 / count taken in float32 (a 0-d float32 tensor keeps the float64 dtype of
    the product): the float32 count of the float64 runs, off by up to eps32 / 2 relative."""

    def micro_step(self, x, y, micro):
        self.window.append((x, y))
        if micro < self.n - 1:
            return
        count = sum(int((t != -100).sum()) for _, t in self.window)
        self.loss = torch.zeros((), dtype=torch.float64)
        for xs, ys in self.window:
            if count:
                logits = self.model(xs)
                part = F.cross_entropy(logits.flatten(0, 1), ys.flatten(), ignore_index=-100, reduction="sum")
                part = part * (1 / torch.tensor(count, dtype=torch.float32))
                part.backward()
                self.loss = self.loss + part.detach().double()
        self.window = []
        self.count = count


_FP32_DATA = dict(data=verify.data.tokens(vocab=11, seq_len=5), ignore_index=-100)
fp32_loss = verify.adapter(**_FP32_DATA)(Fp32LossTokens)
fp32_loss_count_plus_one = verify.adapter(**_FP32_DATA)(Fp32LossCountPlusOne)
fp32_count = verify.adapter(**_FP32_DATA)(Fp32Count)


@settings(max_examples=budget(10, 5), deadline=None)
@given(data=st.data())
def test_a_float32_loss_in_float64_runs_passes_undeclared_and_a_wrong_count_still_fails(data):
    """The twins can miss a float32 loss (two float32 sums alike): judged at what an fp32 run resolves (eps32),
    it passes undeclared, and a count off by one is still ~1/n away."""
    case = data.draw(_token_cases(fp32_loss))
    assert check_normaliser(fp32_loss, case).ratio < 1
    assert check_normaliser(fp32_count, case).ratio < 1 and check_equivalence(fp32_count, case).ratio < 1
    check_empty_window(fp32_loss, case)
    E = case.effective_batch
    assume(sum(case.lengths[:E]) and sum(case.lengths[E:2 * E]))
    with pytest.raises(GateFailure, match=r"^\[normaliser\] term .loss. \(token_mean[^)]*\): additivity"):
        check_normaliser(fp32_loss_count_plus_one, case)


def test_two_runs_that_both_end_in_nan_are_not_nondeterminism():
    """Found by per_rank_mean at W=4 (a rank with no valid target divides by 0): the diagnosis called
    two NaN runs different, and reported [determinism] instead of the data-parallel verdict."""
    from verify._internal.cases.case import Trace
    from verify._internal.gates.diagnose import first_difference

    nan = torch.tensor([float("nan"), 1.0])
    a, b = Trace([float("nan")], {"w": nan}, [{"w": nan}]), Trace([float("nan")], {"w": nan.clone()}, [{"w": nan.clone()}])
    assert first_difference(a, b) is None
    assert first_difference(a, Trace([float("nan")], {"w": torch.tensor([float("nan"), 2.0])}, [])) is not None
