"""verify.memory: peak memory follows one micro-batch. The CLI end to end (small CPU sweeps, the same code
path as `python -m verify.memory`) on xtrain's GPT and on a trainer that is not a GPT, the invariant
logic on synthetic rows, the measurement protocol, the probes' failure modes, and proof that a planted
leak makes it exit 1. GPU tests run where CUDA is present, alone on the GPU (verify/_gpulock.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verify.memory.__main__ import main
from verify.memory.invariants import check_invariants
from verify.memory.plan import MiB, plan_configs

pytestmark = pytest.mark.memory
REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(k, None)
HAS_CUDA = torch.cuda.is_available()


def memory_cli(*args, timeout=240, torchrun=None, env=None):
    pre = [sys.executable, "-m", "verify.memory"] if torchrun is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}", "-m", "verify.memory"]
    # own session, so a hang is killed with everything it started (ranks, probe processes), not orphaned
    p = subprocess.Popen([*pre, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV,
                         cwd=str(REPO), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"verify.memory {' '.join(args)} timed out after {timeout} s; stderr tail: {err[-2000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


# Small CPU sweep: E=4 on the 'small' preset at S=256 gives 5 configurations whose activations are far above
# the 4 MiB noise floor (peak(1,4) ≈ 87 MiB, peak(4,1) ≈ 36 MiB, peak(1,1) ≈ 23 MiB), ~10 s.
SMALL = ["--effective-batch", "4", "--device", "cpu", "--model", "small", "--steps", "1", "--threads", "1"]


def _report(out: Path, E=4) -> dict:
    return json.loads((out / f"memory-E{E}.json").read_text())


@pytest.mark.slow
def test_cpu_sweep_passes_and_writes_the_reports(tmp_path):
    r = memory_cli(*SMALL, "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory-E4.json", "memory-E4.md", "memory-E4.png"]
    rep = _report(tmp_path)
    assert rep["schema_version"] == 1 and rep["kind"] == "memory" and rep["verdict"] == "PASS"
    for k in ("python", "torch", "cuda", "gpu", "driver", "cpu_count", "cpu_model"):  # verify/_meta.py's header
        assert k in rep["machine_info"]
    assert "git_commit" in rep and rep["utc"].endswith("+00:00") and len(rep["git"]["sources_sha256"]) == 64
    s = rep["settings"]
    assert (s["trainer"], s["adapter"], s["model_name"], s["seq_len"]) == ("xtrain", "verify.adapters.xtrain:adapter", "small", 256)
    assert [(c["N"], c["B"], c["sweeps"]) for c in rep["configs"]] == \
        [(1, 4, ["A"]), (2, 2, ["A"]), (4, 1, ["A", "B"]), (1, 1, ["B"]), (2, 1, ["B"])]
    for c in rep["configs"]:
        (x,) = c["ranks"]
        assert x["peak_bytes"] > 0 and x["isolation"] in ("fork", "exec") and x["trainer_class"] == "AccumTrainer"
        assert x["S"] == 256 and x["tok_s"] > 0 and "rows_s" not in x and x["input_dtype"] == "torch.int64"
        assert x["static_bytes"] == x["param_bytes"] + x["grad_bytes"] + x["optim_state_bytes"]
        # AdamW: exp_avg + exp_avg_sq, plus a 4-byte step counter per parameter tensor
        assert 0 <= x["optim_state_bytes"] - 2 * x["param_bytes"] < 4096
    pids = {c["ranks"][0]["pid"] for c in rep["configs"]}
    assert len(pids) == len(rep["configs"]), "each configuration must run in its own process"
    # the report's verdicts are what the checker says about its rows (one code path)
    again = check_invariants([[dict(c["ranks"][0], sweeps=c["sweeps"]) for c in rep["configs"]]], E_local=4, cuda=False)
    assert [v["status"] for v in again] == [v["status"] for v in rep["invariants"]] == ["PASS"] * 4
    md = (tmp_path / "memory-E4.md").read_text()
    assert "**PASS**" in md and "## Sweep A" in md and "## Sweep B" in md and "memory-E4.png" in md
    assert (tmp_path / "memory-E4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "verdict: PASS" in r.stdout and "sweep" in r.stdout.splitlines()[2]
    assert "5/5" in r.stderr  # progress bar
    # one process: AccumTrainer, the memory model's "single" mode, predicted of the CPU probe's quantity
    pr = rep["prediction"]
    assert (pr["mode"], pr["probe"], pr["verdict"]) == ("single", "cpu", "PASS") and s["warmup_steps"] == 1
    for c in rep["configs"]:
        (x,) = c["ranks"]
        assert x["predicted_bytes"] == c["predicted_bytes"] == sum(c["predicted_terms"].values())
        assert 0.8 < x["pred_ratio"] < 1.25
        assert ("gradients, held across micro-steps" in c["predicted_terms"]) == (c["N"] >= 2)


@pytest.mark.slow
def test_planted_leak_exits_1_naming_the_rows(tmp_path):
    """LeakyGraph keeps each micro-step's graph alive to the boundary: numerically correct, memory O(N)."""
    r = memory_cli(*SMALL, "--trainer", "leaky_graph", "--out", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "(a2) FAIL" in r.stdout and "(b1) FAIL" in r.stdout and "verdict: FAIL" in r.stdout
    assert "peak(N=4,B=1)" in r.stdout and "N=4 peak" in r.stdout  # the offending rows are named
    rep = _report(tmp_path)  # the report is still written, and says so
    assert rep["verdict"] == "FAIL" and rep["configs"][0]["ranks"][0]["trainer_class"] == "LeakyGraph"
    assert {v["id"]: v["status"] for v in rep["invariants"]}["b1"] == "FAIL"
    assert "**FAIL**" in (tmp_path / "memory-E4.md").read_text()


def test_leaky_graph_is_invisible_to_the_equivalence_gate():
    """Why the memory probe exists: the leak computes exactly the right gradients."""
    from verify.adapters.broken import MEMORY_BROKEN
    from verify.adapters.xtrain import XtrainOptions
    from verify.case import Case
    from verify.gates import check_equivalence
    from xtrain_core.config import ModelConfig, OptimConfig

    case = Case(accum_steps=3, micro_batch=2, steps=2,
                options=XtrainOptions(model=ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16),
                                      seq_len=8, optim=OptimConfig(lr=1e-2)))
    check_equivalence(MEMORY_BROKEN["leaky_graph"], case)


