"""The GPU CI gate's one command, on the CPU box: what it would run for 1 and 2 GPUs, its refusal without
a GPU, its summary; and the workflows, linted by actionlint."""
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tools import gpu_gate as repo_gate
from verify import gpu_gate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = repo_gate.repo_steps  # this checkout's steps, added by tools/gpu_gate.py


def _names(steps):
    return [s[0] for s in steps]


def test_the_plan_follows_the_gpus(tmp_path):
    args = SimpleNamespace(profile="gpu", max_world=4, no_memory=False, trainer=None)
    one = gpu_gate.plan(1, str(tmp_path), args, extra=REPO)
    assert _names(one) == ["gates", "memory", "gpu-tests"]
    gates = one[0][1]
    assert "--verify-device" in gates and "cuda" in gates and one[0][2]["HYPOTHESIS_PROFILE"] == "gpu"
    two = gpu_gate.plan(2, str(tmp_path), args, extra=REPO)
    assert _names(two) == ["gates", "memory", "nccl", "gpu-tests", "nccl-tests"]
    name, cmd, env = two[2]
    assert "--verify-backend" in cmd and "nccl" in cmd and env["XTRAIN_DIST_MAX_WORLD"] == "2"
    name, cmd, env = two[-1]
    assert "tests/core/test_fsdp.py" in cmd and "tests/harness/test_ddp_modes.py" in cmd and env["XTRAIN_DIST_MAX_WORLD"] == "2"
    installed = gpu_gate.plan(8, str(tmp_path), SimpleNamespace(profile="ci", max_world=4, no_memory=True))
    assert _names(installed) == ["gates", "nccl"] and "--pyargs" in installed[0][1]
    assert not any("tests" in " ".join(cmd) for _, cmd, _ in installed)  # the shipped gate runs only what ships
    assert installed[-1][2]["XTRAIN_DIST_MAX_WORLD"] == "4"


def test_a_bare_tree_loads_the_plugin_by_hand_and_an_installed_one_does_not(tmp_path, monkeypatch):
    # A checkout copied to a GPU box without `pip install` has no pytest11 entry point: the gates' options
    # (--verify-device, ...) would be unknown unless the plugin is named with -p; naming it when it is also
    # registered would load it twice.
    import importlib.metadata as md

    args = SimpleNamespace(profile="gpu", max_world=4, no_memory=True, trainer=None)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [])
    assert all("_xtrain_pytest.entry" in cmd for _, cmd, _ in gpu_gate.plan(2, str(tmp_path), args, extra=REPO)
               if "pytest" in cmd)
    ep = SimpleNamespace(value="_xtrain_pytest.entry")
    monkeypatch.setattr(md, "entry_points", lambda group=None: [ep])
    assert not any("_xtrain_pytest.entry" in cmd for _, cmd, _ in gpu_gate.plan(2, str(tmp_path), args, extra=REPO))


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_without_a_gpu_it_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "verify.gpu_gate", "--out", str(tmp_path / "out")], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("verify.gpu_gate: error: no CUDA GPU is visible to torch") and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_summary_names_each_step_and_fails_when_one_does(tmp_path):
    doc = dict(machine_info=dict(gpu_count=2, gpu="NVIDIA H200", torch="2.11", cuda="13.0", nccl="2.28", driver="580"),
               git_commit="abc", utc="now", out=str(tmp_path),
               steps=[dict(step="gates", returncode=0, seconds=40.2, last_line="300 passed", gpu_peak_gib=31.26),
                      dict(step="nccl", returncode=1, seconds=90, last_line="1 failed, 30 passed")])
    md = gpu_gate.summary_md(doc)
    assert md.startswith("## verify GPU gate: FAILED") and "| nccl | FAILED (1) | 90 | — | 1 failed, 30 passed |" in md
    assert "| gates | passed | 40 | 31.3 | 300 passed |" in md


