"""verify.memory end to end, as a user runs it (`python -m verify.memory`, small CPU sweeps): xtrain's GPT
with its memory model, a trainer that is not a GPT, a user's own memory model (the predicted_peak hook),
proof that a planted leak makes it exit 1, bad input, world 2 under torchrun. GPU tests run where CUDA is
present, alone on the GPU (verify/_internal/gpulock.py)."""
from __future__ import annotations


import pytest
from tests.helpers.memory import ENV, HAS_CUDA, SMALL, memory_cli, report_of

from verify.memory.__main__ import main
from verify.memory.invariants import check_invariants
from verify.memory.plan import MiB

pytestmark = pytest.mark.memory


@pytest.mark.slow
def test_cpu_sweep_passes_and_writes_the_reports(tmp_path):
    r = memory_cli(*SMALL, "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory-E4.json", "memory-E4.md", "memory-E4.png"]
    rep = report_of(tmp_path)
    assert rep["schema_version"] == 1 and rep["kind"] == "memory" and rep["verdict"] == "PASS"
    for k in ("python", "torch", "cuda", "gpu", "driver", "cpu_count", "cpu_model"):  # verify/_internal/header.py's header
        assert k in rep["machine_info"]
    assert "git_commit" in rep and rep["utc"].endswith("+00:00") and len(rep["git"]["sources_sha256"]) == 64
    s = rep["settings"]
    assert (s["trainer"], s["adapter"], s["model_name"], s["seq_len"]) == ("xtrain", "xtrain_proof.adapters:adapter", "small", 256)
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
    r = memory_cli(*SMALL, "--trainer", "planted.broken:leaky_graph", "--out", str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "(a2) FAIL" in r.stdout and "(b1) FAIL" in r.stdout and "verdict: FAIL" in r.stdout
    assert "peak(N=4,B=1)" in r.stdout and "N=4 peak" in r.stdout  # the offending rows are named
    rep = report_of(tmp_path)  # the report is still written, and says so
    assert rep["verdict"] == "FAIL" and rep["configs"][0]["ranks"][0]["trainer_class"] == "LeakyGraph"
    assert {v["id"]: v["status"] for v in rep["invariants"]}["b1"] == "FAIL"
    assert "**FAIL**" in (tmp_path / "memory-E4.md").read_text()


def test_leaky_graph_is_invisible_to_the_equivalence_gate():
    """Why the memory probe exists: the leak computes exactly the right gradients."""
    from planted.broken import MEMORY_BROKEN
    from xtrain_proof.adapters import XtrainOptions
    from verify._internal.cases.case import Case
    from verify._internal.gates import check_equivalence
    from xtrain_core.config import ModelConfig, OptimConfig

    case = Case(accum_steps=3, micro_batch=2, steps=2,
                options=XtrainOptions(model=ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16),
                                      seq_len=8, optim=OptimConfig(lr=1e-2)))
    check_equivalence(MEMORY_BROKEN["leaky_graph"], case)


