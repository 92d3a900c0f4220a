"""Smoke tests of benchmarks/: each script's cheapest configuration, on the CPU, in a subprocess, as a
user would start it. They prove the scripts still run and write their JSON with the common header, not
anything about speed."""
import json
import os
import subprocess
import sys

import pytest
import torch

import verify


pytestmark = pytest.mark.slow  # subprocesses end to end: deselect with -m 'not slow' for fast feedback
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # benchmarks/ is a folder of the repository, not part of the installed package
    sys.path.insert(0, ROOT)
TINY = ["--seq-len", "16", "--vocab-size", "32", "--d-model", "16", "--n-layer", "1", "--n-head", "2"]


def _run(args, out, timeout=120):
    # One intra-op thread: on a small shared box, spinning OpenMP workers make a tiny step 100x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XTRAIN_TEST_THREADS": "1"}
    p = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _report(path) -> dict:
    assert path.is_file(), f"{path.name} not written"
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == verify.report_header("benchmarks")["schema_version"]
    assert isinstance(doc["machine_info"], dict) and doc["machine_info"]["torch"] == torch.__version__
    return doc


def test_plain_torch_starts_where_xtrain_starts():
    """bench_single's promise: under the same seed both models hold the same weights and, on the same
    tokens, compute the same loss."""
    from benchmarks import plain_torch
    from xtrain_core.config import PRESETS
    from xtrain_core.model import build_model

    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    plain = plain_torch.GPT(vocab=cfg.vocab_size, d=cfg.d_model, layers=cfg.n_layer, heads=cfg.n_head, seq=cfg.seq_len)
    ours = build_model(cfg, 0)
    assert sum(p.numel() for p in plain.parameters()) == cfg.n_params
    (x, y), = plain_torch.random_tokens(torch.Generator().manual_seed(1), 1, 2, 16, cfg.vocab_size, "cpu")
    torch.testing.assert_close(plain_torch.lm_loss(plain, x, y), ours.loss_batched(x, y), rtol=1e-6, atol=1e-6)


def test_bench_single_cpu(tmp_path):
    _run(["-m", "benchmarks.bench_single", "--device", "cpu", "--model", "tiny", "--seq-len", "8",
          "--rounds", "1", "--configs", "1x2,2x1"], tmp_path)
    doc = _report(tmp_path / "bench-single.json")
    assert [(r["N"], r["B"]) for r in doc["rows"]] == [(1, 2), (2, 1)]


def test_plain_torch_cli_cpu(tmp_path):
    _run(["-m", "benchmarks.plain_torch", "single", "--device", "cpu", "--configs", "2x1", "--steps", "1", *TINY],
         tmp_path)
    doc = _report(tmp_path / "plain_torch_single.json")
    assert doc["rows"][0]["N"] == 2 and doc["rows"][0]["step_ms"] > 0


@pytest.mark.distributed
def test_bench_dist_pools_cpu(tmp_path):
    _run(["-m", "benchmarks.bench_dist", "--backend", "gloo", "--worlds", "1", "--reps", "1", "--drawn", "1",
          "--cold", "forkserver"], tmp_path)
    doc = _report(tmp_path / "bench_dist_pools_gloo.json")
    assert [r["world"] for r in doc["results"]["examples"]] == [1]


@pytest.mark.distributed
def test_bench_dist_steps_under_torchrun_cpu(tmp_path):
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "benchmarks.bench_dist",
          "--device", "cpu", "--model", "tiny", "--seq", "8", "--accum-steps", "2", "--b", "1", "--reps", "1",
          "--steps", "1"], tmp_path)
    res = _report(tmp_path / "bench_dist_steps_cpu_w2.json")["results"]
    assert set(res["median_step_ms"]) == {"xtrain", "torch", "plain"}
    for side, counted in res["collectives_one_step"].items():  # nothing before the last micro-step
        assert counted["per_window"]["micro 0"] == [], (side, counted["per_window"])


