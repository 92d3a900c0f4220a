"""The metrics gate in bf16 / fp16 (verify/_internal/gates/metrics.py judge_precision, metrics_bounds.py): honest
mixed-precision trainers pass with every declared metric judged in that precision; a norm, a clip coefficient or a
loss read from the loss-scaled gradient is rejected naming the loss scale, where the float64 runs and the
equivalence gate cannot see it; the derived bounds hold for a naive fp32 norm, and the loss's κ is measured only
where κ = 1 fails."""
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from planted import broken_amp_metrics as amp
from planted.registry import METRIC, TOKEN_WINDOWS, _opts
from verify import Gate
from verify._internal.cases.case import Case
from verify._internal.cases.corners import corners
from verify._internal.gates import check_equivalence
from verify._internal.gates.metrics import check_metrics, judge_run
from verify._internal.gates.metrics_bounds import LowBounds, _ratio, loss_kappa, norm_bound
from verify._internal.gates.tolerance import C, EPS
from verify._internal.metrics import Metrics
from verify._internal.report import _metrics_rows
from verify._internal.verdict import GateFailure
from xtrain_proof import adapters as xtrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AMP = Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2)
TOKENS = TOKEN_WINDOWS.replace(options=_opts(vocab=16, heads=1, d=8, seq_len=4, warmup_steps=2, max_grad_norm=0.05,
                                             loss_norm="tokens"))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("adapter, case", [(amp.honest, AMP), (xtrain.single, METRIC), (xtrain.tokens_adapter, TOKENS)],
                         ids=["amp_recipe", "xtrain_rows", "xtrain_tokens"])
def test_an_honest_trainer_reports_its_own_unscaled_values(adapter, case, precision):
    # K = 2: from step 1 on the optimizer holds amp_recipe's scaled gradient while grads() hands unscaled copies;
    # the harness reads grads()' view there, not the optimizer's (else clip (applied) would be ×1/1024)
    r = check_metrics(adapter, case.replace(precision=precision))
    checked = r.extra["metrics_checked"]
    for name in (*adapter.metrics.names, "clip (applied)"):
        assert checked.get(f"{name}@{precision}") == case.steps, (name, checked)
    assert not r.extra["metrics_unchecked"], r.extra
    assert r.extra["clipped_steps"] == 3 * case.steps, r.extra  # both float64 runs and this one clipped every step


@pytest.mark.parametrize("bug, precision, says", [
    (amp.norm_before_unscale, "fp16", r"grad_norm reported \S+, expected \S+ .* \(×1024 = the loss scale\)"),
    (amp.clip_before_unscale, "fp16", r"the clip coefficient applied: .*clipping ran on the loss-scaled gradient"),
    (amp.clip_coef_from_scaled_norm, "fp16", r"clip_coef reported .* \(= max_norm over the norm × the loss scale\)"),
    (amp.scaled_under_bf16, "bf16", r"grad_norm reported .* \(×1024 = the loss scale\)"),
], ids=["norm_before_unscale", "clip_before_unscale", "clip_coef_from_scaled_norm", "scaled_under_bf16"])
def test_a_metric_from_the_scaled_gradient_passes_elsewhere_and_fails_here_naming_the_scale(bug, precision, says):
    case = AMP.replace(precision=precision)
    check_metrics(bug, AMP)  # the float64 runs alone (the gate before issue 42): no scaler there, nothing to see
    check_equivalence(bug, case)  # the update is right, or off by a factor AdamW cancels
    want = rf"^\[reported metrics\] the {precision} accumulation run, step 0: {says}"
    with pytest.raises(GateFailure, match=want) as e:
        check_metrics(bug, case)
    assert "unscale_" in e.value.hint and not e.value.error < e.value.bound


class LogsTheScaledLoss(amp.AmpTrainer):
    """Logs the loss it backwards: scaler.scale(loss), ×1024 under fp16."""

    def optimizer_step(self):
        scale = self.scaler.get_scale()
        loss = super().optimizer_step()
        self.logged["loss"] = float(loss) * scale
        return loss


logs_the_scaled_loss = amp._adapter(LogsTheScaledLoss)


def test_a_scaled_loss_is_named_by_the_loss_scale_and_bf16_without_a_scaler_passes():
    want = (r"fp16 accumulation run, step 0: loss reported \S+, expected \S+ \(this run's own step loss, as "
            r"optimizer_step\(\) returned it\) \(×1024 = the loss scale\)")
    with pytest.raises(GateFailure, match=want):
        check_metrics(logs_the_scaled_loss, AMP.replace(precision="fp16"))
    check_metrics(logs_the_scaled_loss, AMP.replace(precision="bf16"))  # no scaler under bf16: scale 1, no bug


def _step(loss_reported, loss_scale=None):
    """One Observer step as judge_run reads it, reporting only a loss."""
    return dict(reported={"loss": loss_reported}, stepped=True, sumsq={"w": 1.0}, elements=1, pre=(1.0, 1),
                applied=(1.0, 1), lr=0.1, lr_after=0.1, loss_scale=loss_scale, micro_tokens=[2], micro_rows=[2])


