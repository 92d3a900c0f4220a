"""The pytest plugin as a user meets it: `pytest --pyargs verify --verify-trainer ...` from their own
directory. Bad values are one-line usage errors naming the option, with nothing written; the run
report lands in ./reports of the invoking directory (or --verify-report), once, from the controller."""
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import settings

from verify import Gate
from verify._internal.gates.table import gate_budget


pytestmark = pytest.mark.slow  # subprocesses end to end: deselect with -m 'not slow' for fast feedback
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# CI unset: pytest prints the short summary untrimmed on CI; these runs must show the verdict whole anyway.
ENV = {**{k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER", "COLUMNS")},
       "PYTHONPATH": ROOT, "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1"}
DEV = settings.get_profile("dev").max_examples  # the examples a gate draws in the runs below


def pytest_verify(tmp_path, *args, timeout=600):
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=timeout)


@pytest.mark.parametrize("ref,needle", [
    ("nosuch.mod:f", "cannot import 'nosuch.mod'"),
    ("examples.mlp_regressor:nope", "module 'examples.mlp_regressor' has no attribute 'nope'"),
    ("math:pi", "'pi' is a float, not callable"),
    ("operator:add", "add(a, b, /) must take exactly one argument (a verify.Spec)"),
    ("json:dumps", "'dumps' is a plain function; declare its data with @verify.adapter(data=...)"),
    ("noColon", "expected MODULE:FACTORY"),
])
def test_bad_trainer_is_a_one_line_usage_error(tmp_path, ref, needle):
    r = pytest_verify(tmp_path, "--verify-trainer", ref)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's exit status for usage errors
    assert lines == [f"ERROR: --verify-trainer {ref}: " + lines[0].split(f"{ref}: ", 1)[1]] and needle in lines[0], lines
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu(tmp_path):
    r = pytest_verify(tmp_path, "--verify-device", "cuda")
    assert r.returncode == 4 and "ERROR: --verify-device cuda: no CUDA GPU is visible to torch; use --verify-device cpu" \
        in r.stdout + r.stderr and list(tmp_path.iterdir()) == []


def _report(folder) -> dict:
    return json.loads((folder / "verify-report.json").read_text())


def test_a_non_gpt_trainer_through_the_plugin_writes_the_report_where_invoked(tmp_path):
    """Serial from an empty directory, with pytest's own cache on: one report in ./reports and nothing else there
    (hypothesis' database and pytest's cache go to $XDG_CACHE_HOME/xtrain-verify). Then under xdist: the same
    examples counted once each."""
    here, cache = tmp_path / "user", tmp_path / "cache"
    here.mkdir()
    serial = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "verify", "-q", "--verify-trainer",
                             "examples.mlp_regressor:factory"], capture_output=True, text=True, cwd=here, timeout=600,
                            env={**ENV, "XDG_CACHE_HOME": str(cache), "PYTHONDONTWRITEBYTECODE": "1"})
    assert serial.returncode == 0, serial.stdout[-3000:]
    assert sorted(os.listdir(here)) == ["reports"], os.listdir(here)
    # + pytest-benchmark's storage where that plugin is installed (it makes ./.benchmarks otherwise)
    # hypothesis' folder appears once it has something to keep (a failure; a passing run may leave none)
    assert {"pytest"} <= set(os.listdir(cache / "xtrain-verify")) <= {"benchmarks", "hypothesis", "pytest"}
    one = _report(here / "reports")
    assert one["trainer"] == "examples.mlp_regressor:factory" and one["exitstatus"] == 0 and one["failures"] == []
    assert one["schema_version"] == 1 and one["utc"] and "torch" in one["machine_info"]
    assert oct((here / "reports" / "verify-report.json").stat().st_mode & 0o777) == "0o644"
    g = one["gates"]
    assert g["equivalence"]["examples"] >= DEV and 0 < g["equivalence"]["worst_ratio"] < 1  # + the long-N ones
    assert g["equivalence"]["worst_case"]["data_seed"] is not None and g["bit-exact"]["examples"] == DEV
    assert "does not declare data parallelism" in g["boundary-only"]["skip_reason"]
    md = (here / "reports" / "verify-report.md").read_text()
    assert f"| equivalence | {g['equivalence']['examples']} |" in md and "every gate that ran passed" in md
    assert "not a git checkout" in md and "commit `None`" not in md  # tmp_path is no git repository
    skipped = serial.stdout.split("verify: not checked", 1)[1]  # on the terminal too, with the reason
    assert "boundary-only: examples.mlp_regressor.Trainer does not declare data parallelism" in skipped
    # every gate that ran is counted (issue 42: the long window's passes went to equivalence's row, and the summary
    # said it did not run); the data-parallel gates each say why they did not
    assert g["long window"]["examples"] >= gate_budget(Gate.LONG_WINDOW, DEV) and "long window:" not in skipped
    assert "data-parallel equivalence: examples.mlp_regressor.Trainer does not declare data parallelism" in skipped
    assert "verify: checked 4 of 15 gates and 5 of 6 metrics" in skipped  # equivalence, bit-exact, long window, metrics
    other = tmp_path / "elsewhere"
    par = pytest_verify(tmp_path, "--verify-trainer", "examples.mlp_regressor:factory", "-n", "2",
                        "--verify-report", str(other))
    assert par.returncode == 0, par.stdout[-3000:]
    two = _report(other)
    assert {k: v["examples"] for k, v in two["gates"].items()} == {k: v["examples"] for k, v in g.items()}
    assert "verify: checked 4 of 15 gates and 5 of 6 metrics" in par.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_broken_trainer_fails_with_its_verdict_first_and_whole(tmp_path, workers):
    r = pytest_verify(tmp_path, "--verify-trainer", "planted.broken:missing_1_over_N", "-k", "big_batch",
                      *workers)
    assert r.returncode == 1, r.stdout[-3000:]
    rep = _report(tmp_path / "reports")
    (f,) = rep["failures"]
    verdict = f["message"]
    assert f["test"].endswith("test_accumulation_equals_big_batch") and verdict.startswith("[equivalence] gradient (step 0) of")
    assert f["gate"] == "equivalence"  # GateFailure.gate, across xdist too: nothing reads the gate from the text
    assert "accumulation error" in verdict and "; case N=" in verdict and "\n" not in verdict
    # the hard corner N=3 is drawn first and fails first (explicit examples are not shrunk): error 2 = N − 1
    assert re.match(r"error ≈ \d+ = N − 1", f["hint"]) and "missing 1/N" in f["hint"] and "re-run" in f["hint"]
    # the short summary: the whole verdict after the test id (pytest would trim it to 80 columns here)
    assert f"FAILED test_gates.py::test_accumulation_equals_big_batch - {verdict}" in r.stdout.splitlines(), r.stdout
    body = r.stdout.split("_ test_accumulation_equals_big_batch _", 1)[1]
    first = [ln for ln in body.splitlines() if ln.strip() and not ln.startswith("[gw")][1]
    assert first == verdict, body[:2000]  # the verdict is the first line of the failure, its hint the next
    # what this project prints (hypothesis' own notes follow, in whatever words its release uses)
    assert f"hint: {f['hint']}" in body and "--full-trace shows them" in body
    assert "tolerance.py" not in body and "Traceback" not in r.stdout  # the harness's frames are hidden
    md = (tmp_path / "reports" / "verify-report.md").read_text()
    assert "FAILED: 1 gate test(s)" in md and f"hint: {f['hint']}" in md