@pytest.mark.slow
def test_a_trainer_that_is_not_a_gpt_end_to_end(tmp_path):
    """Any adapter: an MLP over float vectors (tests/memory_adapters.py), its own data, options and
    optimizer, measured through the CLI in fresh probe processes that import it by reference."""
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(TESTS), ENV["PYTHONPATH"]]))
    r = memory_cli("--effective-batch", "4", "--device", "cpu", "--steps", "1", "--threads", "1",
                   "--verify-trainer", "memory_adapters:mlp", "--out", str(tmp_path), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = _report(tmp_path)
    s = rep["settings"]
    assert (s["adapter"], s["model_name"], s["model"], s["seq_len"]) == ("memory_adapters:mlp", None, None, None)
    assert s["options"] == dict(tokens=2048, features=64, hidden=512, lr=0.01) and s["n_params"] == 296_449
    assert rep["verdict"] == "PASS" and [v["status"] for v in rep["invariants"]] == ["PASS"] * 4
    for c in rep["configs"]:
        (x,) = c["ranks"]
        assert x["trainer_class"] == "MLPTrainer" and x["optimizer"]["cls"] == "SGD"
        assert x["input_shape"] == [2048, 64] and x["input_dtype"] == "torch.float64"
        assert "tok_s" not in x and x["rows_s"] > 0 and "S" not in x  # no tokens claimed for vectors
        assert x["optim_state_bytes"] == x["param_bytes"]  # SGD momentum: one buffer per parameter
        assert x["predicted_bytes"] is None and x["pred_ratio"] is None  # no memory model for this trainer
    assert rep["prediction"]["verdict"] == "N/A" and rep["prediction"]["mode"] is None
    assert "rows/s" in r.stdout and "tok/s" not in r.stdout and "adapter position-wise MLP (tests)" in r.stdout
    assert "meas/pred" in r.stdout and "(model) N/A" in r.stdout
    md = (tmp_path / "memory-E4.md").read_text()
    assert "rows/s" in md and "no token rate is claimed" in md and "Not predicted: no memory model" in md


@pytest.mark.parametrize("args,needle", [
    (["--effective-batch", "0"], "argument --effective-batch: must be ≥ 1, got 0"),
    (["--effective-batch", "-4"], "argument --effective-batch: must be ≥ 1, got -4"),
    (["--effective-batch", "2.5"], "argument --effective-batch: must be an integer ≥ 1, got '2.5'"),
    (["--effective-batch", "x"], "argument --effective-batch: must be an integer ≥ 1, got 'x'"),
    (["--model", "huge"], "argument --model: invalid choice: 'huge'"),
    (["--seq-len", "999", "--device", "cpu"], "--seq-len 999 exceeds --model small's limit of 256"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:K, got 'tpu'"),
    (["--trainer", "nope", "--device", "cpu"], "--trainer nope: unknown trainer; use one of xtrain, torch_ddp, fsdp2, fsdp2_keep, leaky_graph or MODULE:FACTORY"),
    (["--trainer", "no.such:f", "--device", "cpu"], "--trainer no.such:f: cannot import 'no.such'"),
    (["--verify-trainer", "no.such:f", "--device", "cpu"], "--verify-trainer no.such:f: cannot import 'no.such'"),
    (["--trainer", "memory_adapters:nothing", "--device", "cpu"],
     "--trainer memory_adapters:nothing: module 'memory_adapters' has no attribute 'nothing'"),
    (["--trainer", "memory_adapters:MLPTrainer", "--device", "cpu"], "'MLPTrainer' is a plain function; declare its data"),
    (["--trainer", "memory_adapters:mlp", "--model", "tiny", "--device", "cpu"],
     "--model applies to xtrain's trainer only; --trainer memory_adapters:mlp (position-wise MLP (tests))"),
    (["--trainer", "memory_adapters:mlp", "--model", "tiny", "--seq-len", "8", "--device", "cpu"],
     "--model and --seq-len apply to xtrain's trainer only"),
    (["--trainer", "leaky_graph", "--seq-len", "999", "--device", "cpu"], "--seq-len 999 exceeds --model small's limit"),
    (["--anchor", "/no/such.json", "--device", "cpu"], "--anchor /no/such.json: no such file"),
    (["--steps", "0"], "argument --steps: must be ≥ 1, got 0"),
    (["--device", "cpu", "--out", "/proc/no-such-dir"], "--out /proc/no-such-dir: cannot write there"),
])
def test_bad_input_is_one_line_exit_2(args, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path), *args])
    err = capsys.readouterr()
    assert e.value.code == 2 and err.out == ""
    assert err.err.count("\n") == 1 and err.err.startswith("verify.memory: error: ") and needle in err.err, err.err
    assert not any(tmp_path.iterdir())


