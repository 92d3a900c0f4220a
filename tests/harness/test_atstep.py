"""grads_from="optimizer" with clipping (verify/_internal/atstep.py; issue 42, the zoo's classes C, G, H, I): what the
harness reads as the optimizer's step begins is the post-clip gradient. An honest trainer that normalises and clips
there passes every gate that reads it (tests/helpers/clipped_step.py), the gates judge what that view can show,
and say what it cannot. Its planted bugs (planted/atstep_adapters.py) are rejected in tests/harness/test_planted.py."""
import math

import pytest
import torch
from hypothesis import find
from hypothesis import strategies as st

import verify
from planted import atstep_adapters as broken
from tests.helpers import clipped_step as cs
from verify._internal import report
from verify._internal.gates.clipped import step0_read
from verify._internal.cases.case import Case, Trace
from verify._internal.cases.strategies import _options_strategy
from verify._internal.gates import GateFailure
from verify._internal.gates.metrics import check_metrics
from verify._internal.gates import objective
from verify._internal.gates.objective import check_normaliser
from verify._internal.gates.single import check_equivalence
from verify._internal.gates.tolerance import Judge
from verify._internal.verdict import Gate

CASE = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2)
CLIPPED = CASE.replace(options=cs.CLIP)


class FixedClip(cs.ClippedStep):
    cap = 10.0  # above every window's norm (≈ 0.6): declared, never reached

    def clip_of(self, options):
        return self.cap


class TightClip(FixedClip):
    cap = cs.CLIP


def _fixed(cls):
    return verify.adapter(**cs.COMMON, metrics=verify.Metrics(names=("loss", "grad_norm", "tokens"), max_norm=cls.cap),
                          name=f"clipped at the step at {cls.cap}")(cls)


@pytest.fixture
def checked(monkeypatch):
    """What the normaliser judged: every check it made, passed or not (which one is worst depends on the CPU's
    rounding, so a test names the checks it needs, not the worst)."""
    seen, check = [], objective._Term.check
    monkeypatch.setattr(objective._Term, "check", lambda t, what, *a, **k: (seen.append(what), check(t, what, *a, **k)))
    return seen


def _gradients(seen: list) -> bool:
    return any("gradient of" in what for what in seen)


def test_the_normaliser_runs_unclipped_where_unclipped_is_declared(checked):
    """Zoo class C (t9, t10, t19): clipped windows are not additive. Before, the additivity check failed this honest
    trainer at rel 0.31 ('0.weight') with clipping on; now its runs use unclipped(options) and judge every gradient."""
    r = check_normaliser(cs.declared, CLIPPED)
    assert not r.extra.get("unjudged") and _gradients(checked), (r.extra, checked)


def test_a_clipped_run_nothing_declares_is_judged_by_its_loss_and_says_so():
    r = check_normaliser(cs.undeclared, CASE)
    says = r.extra.get("unjudged") or ""
    assert "additivity" in says and "judged the loss only" in says and "unclipped=" in says, says
    lines, _ = report.coverage({Gate.NORMALISER.value: dict(examples=3, unjudged=says, unjudged_examples=2)}, {})
    assert any(ln.startswith("normaliser, in part (2 of 3 examples): ") and "unclipped=" in ln for ln in lines), lines


def test_a_run_a_larger_run_shows_unclipped_is_judged_with_nothing_declared(checked):
    """Every run of one options clips at one M, to a norm > M − clip_eps, and none steps more than M: a run smaller
    than another by more than clip_eps was not clipped. Rows of window A alone (a mean's gradient is a convex
    combination of its rows') usually top the windows: a trainer that does not clip has its additivity judged."""
    r = check_normaliser(verify.adapter(**cs.COMMON, name="not clipped, undeclared")(cs.Unclipped), CASE)
    assert "additivity" not in (r.extra.get("unjudged") or "") and _gradients(checked), (r.extra, checked)


def test_a_run_the_declared_max_norm_shows_unclipped_is_judged_whole(checked):
    """Metrics.max_norm M: a stepped norm ≤ M − clip_eps was not clipped, so it is the pre-clip gradient."""
    r = check_normaliser(_fixed(FixedClip), CASE)
    assert not r.extra.get("unjudged") and _gradients(checked), (r.extra, checked)
    assert check_normaliser(_fixed(TightClip), CASE).extra.get("unjudged")  # clipped at 0.05: its loss only


