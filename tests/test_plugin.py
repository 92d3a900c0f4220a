"""The pytest plugin as a user meets it: `pytest --pyargs verify --verify-trainer ...` from their own
directory. Bad values are one-line usage errors naming the option, with nothing written; the run
report lands in ./reports of the invoking directory (or --verify-report), once, from the controller."""
import json
import os
import subprocess
import sys

import pytest
from hypothesis import settings


pytestmark = pytest.mark.slow  # subprocesses end to end: deselect with -m 'not slow' for fast feedback
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1"}
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


@pytest.mark.parametrize("args,needle", [
    (["--verify-backend", "mpi"], "argument --verify-backend: invalid choice: 'mpi'"),
    (["--verify-device", "tpu"], "argument --verify-device: invalid choice: 'tpu'"),
])
def test_bad_backend_or_device(tmp_path, args, needle):
    r = pytest_verify(tmp_path, *args)
    assert r.returncode == 4 and needle in r.stderr and list(tmp_path.iterdir()) == [], r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu(tmp_path):
    r = pytest_verify(tmp_path, "--verify-device", "cuda")
    assert r.returncode == 4 and "ERROR: --verify-device cuda: no CUDA GPU is visible to torch; use --verify-device cpu" \
        in r.stdout + r.stderr and list(tmp_path.iterdir()) == []


def _report(folder) -> dict:
    return json.loads((folder / "verify-report.json").read_text())


def test_a_non_gpt_trainer_through_the_plugin_writes_the_report_where_invoked(tmp_path):
    """Serial and under xdist: the same examples counted once each, one report in ./reports."""
    serial = pytest_verify(tmp_path, "--verify-trainer", "examples.mlp_regressor:factory")
    assert serial.returncode == 0, serial.stdout[-3000:]
    one = _report(tmp_path / "reports")
    assert one["trainer"] == "examples.mlp_regressor:factory" and one["exitstatus"] == 0 and one["failures"] == []
    assert one["schema_version"] == 1 and one["utc"] and "torch" in one["machine_info"]
    assert oct((tmp_path / "reports" / "verify-report.json").stat().st_mode & 0o777) == "0o644"
    g = one["gates"]
    assert g["equivalence"]["examples"] >= DEV and 0 < g["equivalence"]["worst_ratio"] < 1  # + the long-N ones
    assert g["equivalence"]["worst_case"]["data_seed"] is not None and g["bit_exact"]["examples"] == DEV
    assert "does not declare data parallelism" in g["boundary_only"]["skip_reason"]
    md = (tmp_path / "reports" / "verify-report.md").read_text()
    assert f"| equivalence | {g['equivalence']['examples']} |" in md and "every gate that ran passed" in md
    other = tmp_path / "elsewhere"
    par = pytest_verify(tmp_path, "--verify-trainer", "examples.mlp_regressor:factory", "-n", "2",
                        "--verify-report", str(other))
    assert par.returncode == 0, par.stdout[-3000:]
    two = _report(other)
    assert {k: v["examples"] for k, v in two["gates"].items()} == {k: v["examples"] for k, v in g.items()}


def test_a_broken_trainer_fails_and_the_report_says_where(tmp_path):
    r = pytest_verify(tmp_path, "--verify-trainer", "verify.adapters.broken:missing_1_over_N", "-k", "big_batch")
    assert r.returncode == 1, r.stdout[-3000:]
    assert "[equivalence] gradient (step 0) of" in r.stdout and "accumulation error" in r.stdout
    rep = _report(tmp_path / "reports")
    (f,) = rep["failures"]
    assert f["test"].endswith("test_accumulation_equals_big_batch") and "[equivalence]" in f["message"]
    assert "FAILED: 1 gate test(s)" in (tmp_path / "reports" / "verify-report.md").read_text()
