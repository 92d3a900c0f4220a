"""The framework recipes report what their framework logs (issue 28): HF's log_history, Lightning's
callback_metrics, the values accelerate's and Fabric's clip calls return. Each recipe passes the metrics gate on
one small case with clipping active, reports exactly the names it declares, and the same recipe declaring a
convention its framework does not follow is rejected: the gate tells the conventions apart on it."""
import dataclasses
import importlib
import importlib.util

import pytest
from tests.helpers.tiers import imports_framework

from verify import Case, Gate, GateFailure, check


def _needs(*mods):
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed (the [examples] extra)")


# recipe -> (the frameworks it imports, a convention its framework does NOT follow, the metric the gate names)
RECIPES = {
    "hf_trainer": (("transformers", "accelerate"), dict(lr="next"), "lr"),  # HF logs the LR applied
    "lightning_trainer": (("lightning",), dict(loss="window"), "loss"),  # self.log keeps the last micro-batch's
    "accelerate_accumulate": (("accelerate",), dict(lr="applied"), "lr"),  # read after the scheduler's step
    "fabric_no_backward_sync": (("lightning",), dict(grad_norm="post_clip"), "grad_norm"),  # before clipping
}
CASE = Case(accum_steps=2, micro_batch=2, steps=2, seed=1, data_seed=2)  # every recipe clips on it (norm > 1)


def _param(name):
    return pytest.param(name, marks=_needs(*RECIPES[name][0]), id=name)


def _factory(name):
    return importlib.import_module(f"examples.{name}").factory


@imports_framework
@pytest.mark.parametrize("name", [_param(n) for n in RECIPES])
def test_recipe_passes_the_metrics_gate_and_reports_what_it_declares(name):
    adapter = _factory(name)
    r = check(Gate.REPORTED_METRICS, adapter, CASE)
    steps = 2 * CASE.steps  # the accumulation run and the big batch
    assert r.extra["clipped_steps"] == steps, r.extra  # the clip coefficient applied was checked below 1
    assert r.extra["metrics_checked"]["clip (applied)"] == steps, r.extra
    # every declared metric judged at every step; a last-micro-batch loss at step 0 only (the harness's limit)
    for metric in adapter.metrics.names:
        want = 2 if metric == "loss" and adapter.metrics.loss == "last_micro" else steps
        assert r.extra["metrics_checked"].get(metric) == want, (metric, r.extra)
    assert r.extra["metrics_reported"] == sorted(adapter.metrics.names), r.extra  # what it declares, no more


@imports_framework
@pytest.mark.parametrize("name", [_param(n) for n in RECIPES])
def test_a_convention_the_framework_does_not_follow_is_rejected(name):
    adapter = _factory(name)
    wrong, metric = RECIPES[name][1], RECIPES[name][2]
    misdeclared = dataclasses.replace(adapter, metrics=dataclasses.replace(adapter.metrics, **wrong))
    with pytest.raises(GateFailure, match=rf"\[reported metrics\] .*step 0: {metric} reported "):
        check(Gate.REPORTED_METRICS, misdeclared, CASE)
