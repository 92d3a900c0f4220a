"""verify.memory's library, which knows no trainer: the invariant logic on synthetic rows, the plans, the
measurement protocol for any adapter, the probes' failure modes, the report's all-or-nothing write, and
the predicted_peak hook's wiring (verify/memory/prediction.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.memory import HAS_CUDA, fake_report, rows

from verify.memory.invariants import check_invariants
from verify.memory.plan import GiB, MiB, plan_configs

pytestmark = pytest.mark.memory


GOOD = {(1, 8): 200, (2, 4): 110, (4, 2): 60, (8, 1): 40, (1, 1): 28, (2, 1): 40, (4, 1): 40.5}


def _status(per_rank, E=8, cuda=False):
    return {v["id"]: v for v in check_invariants(per_rank, E_local=E, cuda=cuda)}


def test_invariants_pass_on_accumulation_that_works():
    assert {k: v["status"] for k, v in _status([rows(GOOD)]).items()} == dict(a1="PASS", a2="PASS", b1="PASS", b2="PASS")


def test_invariants_name_the_offendingrows():
    grows = _status([rows({**GOOD, (4, 2): 120})])["a1"]  # 110 -> 120 at N=4: growth beyond 4 MiB
    assert grows["status"] == "FAIL" and grows["rows"] == [
        "N=4,B=2 peak 120.0 MiB > N=2,B=4 peak 110.0 MiB + tolerance 4.0 MiB"]
    leak = {**GOOD, (2, 1): 60, (4, 1): 100, (8, 1): 180, (4, 2): 100, (2, 4): 150}  # O(N) at fixed B
    v = _status([rows(leak)])
    assert v["a2"]["status"] == "FAIL" and "peak(N=8,B=1) 180.0 MiB" in v["a2"]["rows"][0]
    assert v["b1"]["status"] == "FAIL" and v["b1"]["rows"][0].startswith("N=8 peak 180.0 MiB − N=2 peak 60.0 MiB")
    assert v["b2"]["status"] == "FAIL" and "= 32.0 MiB; gradient buffers 10.0 MiB" in v["b2"]["rows"][0]
    assert _status([rows({**GOOD, (4, 1): 44.5})])["b1"]["status"] == "FAIL"  # 4.5 MiB > max(2%, 4 MiB)
    assert _status([rows({**GOOD, (4, 1): 43.5})])["b1"]["status"] == "PASS"  # within the noise floor


def test_invariants_rank_names_and_errors():
    bad = rows({**GOOD, (8, 1): 190, (4, 1): 100}, rank=1)
    v = _status([rows(GOOD), bad])
    assert v["b1"]["status"] == "FAIL" and all(r.startswith("rank 1: ") for r in v["b1"]["rows"])
    crashed = rows(GOOD)
    crashed[0] = dict(crashed[0], error="CUDA out of memory")
    del crashed[0]["peak_bytes"]
    v = _status([crashed])
    assert v["a2"]["status"] == "INCONCLUSIVE" and "N=1,B=8 failed to run: CUDA out of memory" in v["a2"]["rows"][0]


def test_leaving_n1_may_add_exactly_the_gradient_buffers():
    """Seen on an H200 (small model, S=64, E=4): peak(N=2,B=2) rose above peak(N=1,B=4) by about the
    gradient buffers, which live across micro-steps. That is correct accumulation, not growth; more is."""
    held = {**GOOD, (1, 8): 30, (2, 4): 39, (4, 2): 39.5, (8, 1): 40}  # activations ≪ 10 MiB of gradients
    assert _status([rows(held)])["a1"]["status"] == "PASS"
    more = _status([rows({**held, (2, 4): 45})])["a1"]  # 15 MiB > 10 MiB of gradients + 4 MiB tolerance
    assert more["status"] == "FAIL" and more["rows"] == [
        "N=2,B=4 peak 45.0 MiB > N=1,B=8 peak 30.0 MiB + gradient buffers 10.0 MiB + tolerance 4.0 MiB"]


def test_unmeasurable_activations_are_inconclusive_not_pass():
    tiny = {(1, 2): 21, (2, 1): 20, (1, 1): 18}
    v = _status([rows(tiny)], E=2)
    assert v["a2"]["status"] == "INCONCLUSIVE" and "not measurable" in v["a2"]["rows"][0]
    # gradient buffers (10 MiB) ≥ one sequence's activations: accumulation cannot save memory at E=2
    small = {(1, 2): 40, (2, 1): 28, (1, 1): 18}  # ideal saving 40 − 18 − 10 = 12 MiB
    assert _status([rows(small)], E=2)["a2"]["status"] == "INCONCLUSIVE"  # < 4 × 4 MiB on the CPU
    assert _status([rows(small)], E=2, cuda=True)["a2"]["status"] == "PASS"  # ≥ 4 × 2 MiB: the allocator is exact


def test_plans():
    e32 = plan_configs(32)
    assert [(c.N, c.B) for c in e32 if "A" in c.sweeps] == [(1, 32), (2, 16), (4, 8), (8, 4), (16, 2), (32, 1)]
    assert [(c.N, c.B) for c in e32 if "B" in c.sweeps] == [(32, 1), (1, 1), (2, 1), (4, 1), (8, 1), (16, 1)]
    assert len(e32) == 11
    e12 = plan_configs(12)
    assert [c.N for c in e12 if "A" in c.sweeps] == [1, 2, 3, 4, 6, 12]
    assert sorted(c.N for c in e12 if "B" in c.sweeps) == [1, 2, 4, 8]
    assert [(c.N, c.B, c.sweeps) for c in plan_configs(1)] == [(1, 1, ("A", "B"))]


def test_the_ends_of_each_sweep_are_what_every_claim_compares():
    """--sweep ends (a production-size trainer): five runs at any E, and each claim still has its rows."""
    for E in (512, 12, 6):
        ends = plan_configs(E, "ends")
        assert [(c.N, c.B) for c in ends if "A" in c.sweeps] == [(1, E), (2, E // 2), (E, 1)]
        assert [(c.N, c.B) for c in ends if "B" in c.sweeps] == [(E, 1), (1, 1), (2, 1)]
        assert len(ends) == 5
    assert [(c.N, c.B, c.sweeps) for c in plan_configs(1, "ends")] == [(1, 1, ("A", "B"))]
    # the claims decide on those rows alone: a correct trainer passes, one holding every micro-step's graph fails
    good = {(1, 512): 29.0, (2, 256): 25.0, (512, 1): 24.6, (1, 1): 20.5, (2, 1): 24.6}
    leak = {**good, (512, 1): 29.0 + 24.6}
    for peaks, want in ((good, "PASS"), (leak, "FAIL")):
        rows = [dict(rank=0, N=c.N, B=c.B, sweeps=c.sweeps, peak_bytes=int(peaks[(c.N, c.B)] * GiB),
                     grad_bytes=int(4.1 * GiB)) for c in plan_configs(512, "ends")]
        verdicts = check_invariants([rows], E_local=512, cuda=True)
        assert {v["id"]: v["status"] for v in verdicts} == dict(a1=want, a2=want, b1=want, b2="PASS"), verdicts


# -- the measurement protocol, for any adapter -----------------------------------------------------------

class _Recorder:
    """A probe that records when it was started and stopped, relative to the trainer's calls."""

    def __init__(self, log):
        self.log = log

    def start(self):
        self.log.append("start")

    def stop(self):
        self.log.append("stop")
        return dict(peak_bytes=123)


