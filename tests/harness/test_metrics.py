"""The metrics gate (verify/_internal/gates/metrics.py): a correct trainer's reports pass with every declared
metric checked; a declared convention changes what is expected (the same trainer, declared otherwise, fails);
a trainer without metrics is skipped saying how to enable them; the failure names the factor."""
import dataclasses

import pytest

from planted import broken_metrics
from planted.registry import METRIC, TOKEN_WINDOWS, _opts
from verify._internal.cases.case import Case
from verify._internal.gates.metrics import check_metrics, factor_text
from verify._internal.ranks.mesh import Mesh
from verify._internal.metrics import Metrics
from verify._internal.protocol import AdapterError
from verify._internal.report import coverage
from verify._internal.verdict import Gate, GateFailure, GateSkipped
from xtrain_core.trainer import AccumTrainer
from xtrain_proof import adapters as xtrain

TOKENS = TOKEN_WINDOWS.replace(options=_opts(vocab=16, heads=1, d=8, seq_len=4, warmup_steps=2, max_grad_norm=0.05,
                                             loss_norm="tokens"))


@pytest.mark.parametrize("adapter, case", [(xtrain.single, METRIC), (xtrain.tokens_adapter, TOKENS)],
                         ids=["rows", "tokens"])
def test_xtrain_reports_what_the_harness_sees(adapter, case):
    r = check_metrics(adapter, case)
    checked = r.extra["metrics_checked"]
    assert set(adapter.metrics.names) | {"clip (applied)"} <= set(checked), checked
    assert all(n == 2 * case.steps for n in checked.values()), checked  # the big batch's and the accumulation run's
    assert r.extra["clipped_steps"] == 2 * case.steps and not r.extra["metrics_unchecked"], r.extra
    assert r.ratio < 1e-3, r  # float64 against float64: far inside the bound


@pytest.mark.parametrize("bug, declared", [
    # its clip_coef, computed from the clipped norm, stays wrong under either declaration: not asked for here
    (broken_metrics.norm_after_clip, dict(grad_norm="post_clip", names=("loss", "grad_norm", "lr", "rows"))),
    (broken_metrics.lr_before_scheduler_step, dict(lr="applied")),
    (broken_metrics.loss_of_last_micro, dict(loss="last_micro")),
], ids=["post_clip", "applied", "last_micro"])
def test_a_declared_convention_makes_the_same_report_right(bug, declared):
    with pytest.raises(GateFailure):
        check_metrics(bug, METRIC)
    fixed = bug.replace(metrics=dataclasses.replace(bug.metrics, **declared), ref=bug.locate())
    r = check_metrics(fixed, METRIC)
    assert r.extra["metrics_checked"], r.extra
    if "loss" in declared:  # known at step 0 only, and said so
        assert "step 0 only" in r.extra["metrics_unchecked"]["loss"]


class ForgetsTheLr(AccumTrainer):
    def metrics(self):
        out = super().metrics()
        del out["lr"]
        return out


forgets_the_lr = xtrain.variant(ForgetsTheLr, xtrain.single)


def test_a_declared_metric_the_trainer_does_not_report_is_named():
    with pytest.raises(GateFailure, match=r"the big batch, step 0: metrics\(\) has no 'lr', which Metrics\(names=\.\.\.\) "
                                          r"declares") as e:
        check_metrics(forgets_the_lr, METRIC)
    assert e.value.gate is Gate.REPORTED_METRICS
    asked_less = forgets_the_lr.replace(metrics=dataclasses.replace(xtrain.METRICS, names=("loss", "grad_norm")),
                                        ref="tests.harness.test_metrics:forgets_the_lr")
    assert set(check_metrics(asked_less, METRIC).extra["metrics_checked"]) == {"loss", "grad_norm", "clip (applied)"}


def test_without_metrics_the_gate_is_skipped_and_the_report_says_how():
    bare = xtrain.single.replace(metrics=None, ref="xtrain_proof.adapters:single")
    with pytest.raises(GateSkipped, match=r"declares no reported metrics: .* not checked \(declare @verify\.adapter"):
        check_metrics(bare, METRIC)
    lines, last = coverage({Gate.EQUIVALENCE.value: dict(examples=3)}, {})
    assert "metric grad_norm: the trainer declares no metrics (declare @verify.adapter(metrics=verify.Metrics(" \
           in "\n".join(lines)
    assert last.startswith("checked 1 of 15 gates and 0 of 6 metrics — less than half"), last


@pytest.mark.parametrize("field, value, says", [
    ("names", ("loss", "norm"), "Metrics.names must be among loss, grad_norm"),
    ("lr", "after", "Metrics.lr must be one of 'applied', 'next', got 'after'"),
    ("max_norm", 0.0, "Metrics.max_norm must be > 0"),
])
def test_a_bad_declaration_is_one_line_naming_the_field(field, value, says):
    with pytest.raises(AdapterError, match=says.replace("(", r"\(").replace(")", r"\)")):
        Metrics(**{"names": ("loss",), field: value})


def test_tokens_need_an_ignore_index():
    with pytest.raises(AdapterError, match="Metrics.names has 'tokens' but the adapter declares no ignore_index"):
        xtrain.single.replace(metrics=xtrain.TOKEN_METRICS)


def test_the_factor_is_named_where_it_is_a_count_of_the_case():
    case = Case(accum_steps=4, micro_batch=1, steps=1, world=2)
    assert factor_text(8.0, 2.0, case) == " (×4 = N (micro-steps))"
    assert factor_text(1.0, 2.0, case) == " (×0.5 = 1/W (ranks))"
    assert factor_text(2.0 * 2 ** 0.5, 2.0, case) == " (×1.414 = √W (a replicated norm counted per rank))"
    assert factor_text(0.0, 2.0, case) == " (zero)"
    on_cp = Case(accum_steps=2, micro_batch=1, steps=1, mesh=Mesh(cp=2))  # N = cp: the factor is either
    assert factor_text(4.0, 2.0, on_cp) == " (×2 = N (micro-steps) or cp (context-parallel ranks))"
    assert factor_text(3.0, 2.0, case, (("the norm after clipping", 3.0),)) == " (= the norm after clipping)"
    assert factor_text(2.6, 2.0, case) == " (×1.3)"
