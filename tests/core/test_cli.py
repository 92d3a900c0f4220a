"""The CLI as a user runs it: a subprocess, its stdout/stderr and exit code."""
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "xtrain_core.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_effective_batch_line_and_summary():
    r = train("--accum-steps", "4", "--micro-batch", "2", "--steps", "3", "--seq-len", "16")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "effective batch = 4 × 2 = 8 sequences (128 tokens)"
    assert lines[-1].startswith("done: 3 steps, 384 tokens in ")
    assert "3/3" in r.stderr and "tok/s" in r.stderr  # progress bar


@pytest.mark.parametrize("args,needle", [
    (["--accum-steps", "0"], "argument --accum-steps: must be ≥ 1, got 0"),
    (["--accum-steps", "-1"], "argument --accum-steps: must be ≥ 1, got -1"),
    (["--accum-steps", "x"], "argument --accum-steps: must be an integer ≥ 1, got 'x'"),
    (["--micro-batch", "0"], "argument --micro-batch: must be ≥ 1, got 0"),
    (["--data", "/no/such/file.txt"], "--data /no/such/file.txt: no such file"),
    (["--seq-len", "65"], "--seq-len 65 exceeds --model tiny's limit of 64"),
    (["--model", "huge"], "argument --model: invalid choice"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:K, got 'tpu'"),
    # sizes a run can never meet: refused before anything allocates, with the limit in the message
    (["--accum-steps", "99999999999999999999"], "argument --accum-steps: must be ≤ 1048576, got 99999999999999999999"),
    (["--micro-batch", "99999999999999999999"], "argument --micro-batch: must be ≤ 65536, got 99999999999999999999"),
    (["--steps", "99999999999999999999"], "argument --steps: must be ≤ 1000000000, got 99999999999999999999"),
    (["--accum-steps", "4096", "--micro-batch", "8192"], "effective batch 4096 × 8192 = 33554432 sequences per step "
                                                          "exceeds 16777216"),
    (["--seed", "99999999999999999999"], "argument --seed: must be ≤ 9223372036854775807, got 99999999999999999999"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0, got -1.0"),
    (["--data", "/dev/null"], "--data /dev/null: not a regular file; pass a UTF-8 text file or omit --data"),
    (["--data", "/tmp"], "--data /tmp: is a directory; pass a UTF-8 text file or omit --data"),
    (["--data", "/bin/ls"], "--data /bin/ls: not UTF-8 text (byte "),
    (["--device", "cuda:7"], "--device cuda:7: "),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = train(*args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_cuda_without_gpu_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = train("--device", "cuda")
    assert r.returncode == 2 and r.stderr.strip() == (
        "xtrain_core.train: error: --device cuda: no CUDA GPU is visible to torch; use --device cpu")


def test_data_file_trains(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 50, encoding="utf-8")
    r = train("--data", str(f), "--accum-steps", "2", "--micro-batch", "2", "--steps", "2", "--seq-len", "32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("effective batch = 2 × 2 = 4 sequences (128 tokens)")


def test_short_data_file_is_usage_error(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("hi")
    r = train("--data", str(f), "--seq-len", "32")
    assert r.returncode == 2 and "has 2 bytes; --seq-len 32 needs at least 34" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""  # nothing printed before the error


@pytest.mark.parametrize("env_threads,flag,want", [
    (None, [], "cpu: 1 intra-op thread per process"),  # auto: one, whatever the core count
    # the environment's word stands, and so does the flag (slow: a subprocess each; CI runs them)
    pytest.param("2", [], "cpu: 2 intra-op threads per process", marks=pytest.mark.slow),
    pytest.param(None, ["--threads", "2"], "cpu: 2 intra-op threads per process", marks=pytest.mark.slow),
])
def test_threads_auto_is_one_thread_unless_asked(env_threads, flag, want):
    """torch's default, one spinning OpenMP thread per core, collapsed 4-6x on a 2-core box with two busy
    neighbours (docs/performance.md §7); auto runs one thread (as torchrun does per rank)."""
    env = {k: v for k, v in ENV.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if env_threads:
        env["OMP_NUM_THREADS"] = env_threads
    r = subprocess.run([sys.executable, "-m", "xtrain_core.train", "--accum-steps", "2", "--micro-batch", "1",
                        "--steps", "1", "--seq-len", "8", *flag], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert want in r.stderr, r.stderr