def test_the_loss_kappa_is_measured_only_where_kappa_1_fails_and_widens_the_bound():
    adapter = SimpleNamespace(metrics=Metrics(names=("loss",)), ignore_index=None)
    calls = []

    def kappa(k):
        calls.append(k)
        return 4.0

    bound1 = C * EPS["bf16"]
    judge = dict(adapter=adapter, case=AMP.replace(steps=2), norms=[1.0, 1.0], counts=[(2, 2)] * 2, losses=[1.0, 1.0],
                 who="run")
    near = 1.0 + 0.5 * bound1  # within κ = 1: κ never measured
    judge_run(seen=[_step(near), _step(near)], bounds=LowBounds("bf16", adapter.metrics, kappa), **judge)
    assert calls == []
    off = 1.0 + 2 * bound1  # beyond κ = 1, within κ = 4: measured once, for that step
    judge_run(seen=[_step(1.0), _step(off)], bounds=LowBounds("bf16", adapter.metrics, kappa), **judge)
    assert calls == [1]
    with pytest.raises(GateFailure, match=r"step 1: loss reported"):
        judge_run(seen=[_step(1.0), _step(1.0 + 5 * bound1)], bounds=LowBounds("bf16", adapter.metrics, kappa), **judge)


def test_an_overflowed_window_has_no_norm_to_judge_and_says_so():
    adapter = SimpleNamespace(metrics=Metrics(names=("grad_norm", "clip_coef"), max_norm=1.0), ignore_index=None)
    step = {**_step(1.0, loss_scale=1024.0), "reported": {"grad_norm": math.inf, "clip_coef": 0.0}}
    tally = judge_run(adapter, AMP.replace(steps=1), [step], [math.inf], [(2, 2)], [1.0], who="run",
                      bounds=LowBounds("fp16", adapter.metrics, None))
    assert set(tally.unchecked) == {"grad_norm@fp16", "clip_coef@fp16"} and not tally.checked, tally.extra()
    assert "not finite" in tally.unchecked["grad_norm@fp16"]


def test_loss_kappa_of_a_mean_loss_is_its_blocks_over_their_mean():
    case = AMP.replace(precision="bf16")
    batches = case.batches(amp.honest)
    big = SimpleNamespace(losses=[float("nan")])  # step 0 reads it: NaN (no window loss) gives κ 1
    assert loss_kappa(amp.honest, case, "cpu", batches, 0, big) == 1.0
    # MSE blocks are positive and the window's loss is their mean: Σ|blocks| / |mean| = N exactly
    assert loss_kappa(amp.honest, case, "cpu", batches, 1, big) == pytest.approx(case.accum_steps, rel=1e-12)


@pytest.mark.parametrize("n", [1, 7, 1000, 4096])
def test_the_norm_bound_holds_for_a_naive_fp32_loop(n):
    rng = np.random.default_rng(n)
    for x in (rng.standard_normal(n).astype(np.float32), np.full(n, 0.1, dtype=np.float32),
              np.sort(np.abs(rng.standard_normal(n)).astype(np.float32))[::-1]):  # largest first: small ones lost
        acc = np.float32(0.0)
        for v in x:  # recursive summation, every square and add rounded to fp32
            acc = np.float32(acc + np.float32(v * v))
        naive = float(np.sqrt(acc, dtype=np.float32))
        exact = math.sqrt(float(np.sum(x.astype(np.float64) ** 2)))
        torch32 = float(torch.linalg.vector_norm(torch.from_numpy(x.copy())))
        for got in (naive, torch32):
            assert _ratio(got, exact) <= norm_bound(n), (n, got, exact)
    assert _ratio(1024.0, 1.0) == _ratio(1 / 1024, 1.0) == 1023.0  # a factor weighs the same either way
    assert norm_bound(10**6) < 0.13  # ×1024 and ×1/1024 stay far outside it up to 5.8e7 elements


def test_each_declared_low_precision_is_a_metrics_corner_and_the_table_counts_it():
    assert [c.precision for c in corners(xtrain.single, Gate.REPORTED_METRICS)] == ["fp32", "bf16", "fp16"]
    assert [c.precision for c in corners(amp.scaled_under_bf16, Gate.REPORTED_METRICS)] == ["fp32", "bf16"]
    rows = _metrics_rows({"checked": {"loss": 4, "loss@fp16": 2, "loss@bf16": 2}}, {"metrics": {"names": ["loss"]}})
    assert "| loss | 4 (+ bf16 2, fp16 2) | window |  |" in rows, rows


def _plugin(tmp_path, trainer):
    tmp_path.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER", "COLUMNS")}, "PYTHONPATH": ROOT,
           "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "c")}
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", "-p", "no:xdist",
           "--verify-trainer", trainer, "-k", "reported_metrics", "--verify-report", str(tmp_path / "r")]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)


@pytest.mark.slow
def test_under_dev_the_plugin_judges_both_precisions_and_rejects_the_scaled_norm(tmp_path):
    ok = _plugin(tmp_path / "honest", "planted.broken_amp_metrics:honest")
    assert ok.returncode == 0, ok.stdout[-3000:]
    md = (tmp_path / "honest" / "r" / "verify-report.md").read_text().splitlines()
    row = next(ln for ln in md if ln.startswith("| grad_norm |"))
    assert "bf16 3" in row and "fp16 3" in row, row  # each precision's corner, K = 3 steps
    bad = _plugin(tmp_path / "bug", "planted.broken_amp_metrics:norm_before_unscale")
    assert bad.returncode == 1 and "(×1024 = the loss scale)" in bad.stdout, bad.stdout[-3000:]