@pytest.mark.distributed
def test_fsdp2_reduce_dtype_reports_each_paths_dtype(tmp_path):
    """pytorch #190626 as a reported row: the counter names the dtype of the norm weight's tp all-reduce on the
    plain (N = 1) and the accumulation (N = 4) path, the gates pass both, and the state follows the dtypes seen."""
    out = tmp_path / "fsdp2-reduce-dtype.json"
    _run(["-m", "benchmarks.fsdp2_reduce_dtype"], out, timeout=300)
    doc = _report(out)
    rows = doc["rows"]
    assert [(r["dp"], r["tp"], r["N"]) for r in rows] == [(1, 2, 1), (1, 2, 4), (2, 2, 1), (2, 2, 4)]
    assert all(r["verdict"] == "passed" and r["worst_ratio"] < 1 for r in rows), rows
    seen = [r["norm_grad_tp_reduce"] for r in rows]
    assert all(len(d) == 1 and d[0] in ("bfloat16", "float32") for d in seen), seen  # one dtype, counted on every rank
    plain = {r["norm_grad_tp_reduce"][0] for r in rows if r["N"] == 1}
    accum = {r["norm_grad_tp_reduce"][0] for r in rows if r["N"] > 1}
    assert accum == {"float32"}, accum  # FSDP2 upcasts the accumulated gradient to reduce_dtype first
    assert doc["state"] == ("present" if plain != accum else "absent")
    assert (tmp_path / "fsdp2-reduce-dtype.md").read_text().count("| dp=") == 4


def test_fsdp2_reduce_dtype_bad_out_is_one_line_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.fsdp2_reduce_dtype", "--out", str(tmp_path / "x.md")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--out must name a .json file" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not os.listdir(tmp_path)


# -- benchmarks/frameworks.py: the venvs and the HF runs are stood in for (the real run is minutes of installs) --