def test_every_run_names_the_releases_it_resolved(tmp_path):
    """A fresh machine gets the newest releases pyproject allows: the run's header says which (so does the report's
    header, verify._internal.header.header), with the version of each dependency that is installed here."""
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "verify.test_gates", "--co", "-p", "no:cacheprovider"],
                       capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("verify: xtrain-verify ")]
    for dist in ("torch", "hypothesis", "pytest", "pytest-xdist", "numpy"):
        assert f"{dist} {version(dist)}" in line, line


def _row_length(case) -> int:
    return case["options"]["seq_len"]


def test_dev_profile_draws_at_least_3_examples_per_gate_with_padded_split_windows(tmp_path):
    """The fast loop exercises every gate: under the dev profile each gate that runs draws ≥ 3 cases
    (GATE_MIN_EXAMPLES), and split invariance gets windows with a split (N ≥ 2) and some padding."""
    from verify._internal.cases.strategies import GATE_MIN_EXAMPLES

    # serial: the examples drawn do not depend on xdist (its report merging is the test above's), and two workers
    # would each start their own rank pools
    r = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "verify", "-p", "no:cacheprovider", "-q", "-p", "no:xdist",
                        "--verify-trainer", "xtrain_proof.adapters:tokens_adapter"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=900, env={**ENV, "XTRAIN_DIST_MAX_WORLD": "1"})  # world 1: the counts, not the ranks
    assert r.returncode == 0, r.stdout[-3000:]
    gates, ran = _report(tmp_path / "reports")["gates"], {}
    for key, g in gates.items():  # equivalence@bf16 ...: a gate's examples over every precision drawn
        ran[key.split("@")[0]] = ran.get(key.split("@")[0], 0) + g["examples"]
    assert GATE_MIN_EXAMPLES == 3 and {"equivalence", "bit-exact", "boundary-only", "split invariance",
                                       "partial sums"} <= {k for k, n in ran.items() if n}
    assert min(n for n in ran.values() if n) >= GATE_MIN_EXAMPLES, ran
    for key, g in gates.items():
        if key.startswith("split invariance"):
            case = g["worst_case"]
            assert case["accum_steps"] >= 2 and min(case["lengths"][:case["world"] * case["micro_batch"]]) < \
                _row_length(case), case  # micro-batch 0 of the window is padded


def test_a_trainer_that_raises_shows_its_own_frame_and_its_error_whole(tmp_path):
    r = pytest_verify(tmp_path, "--verify-trainer", "tests.helpers.raising_adapter:adapter", "-k", "big_batch")
    assert r.returncode == 1, r.stdout[-3000:]
    line = "RuntimeError: this trainer cannot take accum_steps=3: a bug in the user's own micro_step"
    assert f"FAILED test_gates.py::test_accumulation_equals_big_batch - {line}" in r.stdout.splitlines(), r.stdout
    body = r.stdout.split("_ test_accumulation_equals_big_batch _", 1)[1]
    assert "raising_adapter.py" in body and "verify/_internal/cases/case.py" not in body and "hypothesis/" not in body, body[:3000]
    assert _report(tmp_path / "reports")["failures"][0]["message"] == line