def test_grad_norm_is_judged_at_the_step():
    """Zoo class G (t31's grad_norm_one_shard survived): the norm the optimizer stepped is the pre-clip one where
    clipping provably did not act, and otherwise bounds the report; the big batch's report is the same value."""
    for adapter, case in ((cs.declared, CASE), (cs.declared, CLIPPED), (cs.reporting, CASE),
                          (cs.unclipped_reporting, CASE), (_fixed(FixedClip), CASE)):
        r = check_metrics(adapter, case)
        assert r.extra["metrics_checked"].get("grad_norm") == 2 * case.steps, (adapter.name, r.extra)
    assert check_metrics(cs.declared, CLIPPED).extra["clipped_steps"] == 2 * CLIPPED.steps
    with pytest.raises(GateFailure, match=r"the accumulation run, step 0: grad_norm reported .*, the big batch "
                                          r"reported .* \(×1\.198\)"):
        check_metrics(broken.norm_of_last_micro, CASE)


class ReportsZero(cs.AlwaysClipped):
    def norm(self) -> float:
        super().norm()
        return 0.0


class ReportsPostClip(TightClip):
    def norm(self) -> float:
        super().norm()
        return float(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in self.model.parameters())))


def test_a_pre_clip_norm_must_give_the_norm_stepped():
    """Clipping never enlarges a gradient: a reported norm below the stepped one is wrong whatever clipped; with
    max_norm M declared, n·min(1, M / (n + clip_eps)) must be the stepped norm (the big batch has no other check)."""
    zero = verify.adapter(**cs.COMMON, metrics=verify.Metrics(names=("grad_norm",)), name="zero")(ReportsZero)
    with pytest.raises(GateFailure, match=r"the big batch, step 0: grad_norm reported 0\.0, but the optimizer "
                                          r"stepped a gradient of norm .*clipping never enlarges a gradient \(zero\)"):
        check_metrics(zero, CASE)
    post = verify.adapter(**cs.COMMON, metrics=verify.Metrics(names=("grad_norm",), max_norm=cs.CLIP),
                          name="post-clip")(ReportsPostClip)
    with pytest.raises(GateFailure, match=r"the big batch, step 0: grad_norm reported .*: clipping it at max_norm "
                                          r"0\.05 gives"):
        check_metrics(post, CASE)


def test_a_scaled_gradient_behind_clipping_is_seen_where_unclipped_is_declared():
    """Zoo class H (t41's grads_times_N passed): ÷ the last micro-batch's count, clipped, steps exactly as the honest
    trainer does, so equivalence at max_norm 0.05 passes; the normaliser's unclipped runs reject it, and the gates
    draw unclipped options too (one draw in two)."""
    check_equivalence(broken.micro_count, CLIPPED)  # invisible: the update is the honest one
    with pytest.raises(GateFailure, match=r"\[normaliser\] .*additivity .*gradient of .*relative error 5\.000e-01"):
        check_normaliser(broken.micro_count, CLIPPED)
    always = cs.declared.replace(options=st.just(cs.CLIP))
    assert find(_options_strategy(always), lambda o: o is None) is None  # its unclipped(options)
    assert find(_options_strategy(cs.undeclared.replace(options=st.just(cs.CLIP))), lambda o: True) == cs.CLIP


def test_a_step_0_the_big_batchs_gradscaler_skipped_is_said_not_a_crash():
    """Zoo class I (t41 with a high scale): the big batch's fp16 step 0 overflowed and its GradScaler skipped it, so
    the harness read no gradient there. Before, step0_checks raised KeyError; now those checks are not judged."""
    r = check_equivalence(cs.overflowing, CASE.replace(precision="fp16"))
    assert "GradScaler skipped" in (r.extra.get("unjudged") or ""), r.extra
    assert not check_equivalence(cs.overflowing, CASE).extra.get("unjudged")


def test_an_accumulation_run_without_a_step_0_gradient_is_named():
    ref = Trace([1.0], {"w": torch.ones(2)}, [])
    j = Judge(Gate.EQUIVALENCE, CASE.replace(precision="fp16"))
    with pytest.raises(GateFailure, match=r"the accumulation run has no step-0 gradient at all.*GradScaler found"):
        step0_read(j, Trace([1.0], {}, []), ref, ref)
    step0_read(j, Trace([1.0], {}, []), Trace([1.0], {}, []), ref)  # neither stepped: nothing to judge
    assert "GradScaler skipped" in j.unjudged