def test_frameworks_bad_input_is_one_line_exit_2(tmp_path):
    for args, msg in ((["--versions", "4.x"], "--versions: '4.x' is not a release number"),
                      (["--cache", os.path.join(ROOT, "venvs")], "inside the repository"),
                      (["--max-world", "0"], "--max-world")):
        p = subprocess.run([sys.executable, "-m", "benchmarks.frameworks", "--out", str(tmp_path), *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr and msg in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""
    assert not os.path.exists(os.path.join(ROOT, "venvs"))


def test_frameworks_writes_the_report_from_stand_in_runs(tmp_path, monkeypatch):
    """Stand-ins for the venv and the plugin run: 4.45.2 rejected by a gate naming its shrunk case, the
    current release passing. The report names both, the gate and the case; exit 0 only when every verdict
    is the expected one."""
    from benchmarks import frameworks as fw
    from benchmarks import stacks

    rejected = {"failures": [{"test": "verify/test_gates.py::test_split_invariance", "hint": "a per-micro-batch mean",
                              "gate": "split invariance",
                              "message": "verify._internal.gates.tolerance.GateFailure: [split invariance] split N=2 B=1 of a "
                                         "window of 2 rows: loss 4.1 vs 4.0; case N=1 B=2 K=1 seed=0 data_seed=0 "
                                         "lengths=[8, 7]\nmore lines"}],
                "gates": {"split invariance": {"examples": 3, "worst_ratio": None}}}
    passing = {"failures": [], "gates": {"equivalence": {"examples": 10, "worst_ratio": 0.25}}}
    runs = {"4.45.2": dict(exit_code=1, report=rejected), "current": dict(exit_code=0, report=passing)}
    monkeypatch.setattr(fw, "venv", lambda v, cache, log: (v, {"transformers": "4.45.2" if v == "4.45.2" else "5.0.0",
                                                                "accelerate": "1.0.1"}, 0.0))
    monkeypatch.setattr(fw, "run_gates", lambda py, d, **k: dict(runs[py], seconds=1.5, summary="1 failed",
                                                                       test_seconds={"test_split_invariance": 41.2}))
    next_lr = ("[reported metrics] lr reported 0.00099, expected 0.001 (the LR the optimizer applied) (= the LR after "
               "the scheduler's step (the next step's)) (the big batch, step 0); case N=2 B=2 K=2 seed=1 data_seed=2")
    probes = {"4.45.2": {"grad_norm": "passes", "lr": next_lr}, "current": {"grad_norm": "passes", "lr": "passes"}}
    monkeypatch.setattr(fw, "run_probe", lambda py, log: probes[py])
    selftests = []  # a passing row's self-test: the current release's two recipes (the rejected one: nothing to mutate)
    st = {"current": dict(exit_code=0, ok=True, score="23/23", seconds=30.0)}
    monkeypatch.setattr(fw, "run_selftest", lambda py, d, **k: selftests.append(py) or st[py])
    out = tmp_path / "out"
    assert fw.main(["--out", str(out), "--versions", "4.45.2,current", "--cache", str(tmp_path / "cache")]) == 0
    assert selftests == ["current", "current"]  # the HF recipe's and TRL's SFT recipe's rows
    doc = json.loads((out / "frameworks.json").read_text())
    assert doc["kind"] == "frameworks" and doc["schema_version"] == verify.report_header("frameworks")["schema_version"]
    old, new, sft = doc["versions"]
    assert (new["recipe"], sft["recipe"]) == (stacks.HF, stacks.SFT) and sft["verdict"] == "passes"
    assert (old["verdict"], old["expected"], new["verdict"], new["expected"]) == ("rejected", "rejected", "passes", "passes")
    assert old["failures"][0]["gate"] == "split invariance" and old["failures"][0]["case"].endswith("lengths=[8, 7]")
    md = (out / "frameworks.md").read_text()
    assert ("| transformers 4.45.2 | examples.hf_trainer:factory | transformers 4.45.2, accelerate 1.0.1 | rejected | "
            "rejected ✓ | — |") in md and "| split invariance | test_split_invariance |" in md
    assert "| passes | passes ✓ | 23/23 ✓ (30.0 s) |" in md and new["selftest"]["score"] == "23/23"
    assert old["failures"][0]["seconds"] == 41.2 and "| 41.2 |" in md  # the time to the shrunk verdict
    # each metric judged alone, its known cause named; a release's known bugs listed (the current one has none)
    assert old["metrics"] == probes["4.45.2"] and "| lr | `[reported metrics] lr reported 0.00099" in md
    assert "the next step's, not the one applied (#35942" in md and "| grad_norm | `passes` |" in md
    tf = stacks.STACKS[""]
    assert old["known"] == [stacks.PER_MICRO, stacks.NEXT_LR, stacks.PER_RANK] and new["known"] == []
    bugs = lambda r: [k.what for k in tf.bugs(r)]  # noqa: E731
    assert bugs("4.50.0") == [stacks.NEXT_LR, stacks.PER_RANK] and bugs("4.54.0") == []
    assert bugs("4.46.3") == [stacks.PER_MICRO, stacks.NOT_OVER_N, stacks.NEXT_LR, stacks.PER_RANK]
    assert bugs("5.5.3") == [stacks.TWICE_OVER_N] and bugs("5.5.4") == [] == bugs("5.1")
    assert bugs("5.9.0") == [stacks.OVERCOUNT] and bugs("5.10.1") == []  # #46204: TRL's SFT recipe alone
    assert [r for r, _ in tf.rows("5.9.0")] == [stacks.SFT]
    head = " ".join(stacks.known_text())  # verl's sequence-mean bug is one bug of three recipes: told once
    assert all(head.count(f"{k.what}") == 1 for s in stacks.STACKS.values() for k in s.known), head
    st["current"] = dict(exit_code=1, ok=False, score="22/23", seconds=30.0)  # a passing row whose operator survives
    assert fw.main(["--out", str(out), "--versions", "current", "--cache", str(tmp_path / "cache")]) == 1
    assert "| passes | passes ✗ (not as expected) | 22/23 ✗ (30.0 s) |" in (out / "frameworks.md").read_text()
    runs["4.45.2"] = dict(exit_code=0, report=passing)  # the old release passing would be a finding, not a success
    st["4.45.2"] = st["current"]
    assert fw.main(["--out", str(out), "--versions", "4.45.2", "--cache", str(tmp_path / "cache")]) == 1
    assert "not as expected" in (out / "frameworks.md").read_text()


def test_frameworks_runs_each_stacks_recipes_and_an_uninstallable_release_is_one_row(tmp_path, monkeypatch):
    """trl-0.21.0 runs the recipe its known bug concerns (expected rejected); trl-current every TRL loss type;
    deepspeed-0.18.8 the #7985 configuration, deepspeed-current the stage-drawing adapters. A release pip cannot
    install is one row saying so, and the others still run."""
    from benchmarks import frameworks as fw
    from benchmarks import stacks

    rejected = {"failures": [{"test": "verify/test_gates.py::test_normaliser", "gate": "normaliser", "hint": None,
                              "message": "[normaliser] term 'loss' (token_mean) additivity; case N=3 B=2 K=2 seed=1"}]}
    seen = []

    def venv(v, cache, log):
        if v == "lightning-9.9.9":
            raise RuntimeError("pip ... exited 1: ERROR: No matching distribution found for lightning==9.9.9")
        return v, {"trl": "0.21.0" if v == "trl-0.21.0" else "1.16.0", "deepspeed": "0.18.8"}, 0.0

    def run_gates(py, d, trainer, **k):
        seen.append((py, trainer))
        bad = py in ("trl-0.21.0", "deepspeed-0.18.8")
        return dict(exit_code=1 if bad else 0, report=rejected if bad else {"failures": []}, seconds=1.0, summary="",
                    test_seconds={})

    monkeypatch.setattr(fw, "venv", venv)
    monkeypatch.setattr(fw, "run_gates", run_gates)
    monkeypatch.setattr(fw, "run_probe", lambda py, log: pytest.fail("only the HF recipe's metrics are probed"))
    monkeypatch.setattr(fw, "run_selftest", lambda py, d, **k: dict(exit_code=0, ok=True, score="9/9", seconds=1.0))
    out = tmp_path / "out"
    tokens = "trl-0.21.0,trl-current,deepspeed-0.18.8,deepspeed-current,lightning-9.9.9"
    assert fw.main(["--out", str(out), "--versions", tokens, "--cache", str(tmp_path / "c")]) == 0
    assert seen == [("trl-0.21.0", stacks.TRL), *[("trl-current", r) for r in stacks.STACKS["trl"].recipes],
                    ("deepspeed-0.18.8", stacks.DEEPSPEED_BF16),
                    *[("deepspeed-current", r) for r in stacks.STACKS["deepspeed"].recipes]]
    assert stacks.STACKS["trl"].pins("0.21.0")[:3] == ["torch==2.13.0", "trl==0.21.0", "transformers==4.55.4"]
    doc = json.loads((out / "frameworks.json").read_text())
    last = doc["versions"][-1]
    assert last["verdict"] == "not installed" and "No matching distribution" in last["error"], last
    md = (out / "frameworks.md").read_text()
    assert "| TRL 0.21.0 | examples.trl_grpo:factory | trl 0.21.0, deepspeed 0.18.8 | rejected | rejected ✓ | — |" in md
    assert "TRL 0.21's 'bnpo' divides each micro-batch's token sum" in md and "Not installable here: `pip" in md
    assert "## DeepSpeed 0.18.8, examples.deepspeed_zero:bf16_zero1: rejected" in md


def test_a_stacks_era_picks_the_recipes_of_its_releases():
    """verl 0.8 dropped the legacy actor for its engine: a bug-free release from 0.9 on (and 'current') runs the engine
    recipes, 0.7.1 its known bugs' legacy recipes; a stack without eras runs its recipes everywhere."""
    from benchmarks import stacks

    verl = stacks.STACKS["verl"]
    engine = [stacks.VERL_ENGINE + m for m in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                                               "seq_mean_token_sum_norm")]
    assert [r for r, _ in verl.rows("0.9.1")] == engine == [r for r, _ in verl.rows("current")]
    assert [r for r, _ in verl.rows("0.9")] == engine and all(not k for _, k in verl.rows("0.9.0"))
    assert [r for r, _ in verl.rows("0.7.1")] == [stacks.VERL + r.split(":")[1] for r in engine]
    assert stacks.STACKS["trl"].recipes_of("0.99.0") == stacks.STACKS["trl"].recipes


def test_fp8_twins_without_torchao_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from benchmarks import fp8_twins

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed (the test extra installs it)

    with pytest.raises(SystemExit) as e:
        fp8_twins.main(["--out", str(tmp_path / "fp8.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "benchmarks.fp8_twins: error: torchao is not installed: pip install torchao\n"
    assert not list(tmp_path.iterdir())


def test_reference_zoo_finds_no_false_alarm_and_names_another_computation(tmp_path, monkeypatch):
    """benchmarks.reference_zoo: the zoo's first trainers' big batches sit at their precision's rounding from their
    float64 runs (exit 0); a trainer whose float64 build computes 3× the loss is named (exit 1)."""
    from benchmarks import reference_zoo
    from benchmarks.zoo import population
    from planted import broken

    out = tmp_path / "reference-zoo.json"
    assert reference_zoo.main(["--seeds", "0:4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["trainers"] >= 1 and doc["false_alarms"] == 0 and max(doc["worst_gap"].values()) < 0.01, doc
    monkeypatch.setattr(population, "t0", broken.other_reference, raising=False)
    assert reference_zoo.main(["--seeds", "0:1", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["rows"][0]["gaps"]["fp32"] == pytest.approx(2 / 3)


def test_start_zoo_finds_no_false_alarm_and_names_a_redraw(tmp_path, monkeypatch):
    """benchmarks.start_zoo: the zoo's first trainers start alike in float32 and float64 (exit 0, the report
    written); a population whose trainer draws in Spec.dtype is named (exit 1)."""
    from benchmarks import start_zoo
    from benchmarks.zoo import population
    from planted import broken

    out = tmp_path / "start-zoo.json"
    assert start_zoo.main(["--seeds", "0:4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["trainers"] >= 1 and doc["false_alarms"] == 0, doc
    monkeypatch.setattr(population, "t0", broken.drawn_in_spec_dtype, raising=False)
    assert start_zoo.main(["--seeds", "0:1", "--out", str(out)]) == 1
    assert "does not start from the float32 run's weights" in json.loads(out.read_text())["rows"][0]["false_alarms"][0]