@pytest.mark.slow
def test_a_trainer_that_is_not_a_gpt_end_to_end(tmp_path):
    """Any adapter: an MLP over float vectors (tests/helpers/memory_adapters.py), its own data, options and
    optimizer, measured through the CLI in fresh probe processes that import it by reference."""
    r = memory_cli("--effective-batch", "4", "--device", "cpu", "--steps", "1", "--threads", "1",
                   "--verify-trainer", "tests.helpers.memory_adapters:mlp", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report_of(tmp_path)
    s = rep["settings"]
    assert (s["adapter"], s["model_name"], s["model"], s["seq_len"]) == ("tests.helpers.memory_adapters:mlp", None, None, None)
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


def test_a_users_own_memory_model_is_judged(tmp_path):
    """The predicted_peak hook through the CLI's report path (flags -> plan -> report, rows synthetic: the
    measurement itself is the end-to-end tests' business): a user's adapter brings its own prediction (1 GiB
    for a tiny MLP: absurd), the report names its mode and the rows, and the verdict is FAIL (exit 1)."""
    from verify.memory import report as memreport
    from verify.memory.cli import _report, build_plan, parse_args
    from tests.helpers.memory import rows

    plan = build_plan(parse_args(["--effective-batch", "2", "--device", "cpu", "--out", str(tmp_path),
                                  "--trainer", "tests.helpers.memory_adapters:tiny_mlp_modelled"]))
    fields = dict(trainer_class="MLPTrainer", static_bytes=0, param_bytes=0, param_count=0, optim_state_bytes=0,
                  step_ms=1.0, rows_s=1.0, step_s=[1.0], losses=[0.0])
    measured = [dict(r, **fields) for r in rows({(1, 2): 30, (2, 1): 20, (1, 1): 18})]
    rep = _report(plan, [measured], [], 0.0)
    pr = rep["prediction"]
    assert (pr["mode"], pr["verdict"], pr["quantity"]) == ("one GiB", "FAIL", "a fixed guess")
    assert pr["rows"][0] == "rank 0: N=1,B=2 measured 30.0 MiB / predicted 1024.0 MiB = 0.03"
    assert rep["verdict"] == "FAIL" and memreport.EXIT_CODES[rep["verdict"]] == 1
    assert "(model) FAIL" in memreport.text_table(rep)
    assert "Mode **one GiB** (tests/helpers/memory_adapters.py)." in memreport.render_md(rep)


@pytest.mark.parametrize("args,needle", [
    (["--effective-batch", "0"], "argument --effective-batch: must be ≥ 1, got 0"),
    (["--effective-batch", "-4"], "argument --effective-batch: must be ≥ 1, got -4"),
    (["--effective-batch", "2.5"], "argument --effective-batch: must be an integer ≥ 1, got '2.5'"),
    (["--effective-batch", "x"], "argument --effective-batch: must be an integer ≥ 1, got 'x'"),
    (["--model", "huge"], "argument --model: invalid choice: 'huge'"),
    (["--seq-len", "999", "--device", "cpu"], "--seq-len 999 exceeds --model small's limit of 256"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:K, got 'tpu'"),
    (["--trainer", "nope", "--device", "cpu"], "--trainer nope: unknown trainer; use one of xtrain, torch_ddp, fsdp2, fsdp2_keep or MODULE:FACTORY"),
    (["--trainer", "no.such:f", "--device", "cpu"], "--trainer no.such:f: cannot import 'no.such'"),
    (["--verify-trainer", "no.such:f", "--device", "cpu"], "--verify-trainer no.such:f: cannot import 'no.such'"),
    (["--trainer", "tests.helpers.memory_adapters:nothing", "--device", "cpu"],
     "--trainer tests.helpers.memory_adapters:nothing: module 'tests.helpers.memory_adapters' has no attribute 'nothing'"),
    (["--trainer", "tests.helpers.memory_adapters:MLPTrainer", "--device", "cpu"], "'MLPTrainer' is a plain function; declare its data"),
    (["--trainer", "tests.helpers.memory_adapters:mlp", "--model", "tiny", "--device", "cpu"],
     "--model applies to xtrain's trainer only; --trainer tests.helpers.memory_adapters:mlp (position-wise MLP (tests))"),
    (["--trainer", "tests.helpers.memory_adapters:mlp", "--model", "tiny", "--seq-len", "8", "--device", "cpu"],
     "--model and --seq-len apply to xtrain's trainer only"),
    (["--trainer", "planted.broken:leaky_graph", "--seq-len", "999", "--device", "cpu"], "--seq-len 999 exceeds --model small's limit"),
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


@pytest.mark.parametrize("args,needle", [
    ([], "--trainer MODULE:FACTORY is required"),
    (["--trainer", "xtrain"], "--trainer xtrain: unknown trainer; use MODULE:FACTORY naming an adapter"),
    (["--trainer", "tests.helpers.memory_adapters:mlp", "--model", "tiny"], "unrecognized arguments: --model tiny"),
])
def test_without_a_wing_the_cli_knows_no_trainer(args, needle, capsys, tmp_path):
    """verify.memory.cli.main without xtrain's wing: no default trainer, no short names, no xtrain flags."""
    from verify.memory.cli import main as generic_main

    with pytest.raises(SystemExit) as e:
        generic_main(["--out", str(tmp_path), "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and needle in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_bad_input_as_a_user_sees_it(tmp_path):
    r = memory_cli("--effective-batch", "0", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == "verify.memory: error: argument --effective-batch: must be ≥ 1, got 0 (see --help)\n"
    if not HAS_CUDA:
        r = memory_cli("--device", "cuda", "--out", str(tmp_path))
        assert r.returncode == 2 and r.stderr == (
            "verify.memory: error: --device cuda: no CUDA GPU is visible to torch; use --device cpu\n")
    assert not any(tmp_path.iterdir())



# -- world > 1 ------------------------------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
def test_world_2_cpu_reports_per_rank_peaks(tmp_path):
    """torchrun, 2 ranks, gloo: each rank measures its own fresh processes, which join a process group of
    their own (so a data-parallel trainer can run collectives); rank 0 writes the per-rank report."""
    # --warmup 1: torchrun's default of 2 is for torch DDP's bucket rebuild; xtrain's flat buffer has none
    r = memory_cli("--effective-batch", "8", "--device", "cpu", "--model", "small", "--steps", "1", "--warmup", "1",
                   "--threads", "1", "--out", str(tmp_path), torchrun=2)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = report_of(tmp_path, 8)
    assert rep["settings"]["world_size"] == 2 and rep["settings"]["effective_batch_per_rank"] == 4
    assert [(c["N"], c["B"], c["eff"]) for c in rep["configs"]] == [(1, 4, 8), (2, 2, 8), (4, 1, 8), (1, 1, 2), (2, 1, 4)]
    for c in rep["configs"]:
        assert [x["rank"] for x in c["ranks"]] == [0, 1]
        assert all(x["process_group"] == dict(backend="gloo", world=2) for x in c["ranks"])
        # xtrain's adapter picks its data-parallel trainer when a group of world > 1 exists
        assert all(x["trainer_class"] == "DistAccumTrainer" for x in c["ranks"])
        assert c["peak_bytes"] == max(x["peak_bytes"] for x in c["ranks"])
        # xtrain's flat-buffer memory model (the "xtrain" mode of benchmarks.memory_modes), per rank
        assert all(0.85 < x["pred_ratio"] < 1.15 for x in c["ranks"]), c["ranks"]
    assert rep["verdict"] == "PASS" and [v["status"] for v in rep["invariants"]] == ["PASS"] * 4, rep["invariants"]
    assert " / " in r.stdout  # per-rank cells in the table


# -- GPU (skipped without CUDA; alone on the GPU via the exclusive lock) ---------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_sweep_small_model(tmp_path):
    r = memory_cli("--effective-batch", "8", "--device", "cuda", "--model", "small", "--steps", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = report_of(tmp_path, 8)
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
                   "--trainer", "planted.broken:leaky_graph", "--out", str(tmp_path))
    assert r.returncode == 1 and "(b1) FAIL" in r.stdout, r.stdout + r.stderr



def test_an_effective_batch_that_cannot_fit_is_refused_with_the_estimate(capsys, tmp_path):
    """Inside its documented bound (≤ 65536) yet far beyond the machine: refused up front from the adapter's
    own memory model at B=1 and 2 (it was OOM-killed after taking all the memory, leaving an empty --out)."""
    from verify._internal.cli import available_memory

    out = tmp_path / "reports"
    with pytest.raises(SystemExit) as e:
        main(["--out", str(out), "--effective-batch", "65536", "--device", "cpu"])
    err = capsys.readouterr()
    if e.value.code != 2 and available_memory("cpu")[0] > 2**40:
        pytest.skip("this machine holds even that")
    assert e.value.code == 2 and err.out == "" and err.err.count("\n") == 1, err.err
    assert err.err.startswith("verify.memory: error: --effective-batch 65536 (sweep A runs N=1, B=65536): needs about ")
    assert "GiB (MemAvailable); pass a smaller --effective-batch (the adapter's memory model, single, at B=1 and 2, " \
           "linear in B)" in err.err and not out.exists()


def test_the_up_front_estimate_is_the_memory_models_own_prediction():
    """The linear extrapolation from B=1, 2 is what the model predicts at B=E itself (its activations and
    logits are linear in the rows): the refusal is the model's number, not a tuned one."""
    import torch

    from xtrain_proof.adapters import adapter
    from verify.memory.prediction import PeakQuery

    q = lambda Bs: adapter.predicted_peak(PeakQuery(adapter=adapter, options=adapter.defaults,  # noqa: E731
                                                    configs=tuple((1, B) for B in Bs), world=1,
                                                    device=torch.device("cpu"), probe="cuda", trainer_class=None))
    p = q((1, 2, 16)).peaks
    one, two, direct = p[(1, 1)]["bytes"], p[(1, 2)]["bytes"], p[(1, 16)]["bytes"]
    assert abs(one + 15 * (two - one) - direct) <= 0.02 * direct, (one, two, direct)