def test_measure_follows_the_protocol():
    """Batches drawn up front from the adapter's data (N·B rows per step, split into N micro-batches of B,
    floats cast to the run's dtype), one warm-up step whose boundary grads give grad_bytes, the probe
    around exactly `steps` optimizer steps."""
    from tests.helpers import memory_adapters

    from verify.memory import measure
    from verify._internal.protocol import Spec

    log, seen, inputs = [], [], []

    class Logged(memory_adapters.MLPTrainer):
        def micro_step(self, x, y, micro):
            seen.append((tuple(x.shape), x.dtype, micro))
            inputs.append(x.clone())
            log.append("micro")
            super().micro_step(x, y, micro)

        def grads(self):
            log.append("grads")
            return super().grads()

        def optimizer_step(self):
            log.append("step")
            return super().optimizer_step()

    adapter = memory_adapters.tiny_mlp.replace(factory=Logged)
    spec = Spec(accum_steps=3, dtype=torch.float32, seed=0, options=adapter.defaults)
    row = measure(adapter, spec, micro_batch=2, steps=2, probe=_Recorder(log))
    assert log == ["micro"] * 3 + ["grads", "step", "start"] + (["micro"] * 3 + ["step"]) * 2 + ["stop"]
    assert seen == [((2, 4, 3), torch.float32, m) for m in range(3)] * 3
    assert (row["N"], row["B"], row["eff"], row["steps"], row["peak_bytes"]) == (3, 2, 6, 2, 123)
    n = sum(p.numel() for p in Logged(spec).model.parameters())
    assert row["param_count"] == n and row["param_bytes"] == row["grad_bytes"] == 4 * n
    assert row["optim_state_bytes"] == 4 * n and row["static_bytes"] == 12 * n  # SGD momentum buffers
    assert len(row["losses"]) == 2 and row["rows_s"] > 0 and "tok_s" not in row
    assert row["trainer_class"] == "Logged" and row["optimizer"]["cls"] == "SGD"
    # the harness's own draw (verify._internal.cases.case): the adapter's batch at seed (data_seed << 16) + step, in order
    for step in range(3):
        x = adapter.batch(6, (1 << 16) + step, adapter.defaults)[0].float()
        for m in range(3):
            assert torch.equal(inputs[3 * step + m], x[2 * m:2 * m + 2])