def test_bad_input_as_a_user_sees_it(tmp_path):
    r = memory_cli("--effective-batch", "0", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == "verify.memory: error: argument --effective-batch: must be ≥ 1, got 0 (see --help)\n"
    if not HAS_CUDA:
        r = memory_cli("--device", "cuda", "--out", str(tmp_path))
        assert r.returncode == 2 and r.stderr == (
            "verify.memory: error: --device cuda: no CUDA GPU is visible to torch; use --device cpu\n")
    assert not any(tmp_path.iterdir())


# -- the invariant checker on synthetic rows (no measurement) ---------------------------------------

def _rows(peaks: dict, grad=10 * MiB, rank=0) -> list[dict]:
    out = []
    for c in plan_configs(max(n * b for n, b in peaks)):
        out.append(dict(N=c.N, B=c.B, sweeps=list(c.sweeps), rank=rank, grad_bytes=grad, peak_bytes=int(peaks[(c.N, c.B)] * MiB)))
    return out


GOOD = {(1, 8): 200, (2, 4): 110, (4, 2): 60, (8, 1): 40, (1, 1): 28, (2, 1): 40, (4, 1): 40.5}


def _status(per_rank, E=8, cuda=False):
    return {v["id"]: v for v in check_invariants(per_rank, E_local=E, cuda=cuda)}


def test_invariants_pass_on_accumulation_that_works():
    assert {k: v["status"] for k, v in _status([_rows(GOOD)]).items()} == dict(a1="PASS", a2="PASS", b1="PASS", b2="PASS")


def test_invariants_name_the_offending_rows():
    grows = _status([_rows({**GOOD, (4, 2): 120})])["a1"]  # 110 -> 120 at N=4: growth beyond 4 MiB
    assert grows["status"] == "FAIL" and grows["rows"] == [
        "N=4,B=2 peak 120.0 MiB > N=2,B=4 peak 110.0 MiB + tolerance 4.0 MiB"]
    leak = {**GOOD, (2, 1): 60, (4, 1): 100, (8, 1): 180, (4, 2): 100, (2, 4): 150}  # O(N) at fixed B
    v = _status([_rows(leak)])
    assert v["a2"]["status"] == "FAIL" and "peak(N=8,B=1) 180.0 MiB" in v["a2"]["rows"][0]
    assert v["b1"]["status"] == "FAIL" and v["b1"]["rows"][0].startswith("N=8 peak 180.0 MiB − N=2 peak 60.0 MiB")
    assert v["b2"]["status"] == "FAIL" and "= 32.0 MiB; gradient buffers 10.0 MiB" in v["b2"]["rows"][0]
    assert _status([_rows({**GOOD, (4, 1): 44.5})])["b1"]["status"] == "FAIL"  # 4.5 MiB > max(2%, 4 MiB)
    assert _status([_rows({**GOOD, (4, 1): 43.5})])["b1"]["status"] == "PASS"  # within the noise floor


def test_invariants_rank_names_and_errors():
    bad = _rows({**GOOD, (8, 1): 190, (4, 1): 100}, rank=1)
    v = _status([_rows(GOOD), bad])
    assert v["b1"]["status"] == "FAIL" and all(r.startswith("rank 1: ") for r in v["b1"]["rows"])
    crashed = _rows(GOOD)
    crashed[0] = dict(crashed[0], error="CUDA out of memory")
    del crashed[0]["peak_bytes"]
    v = _status([crashed])
    assert v["a2"]["status"] == "INCONCLUSIVE" and "N=1,B=8 failed to run: CUDA out of memory" in v["a2"]["rows"][0]


def test_leaving_n1_may_add_exactly_the_gradient_buffers():
    """Seen on an H200 (small model, S=64, E=4): peak(N=2,B=2) rose above peak(N=1,B=4) by about the
    gradient buffers, which live across micro-steps. That is correct accumulation, not growth; more is."""
    held = {**GOOD, (1, 8): 30, (2, 4): 39, (4, 2): 39.5, (8, 1): 40}  # activations ≪ 10 MiB of gradients
    assert _status([_rows(held)])["a1"]["status"] == "PASS"
    more = _status([_rows({**held, (2, 4): 45})])["a1"]  # 15 MiB > 10 MiB of gradients + 4 MiB tolerance
    assert more["status"] == "FAIL" and more["rows"] == [
        "N=2,B=4 peak 45.0 MiB > N=1,B=8 peak 30.0 MiB + gradient buffers 10.0 MiB + tolerance 4.0 MiB"]


def test_unmeasurable_activations_are_inconclusive_not_pass():
    tiny = {(1, 2): 21, (2, 1): 20, (1, 1): 18}
    v = _status([_rows(tiny)], E=2)
    assert v["a2"]["status"] == "INCONCLUSIVE" and "not measurable" in v["a2"]["rows"][0]
    # gradient buffers (10 MiB) ≥ one sequence's activations: accumulation cannot save memory at E=2
    small = {(1, 2): 40, (2, 1): 28, (1, 1): 18}  # ideal saving 40 − 18 − 10 = 12 MiB
    assert _status([_rows(small)], E=2)["a2"]["status"] == "INCONCLUSIVE"  # < 4 × 4 MiB on the CPU
    assert _status([_rows(small)], E=2, cuda=True)["a2"]["status"] == "PASS"  # ≥ 4 × 2 MiB: the allocator is exact


def test_plans():
    e32 = plan_configs(32)
    assert [(c.N, c.B) for c in e32 if "A" in c.sweeps] == [(1, 32), (2, 16), (4, 8), (8, 4), (16, 2), (32, 1)]
    assert [(c.N, c.B) for c in e32 if "B" in c.sweeps] == [(32, 1), (1, 1), (2, 1), (4, 1), (8, 1), (16, 1)]
    assert len(e32) == 11
    e12 = plan_configs(12)
    assert [c.N for c in e12 if "A" in c.sweeps] == [1, 2, 3, 4, 6, 12]
    assert sorted(c.N for c in e12 if "B" in c.sweeps) == [1, 2, 4, 8]
    assert [(c.N, c.B, c.sweeps) for c in plan_configs(1)] == [(1, 1, ("A", "B"))]


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
    import memory_adapters

    from verify.memory import measure
    from verify.protocol import Spec

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
    # the harness's own draw (verify.case): the adapter's batch at seed (data_seed << 16) + step, in order
    for step in range(3):
        x = adapter.batch(6, (1 << 16) + step, adapter.defaults)[0].float()
        for m in range(3):
            assert torch.equal(inputs[3 * step + m], x[2 * m:2 * m + 2])


def test_measure_counts_tokens_only_for_token_ids():
    from verify.adapters import xtrain
    from verify.memory import measure
    from verify.protocol import Spec
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


def test_the_anchor_ships_with_the_package():
    """An installed (non-editable) verify finds the plain-torch anchor: it is package data of verify.memory."""
    tomllib = pytest.importorskip("tomllib")

    import verify.memory
    from verify.memory.plan import ANCHOR_NAME, DEFAULT_ANCHOR

    assert DEFAULT_ANCHOR.is_file() and Path(str(DEFAULT_ANCHOR)).parent == Path(verify.memory.__file__).parent
    assert {(a["N"], a["B"]) for a in json.loads(DEFAULT_ANCHOR.read_text())} >= {(1, 32), (32, 1)}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert ANCHOR_NAME in pyproject["tool"]["setuptools"]["package-data"]["verify.memory"]


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
import json, torch
from verify.memory import RssProbe
p = RssProbe()
p.start()
x = torch.ones(48 * 2**20 // 4)  # 48 MiB, touched
print(json.dumps(p.stop(), default=str))
"""


def test_rss_probe_sees_a_resident_allocation():
    """In a fresh interpreter: in a long-lived xdist worker another test's memory, released while the probe
    runs, lowers the resident set by more than the 48 MiB allocated (seen in CI: peak 0 over a 1.3 GB base)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["peak_bytes"] >= 44 * MiB, out


def test_rss_probe_without_hwm_reset_says_so(monkeypatch):
    """Where /proc/self/clear_refs is refused, ru_maxrss still covers the warm-up: the row must say whether
    the measured steps set the peak (hwm_exact) instead of passing off an upper bound as exact."""
    from verify.memory import probes

    monkeypatch.setattr(probes, "reset_hwm", lambda: False)
    p = probes.RssProbe()
    p.start()
    x = torch.ones(8 * MiB // 4)
    out = p.stop()
    del x
    assert out["hwm_source"] == "ru_maxrss (no reset)"
    assert out["peak_bytes"] >= 7 * MiB or out["hwm_exact"] is False, out


def test_report_write_is_all_or_nothing(tmp_path, monkeypatch):
    from verify.memory import plot
    from verify.memory import report as memreport

    (tmp_path / "memory-E4.json").write_text("old")
    rep = json.loads(json.dumps(_fake_report()))
    monkeypatch.setattr(plot, "peaks_figure", lambda r: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError):
        memreport.write_all(rep, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory-E4.json"] and (tmp_path / "memory-E4.json").read_text() == "old"
    monkeypatch.undo()
    paths = memreport.write_all(rep, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory-E4.json", "memory-E4.md", "memory-E4.png"]
    assert json.loads(paths[0].read_text())["verdict"] == "PASS"


def _fake_report() -> dict:
    rows = _rows({(1, 4): 90, (2, 2): 60, (4, 1): 36, (1, 1): 23, (2, 1): 36})
    configs = [dict(N=r["N"], B=r["B"], eff=r["N"] * r["B"], sweeps=r["sweeps"], peak_bytes=r["peak_bytes"],
                    ranks=[dict(r, step_ms=1.0, tok_s=2.0, S=256)]) for r in rows]
    return dict(schema_version=1, kind="memory", utc="2026-01-01T00:00:00+00:00", git_commit=None, git=dict(dirty=None),
                verdict="PASS", machine_info=dict(python="3", torch="2", cuda=None, gpu=None, cpu_count=2, cpu_model="x"),
                settings=dict(effective_batch=4, world_size=1, device="cpu", model_name="small", seq_len=256,
                              measured_steps=1, trainer="xtrain", threads=1, n_params=1,
                              model=dict(n_layer=1, n_head=1, d_model=8, vocab_size=8)),
                probe=dict(primary="p", includes="i", isolation="fresh"),
                thresholds=dict(rel=0.02, abs_noise_bytes=4 * MiB, well_below="w", rise="r"),
                static=dict(param_bytes=MiB, grad_bytes=MiB, optim_state_bytes=2 * MiB, static_bytes=4 * MiB),
                configs=configs, invariants=check_invariants([rows], E_local=4, cuda=False), anchor=None)


# -- world > 1 ------------------------------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
def test_world_2_cpu_reports_per_rank_peaks(tmp_path):
    """torchrun, 2 ranks, gloo: each rank measures its own fresh processes, which join a process group of
    their own (so a data-parallel trainer can run collectives); rank 0 writes the per-rank report."""
    r = memory_cli("--effective-batch", "8", "--device", "cpu", "--model", "small", "--steps", "1",
                   "--threads", "1", "--out", str(tmp_path), torchrun=2)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = _report(tmp_path, 8)
    assert rep["settings"]["world_size"] == 2 and rep["settings"]["effective_batch_per_rank"] == 4
    assert [(c["N"], c["B"], c["eff"]) for c in rep["configs"]] == [(1, 4, 8), (2, 2, 8), (4, 1, 8), (1, 1, 2), (2, 1, 4)]
    for c in rep["configs"]:
        assert [x["rank"] for x in c["ranks"]] == [0, 1]
        assert all(x["process_group"] == dict(backend="gloo", world=2) for x in c["ranks"])
        # xtrain's adapter picks its data-parallel trainer when a group of world > 1 exists
        assert all(x["trainer_class"] == "DistAccumTrainer" for x in c["ranks"])
        assert c["peak_bytes"] == max(x["peak_bytes"] for x in c["ranks"])
    assert " / " in r.stdout  # per-rank cells in the table


# -- GPU (skipped without CUDA; alone on the GPU via the exclusive lock) ---------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_sweep_small_model(tmp_path):
    r = memory_cli("--effective-batch", "8", "--device", "cuda", "--model", "small", "--steps", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = _report(tmp_path, 8)
    assert rep["machine_info"]["gpu"] and rep["verdict"] == "PASS"
    # what is still allocated before each configuration: nothing before the first; afterwards only what
    # torch keeps for the process (cuBLAS workspaces), the same every time: nothing leaks between configurations
    left = [c["ranks"][0]["allocated_left_over_bytes"] for c in rep["configs"]]
    assert left[0] == 0 and max(left[1:]) - min(left[1:]) <= MiB and max(left) < 256 * MiB, left
    for c in rep["configs"]:
        (x,) = c["ranks"]
        assert x["peak_bytes"] >= x["static_bytes"] and x["peak_reserved_bytes"] >= x["peak_bytes"]
        if rep["machine_info"]["nvml"] == "ok":
            assert x["nvml_peak_used_bytes"] >= x["peak_reserved_bytes"] and x["nvml_period_s"] == 0.002
        else:
            assert x["nvml_peak_used_bytes"] is None and x["nvml_error"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_planted_leak_exits_1(tmp_path):
    r = memory_cli("--effective-batch", "8", "--device", "cuda", "--model", "small", "--steps", "1",
                   "--trainer", "leaky_graph", "--out", str(tmp_path))
    assert r.returncode == 1 and "(b1) FAIL" in r.stdout, r.stdout + r.stderr


def test_anchor_comparison_and_gpu_rendering_without_a_gpu(tmp_path):
    """The H200 report's anchor section, rendered from rows that reproduce plain torch's own numbers."""
    from verify.adapters import xtrain
    from verify.memory import report as memreport
    from verify.memory.plan import DEFAULT_ANCHOR, GiB, Plan
    from verify.memory.anchor import compare_anchor
    from xtrain_core.config import PRESETS, OptimConfig

    anchor = json.loads(DEFAULT_ANCHOR.read_text())
    opts = xtrain.XtrainOptions(model=PRESETS["gpt2-ish"], seq_len=512, optim=OptimConfig())
    plan = Plan(E=32, world=1, rank=0, device=torch.device("cuda", 0), adapter=xtrain.adapter, trainer="xtrain",
                options=opts, model_name="gpt2-ish", steps=3, threads=1, out=tmp_path, anchor=DEFAULT_ANCHOR,
                configs=plan_configs(32))
    by = {(a["N"], a["B"]): a for a in anchor}
    by[(4, 1)] = dict(by[(2, 1)], N=4)  # the anchor has no (4,1) / (16,1): use the flat B=1 value
    by[(16, 1)] = dict(by[(2, 1)], N=16)
    rows = [dict(N=c.N, B=c.B, eff=c.N * c.B, sweeps=list(c.sweeps), rank=0, grad_bytes=int(by[(c.N, c.B)]["static_gib"] / 4 * GiB),
                 peak_bytes=int(by[(c.N, c.B)]["peak_alloc_gib"] * GiB), peak_reserved_bytes=int(by[(c.N, c.B)]["peak_reserved_gib"] * GiB),
                 nvml_peak_used_bytes=int(by[(c.N, c.B)]["nvml_peak_gib"] * GiB), nvml_period_s=0.002, nvml_mean_interval_s=0.0021,
                 step_ms=by[(c.N, c.B)]["step_ms"], tok_s=by[(c.N, c.B)]["tok_s"], static_bytes=int(by[(c.N, c.B)]["static_gib"] * GiB))
            for c in plan.configs]
    a = compare_anchor(plan, rows)
    assert a["source"] == "verify/memory/h200_torch_single_E32.json (shipped with verify)"
    assert [t["status"] for t in a["targets"]] == ["PASS", "PASS"]
    assert abs(a["targets"][0]["ours"] - 0.1255) < 1e-3 and a["targets"][0]["anchor"] == pytest.approx(a["targets"][0]["ours"], rel=1e-6)
    worse = [dict(r, peak_bytes=r["peak_bytes"] + 64 * 2**20) if (r["N"], r["B"]) == (32, 1) else r for r in rows]
    assert compare_anchor(plan, worse)["targets"][0]["status"] == "FAIL"  # 64 MiB more at (32,1): ratio 0.1294
    from dataclasses import replace

    assert compare_anchor(replace(plan, options=replace(opts, seq_len=256)), rows) is None  # not the anchor's setting
    assert compare_anchor(replace(plan, adapter=None, options=None, model_name=None), rows) is None  # not xtrain's GPT
    inv = check_invariants([rows], E_local=32, cuda=True)
    assert [v["status"] for v in inv] == ["PASS"] * 4, inv
    rep = _fake_report()
    rep.update(settings=dict(rep["settings"], effective_batch=32, device="cuda:0", model_name="gpt2-ish", seq_len=512),
               machine_info=dict(rep["machine_info"], gpu="NVIDIA H200", driver="580", nvml="ok", cuda="13.0"),
               probe=dict(rep["probe"], nvml="n"), invariants=inv, anchor=dict(a, verdict="PASS"),
               configs=[dict(N=r["N"], B=r["B"], eff=r["eff"], sweeps=r["sweeps"], peak_bytes=r["peak_bytes"], ranks=[r]) for r in rows])
    rep["verdict"] = memreport.overall(rep)
    assert rep["verdict"] == "PASS"
    memreport.write_all(rep, tmp_path)
    md = (tmp_path / "memory-E32.md").read_text()
    assert "## Beside plain torch on one H200" in md and "| 32 | 1 | 2.041 / 2.041 |" in md and "period 2 ms" in md
    assert "(anchor) PASS" in memreport.text_table(rep)