def test_workflows_pass_actionlint():
    exe = shutil.which("actionlint")
    if exe is None:
        pytest.skip("actionlint is not installed (the [test] extra brings it)")
    flows = [os.path.join(ROOT, ".github", "workflows", f) for f in ("ci.yml", "gpu.yml")]
    r = subprocess.run([exe, *flows], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(flows[0]) as f:  # the CPU workflow runs exactly the README's test command (through .ci/run)
        assert "run: bash .ci/run" in f.read()
    with open(flows[1]) as f:
        gpu = f.read()
    assert "runs-on: [self-hosted, linux, gpu]" in gpu and "python3 tools/gpu_gate.py --out gpu-reports" in gpu
    assert "GITHUB_STEP_SUMMARY" in gpu and "upload-artifact" in gpu


def test_actionlint_can_fail(tmp_path):
    exe = shutil.which("actionlint")
    if exe is None:
        pytest.skip("actionlint is not installed")
    bad = tmp_path / "bad.yml"
    bad.write_text("name: x\non: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ github.nosuch }}\n")
    r = subprocess.run([exe, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "nosuch" in r.stdout + r.stderr


def test_the_tools_default_outputs_are_ignored_so_a_run_never_dirties_the_references():
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    for path in ("reports/memory-E32.json", "reports/memory-E32.png", "reports/verify-report.md",
                 "reports/bench-single.json", "reports/bench_dist_pools_gloo.json"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert r.returncode == 0, f"{path} would be tracked: a user's run would dirty the repo"
    r = subprocess.run(["git", "check-ignore", "-q", "reports/cpu/memory-E32.json"], cwd=ROOT)
    assert r.returncode == 1  # the committed references are not ignored


# -- under torchrun: rank 0 runs its node's steps, then every rank joins the launched world (verify.run) ----------

LAUNCH = dict(launcher="torchrun", nodes=2, ranks_per_node=4, world=8, backend="nccl", rendezvous="c10d",
              endpoint="node0:29500")


def test_the_plan_under_torchrun_ends_with_the_launched_world(tmp_path):
    args = SimpleNamespace(profile="gpu", max_world=4, no_memory=True, trainer=None)
    steps = gpu_gate.plan(4, str(tmp_path), args, LAUNCH, extra=REPO)
    assert _names(steps) == ["gates", "nccl", "gpu-tests", "nccl-tests", "launched"]  # the box's pools first
    name, cmd, env = steps[-1]
    assert cmd[1:3] == ["-m", "verify.run"] and env["HYPOTHESIS_PROFILE"] == "gpu"
    assert " -m distributed --verify-backend nccl --verify-device cuda " in " ".join(cmd)
    assert "XTRAIN_DIST_MAX_WORLD" not in env  # the launched world is the world
    gloo = gpu_gate.plan(1, str(tmp_path), args, {**LAUNCH, "backend": "gloo"}, extra=REPO)
    assert _names(gloo) == ["gates", "gpu-tests", "launched"]
    assert "--verify-backend gloo --verify-device cpu" in " ".join(gloo[-1][1])  # gloo ranks run on the CPU


def test_a_users_trainer_goes_to_every_gate_step_and_xtrains_own_steps_drop_out(tmp_path):
    args = SimpleNamespace(profile="gpu", max_world=4, no_memory=False, trainer="mypkg.train:factory")
    steps = gpu_gate.plan(2, str(tmp_path), args, LAUNCH, extra=REPO)
    assert _names(steps) == ["gates", "nccl", "launched"]
    for _, cmd, _ in steps:
        assert "--verify-trainer mypkg.train:factory" in " ".join(cmd) and "tests/core/test_fsdp.py" not in cmd
    assert "--pyargs" in steps[0][1]  # verify's gate tests, from the user's directory


def test_a_bad_trainer_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_gate, "_cuda_available", lambda: True)
    with pytest.raises(SystemExit) as e:
        gpu_gate.main(["--out", str(tmp_path / "out"), "--trainer", "no_such_module:factory"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("verify.gpu_gate: error: --trainer no_such_module:factory: cannot import 'no_such_module'")


class _Store:
    """torchrun's store, as pool_launched.connect() returns it: what the gate uses of it."""

    def __init__(self):
        self.keys, self.log = {}, []

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def set(self, key, value):
        self.log.append(("set", key))
        self.keys[key] = value


def _launched(monkeypatch, rank: int):
    from verify._internal.ranks import launched as pool_launched

    for k, v in dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="localhost", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    store = _Store()
    monkeypatch.setattr(pool_launched, "connect", lambda timeout: store)
    monkeypatch.setattr(gpu_gate, "_cuda_available", lambda: True)

    def run(cmd, **kw):  # every step's subprocess: logged where it happens, between the store's events
        store.log.append(("run", cmd[cmd.index("-m") + 1] if "-m" in cmd else cmd[0]))
        launched = "verify.run" in cmd
        assert all((k in kw["env"]) == launched for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")), cmd  # a
        # node's own steps are not launched ranks
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(gpu_gate.subprocess, "run", run)
    return store


def test_a_launched_rank_waits_for_rank_0_then_joins_the_launched_world(tmp_path, monkeypatch):
    import threading

    store = _launched(monkeypatch, rank=1)
    threading.Timer(0.2, store.set, (gpu_gate.GO, "1")).start()  # rank 0 done with its node's steps
    assert gpu_gate.main(["--out", str(tmp_path / "out"), "--backend", "gloo"]) == 0
    assert store.log == [("set", gpu_gate.GO), ("run", "verify.run")]  # nothing before rank 0's go
    assert not (tmp_path / "out").exists()  # rank 0 writes the report


def test_rank_0_runs_its_steps_then_the_launched_world_and_records_the_launch(tmp_path, monkeypatch):
    import json

    from verify._internal import header as _meta

    store = _launched(monkeypatch, rank=0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(_meta, "header", lambda kind, device=None: dict(kind=kind, machine_info={}, utc="now"))
    out = tmp_path / "out"
    assert gpu_gate.main(["--out", str(out), "--backend", "gloo", "--no-memory"], extra=REPO) == 0
    assert store.log == [("run", "pytest"), ("run", "pytest"), ("set", gpu_gate.GO), ("run", "verify.run")]
    doc = json.loads((out / "gpu-gate.json").read_text())
    assert [s["step"] for s in doc["steps"]] == ["gates", "gpu-tests", "launched"] and doc["passed"]
    assert (doc["launch"]["world"], doc["launch"]["ranks_per_node"], doc["launch"]["backend"]) == (2, 2, "gloo")
    assert "launched: torchrun, 1 node(s) × 2 = world 2, gloo, rendezvous" in (out / "summary.md").read_text()


def test_scale_plans_first_then_three_gates_in_one_process_then_the_memory_probe(tmp_path):
    args = SimpleNamespace(profile="gpu", max_world=4, no_memory=False, trainer="examples.llama_scale:billion", scale=True)
    steps = gpu_gate.plan(8, str(tmp_path), args, extra=REPO)  # however many GPUs: one, and no repository steps
    assert _names(steps) == ["plan", "gates", "memory"]
    (_, plan, _), (_, gates, env), (_, memory, _) = steps
    assert plan[2:5] == ["verify._internal.scaleplan", "examples.llama_scale:billion", "cuda:0"]
    assert gates[gates.index("-k") + 1] == gpu_gate.SCALE_GATES and "no:xdist" in gates and "-n" not in gates
    assert env["HYPOTHESIS_PROFILE"] == "scale" and "--trainer" in memory and "cuda:0" in memory
    # the probe at an effective batch a checkpointed row's activations show at, five runs (the sweeps' ends)
    assert " ".join(memory).endswith("--effective-batch 512 --sweep ends --steps 1 --device cuda:0 --out "
                                      f"{tmp_path}/memory"), memory
    wider = gpu_gate.plan(1, str(tmp_path), gpu_gate.parse_args(["--scale", "--trainer", "m:f", "--effective-batch", "64"]))
    assert wider[-1][1][wider[-1][1].index("--effective-batch") + 1] == "64"


def test_scale_without_a_trainer_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_gate, "_cuda_available", lambda: True)
    with pytest.raises(SystemExit) as e:
        gpu_gate.main(["--out", str(tmp_path / "out"), "--scale"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--scale needs --trainer MODULE:FACTORY" in err, err


def test_a_scale_plan_that_cannot_fit_runs_nothing_else_and_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_gate, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100")
    ran = []

    def run(cmd, stdout=None, **kw):  # the plan step refuses, as scaleplan.main does
        ran.append(cmd[2])
        stdout.write("verify.scaleplan: error: the scale plan does not fit: 4.40B parameters: ...\n")
        return SimpleNamespace(returncode=2)

    monkeypatch.setattr(gpu_gate.subprocess, "run", run)
    with pytest.raises(SystemExit) as e:
        gpu_gate.main(["--out", str(tmp_path / "out"), "--scale", "--trainer", "examples.llama_scale:factory"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and ran == ["verify._internal.scaleplan"], ran
    assert err == "verify.gpu_gate: error: the scale plan does not fit: 4.40B parameters: ...", err
    assert not (tmp_path / "out" / "gpu-gate.json").exists()


def test_the_plan_refuses_past_the_device_and_names_the_largest_size_that_fits():
    from verify._internal.scaleplan import HEADROOM, MAX_ROWS, Plan

    # 1.1B in float64 with Adam: ~35 GiB of state; 0.09 GiB a row: 224 rows ~ 20 GiB; an 80 GiB card fits it
    fits = Plan(parameters=1_100_000_000, state_gib=35.2, per_row_gib=0.09, fixed_gib=1.0, rows=MAX_ROWS,
                need_gib=round(35.2 + 1.0 + MAX_ROWS * 0.09, 1), total_gib=79.1)
    assert fits.fits and fits.largest_rows() >= MAX_ROWS
    big = Plan(parameters=4_400_000_000, state_gib=140.8, per_row_gib=0.3, fixed_gib=2.0, rows=MAX_ROWS,
               need_gib=round(140.8 + 2.0 + MAX_ROWS * 0.3, 1), total_gib=79.1)
    assert not big.fits and big.largest_rows() == 0
    assert big.largest_parameters() == pytest.approx(4_400_000_000 * HEADROOM * 79.1 / big.need_gib, rel=1e-9)
    line = big.refusal()
    assert line.startswith("the scale plan does not fit in GPU memory: 4.40B parameters") and "\n" not in line
    host = Plan(parameters=1_100_000_000, state_gib=35.2, per_row_gib=0.09, fixed_gib=1.0, rows=MAX_ROWS,
                need_gib=41.2, total_gib=139.8, host_need_gib=131.1, host_total_gib=125.8)
    assert not host.fits and host.refusal().startswith("the scale plan does not fit in host memory: 1.10B")
    assert f"~{host.largest_parameters() / 1e9:.2f}B parameters" in host.refusal()
    assert host.largest_parameters() == pytest.approx(1.1e9 * 0.8 * 125.8 / 131.1, rel=1e-6)
    assert f"~{big.largest_parameters() / 1e9:.2f}B parameters" in line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_probe_measures_state_and_rows_on_the_device():
    from examples import llama_scale
    from verify._internal.scaleplan import probe

    plan = probe(llama_scale.factory, "cuda:0")
    params = llama_scale.SIZES["tiny"].parameters
    assert plan.parameters == params and plan.state_gib * 2**30 >= 4 * 8 * params * 0.99 and plan.fits


def test_plan_only_runs_the_scale_plan_alone_and_needs_scale(tmp_path, monkeypatch, capsys):
    args = SimpleNamespace(profile="gpu", max_world=4, no_memory=False, trainer="examples.llama_scale:half",
                           scale=True, plan_only=True)
    assert _names(gpu_gate.plan(1, str(tmp_path), args, extra=REPO)) == ["plan"]
    monkeypatch.setattr(gpu_gate, "_cuda_available", lambda: True)
    with pytest.raises(SystemExit) as e:
        gpu_gate.main(["--out", str(tmp_path / "out"), "--plan-only", "--trainer", "examples.llama_scale:half"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--plan-only is --scale's: add --scale" in err, err