def test_measure_counts_tokens_only_for_token_ids():
    from xtrain_proof import adapters as xtrain
    from verify.memory import measure
    from verify._internal.protocol import Spec
    from xtrain_core.config import ModelConfig, OptimConfig

    opts = xtrain.XtrainOptions(model=ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16),
                                seq_len=8, optim=OptimConfig())
    row = measure(xtrain.single, Spec(accum_steps=2, options=opts), micro_batch=3, steps=1, probe=_Recorder([]))
    assert row["S"] == 8 and row["tok_s"] > 0 and row["input_shape"] == [8] and row["input_dtype"] == "torch.int64"
    assert "rows_s" not in row and row["trainer_class"] == "AccumTrainer" and row["optimizer"]["cls"] == "AdamW"


def test_probe_processes_import_verify_from_where_this_process_did(monkeypatch):
    """The zygote's PYTHONPATH is the directory holding the `verify` package (the repository here,
    site-packages when installed), not a path guessed from the repository layout."""
    import verify
    from verify.memory.runners import _zygote_env, package_root

    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    assert package_root() == str(Path(verify.__file__).resolve().parent.parent)
    env = _zygote_env(type("P", (), dict(threads=1))())
    assert env["PYTHONPATH"].split(os.pathsep) == [package_root(), "/somewhere/else"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["MALLOC_MMAP_THRESHOLD_"] == "65536"


# -- probes: failure modes never crash ----------------------------------------------------------------

def test_nvml_unavailable_is_one_line():
    from verify.memory import NvmlSampler, ProbeUnavailable

    try:
        s = NvmlSampler.open([torch.device("cuda", 0)])
    except ProbeUnavailable as e:
        assert str(e).startswith("NVML unavailable") and "\n" not in str(e)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"NvmlSampler.open raised {type(e).__name__} instead of ProbeUnavailable: {e}")
    else:
        assert HAS_CUDA, "NVML opened a device while torch sees no GPU"
        s.start()
        assert s.stop()["nvml_peak_used_bytes"] > 0


def test_nvml_sampler_failing_mid_run_reports_instead_of_raising():
    from verify.memory import NvmlSampler

    class Info:
        used = 5 * MiB

    class FakeNvml:
        calls = 0

        def nvmlDeviceGetMemoryInfo(self, h):
            FakeNvml.calls += 1
            if FakeNvml.calls > 3:
                raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
            return Info()

    s = NvmlSampler.__new__(NvmlSampler)
    s.nv, s.handles, s.names, s.period, s.mapping = FakeNvml(), [0], ["fake"], 0.001, "index"
    import threading

    s._stop = threading.Event()
    s.start()
    import time

    time.sleep(0.05)
    out = s.stop()
    assert out["nvml_peak_used_bytes"] is None and "NVML_ERROR_GPU_IS_LOST" in out["nvml_error"]
    assert out["nvml_period_s"] == 0.001


_RSS_SCRIPT = """
import json, sys, torch
from verify.memory import RssProbe, probes
if sys.argv[1:] == ["no-reset"]:
    probes.reset_hwm = lambda: False  # as where /proc/self/clear_refs is refused
p = RssProbe()
p.start()
x = torch.ones(48 * 2**20 // 4)  # 48 MiB, touched
print(json.dumps(p.stop(), default=str))
"""


def _rss_probe(*args) -> dict:
    """The probe's row in a fresh interpreter: in a long-lived xdist worker another test's memory, released while
    the probe runs, lowers the resident set by more than what was allocated (seen in CI: peak 0 over a 1.3 GB
    base; and 5.6 MiB for 8 MiB without the reset)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_rss_probe_sees_a_resident_allocation():
    out = _rss_probe()
    assert out["peak_bytes"] >= 44 * MiB, out


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_rss_probe_without_hwm_reset_says_so():
    """Where /proc/self/clear_refs is refused, ru_maxrss still covers the warm-up: the row must say whether
    the measured steps set the peak (hwm_exact) instead of passing off an upper bound as exact."""
    out = _rss_probe("no-reset")
    assert out["hwm_source"] == "ru_maxrss (no reset)"
    assert out["peak_bytes"] >= 44 * MiB or out["hwm_exact"] is False, out


def test_report_write_is_all_or_nothing(tmp_path, monkeypatch):
    from verify.memory import plot
    from verify.memory import report as memreport

    (tmp_path / "memory-E4.json").write_text("old")
    rep = json.loads(json.dumps(fake_report()))
    monkeypatch.setattr(plot, "peaks_figure", lambda r: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError):
        memreport.write_all(rep, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory-E4.json"] and (tmp_path / "memory-E4.json").read_text() == "old"
    monkeypatch.undo()
    paths = memreport.write_all(rep, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory-E4.json", "memory-E4.md", "memory-E4.png"]
    assert json.loads(paths[0].read_text())["verdict"] == "PASS"



# -- the predicted_peak hook (verify/memory/prediction.py) ------------------------------------------------

def _predicted(hook, peaks=None, cls="T"):
    """add_predictions on a one-rank CPU report of two configurations, with `hook` as the adapter's."""
    from types import SimpleNamespace

    from verify.memory.plan import Config
    from verify.memory.prediction import add_predictions

    peaks = peaks or {(1, 2): 40 * MiB, (2, 1): 30 * MiB}
    plan = SimpleNamespace(adapter=SimpleNamespace(predicted_peak=hook), options="opts", world=1, cuda=False,
                           device=torch.device("cpu"), configs=[Config(n, b, ("A",)) for n, b in peaks])
    report = dict(settings=dict(device="cpu"), configs=[
        dict(N=n, B=b, peak_bytes=v, ranks=[dict(rank=0, peak_bytes=v, trainer_class=cls)]) for (n, b), v in peaks.items()])
    add_predictions(report, plan)
    return report


def _fixed(predicted: int, seen=None):
    """A memory model predicting `predicted` bytes for every configuration."""
    from verify.memory import Prediction

    def model(q):
        if seen is not None:
            seen.append(q)
        return Prediction(mode="m", peaks={c: dict(bytes=predicted, terms={"all": predicted}) for c in q.configs},
                          quantity="q", text="t", source="here")

    return model


def test_a_prediction_is_judged_by_its_ratio_only():
    """Measured 40 and 30 MiB: predicted 32 MiB is ok, 161 MiB (ratio < 0.25) and 7 MiB (> 4) are absurd;
    a prediction under 4 × the CPU noise floor (16 MiB) is not judged."""
    seen = []
    rep = _predicted(_fixed(32 * MiB, seen))
    q = seen[0]
    assert (q.configs, q.world, q.probe, q.trainer_class, q.options) == (((1, 2), (2, 1)), 1, "cpu", "T", "opts")
    c = rep["configs"][0]
    assert c["predicted_bytes"] == 32 * MiB and c["ranks"][0]["pred_ratio"] == 40 / 32 and c["predicted_terms"] == {"all": 32 * MiB}
    pr = rep["prediction"]
    assert (pr["verdict"], pr["mode"], pr["model"], pr["text"], pr["quantity"], pr["rows"]) == ("PASS", "m", "here", "t", "q", [])
    high = _predicted(_fixed(161 * MiB))["prediction"]
    assert high["verdict"] == "FAIL" and high["rows"][0] == "rank 0: N=1,B=2 measured 40.0 MiB / predicted 161.0 MiB = 0.25"
    assert len(high["rows"]) == 2  # 30 / 161 too
    low = _predicted(_fixed(7 * MiB), peaks={(1, 2): 40 * MiB, (2, 1): 29 * MiB})["prediction"]
    assert low["verdict"] == "N/A" and "under 4 × the noise floor" in low["rows"][0]  # 7 MiB < 16 MiB: unjudged
    low = _predicted(_fixed(17 * MiB), peaks={(1, 2): 70 * MiB, (2, 1): 17 * MiB})["prediction"]
    assert low["verdict"] == "FAIL" and low["rows"] == ["rank 0: N=1,B=2 measured 70.0 MiB / predicted 17.0 MiB = 4.12"]


def test_no_prediction_says_why_and_never_fails_the_run():
    def boom(q):
        raise RuntimeError("no such layer\nsecond line")

    for hook, why in ((None, "no memory model: the adapter declares no predicted_peak"),
                      (lambda q: "not my trainer", "not my trainer"),
                      (boom, "predicted_peak raised RuntimeError: no such layer"),
                      (lambda q: 42, "predicted_peak returned a int, not a verify.memory.Prediction")):
        pr = _predicted(hook)["prediction"]
        assert pr["verdict"] == "N/A" and pr["mode"] is None and pr["reason"].startswith(why), (why, pr)


def test_judging_bounds():
    from verify.memory.prediction import judge

    floor = 4 << 20
    assert judge(1.05, 64 << 20, floor) == "ok" and judge(5.0, 64 << 20, floor) == "absurd"
    assert judge(0.2, 64 << 20, floor) == "absurd" and judge(9.0, 8 << 20, floor) == "unjudged"
    assert judge(None, 64 << 20, floor) == "unjudged"


def test_the_adapter_declares_a_callable_hook():
    from tests.helpers import memory_adapters

    from verify._internal.protocol import AdapterError

    with pytest.raises(AdapterError, match="MemoryModel.predicted_peak must be callable"):
        memory_adapters.mlp.replace(predicted_peak=3)
