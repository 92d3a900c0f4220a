"""The CLI as a user runs it: a subprocess, its stdout/stderr and exit code."""
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "xtrain_core.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_effective_batch_line_and_summary():
    r = train("--accum-steps", "4", "--micro-batch", "2", "--steps", "3", "--seq-len", "16")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "effective batch = 4 × 2 = 8 sequences (128 tokens)"
    assert lines[-1].startswith("done: 3 steps, 384 tokens in ")
    assert "3/3" in r.stderr and "tok/s" in r.stderr  # progress bar


BAD_INPUT = [
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
]


@pytest.fixture(scope="module")
def bad_input_runs():
    """Every row's main(argv) in one subprocess (tests/helpers/cli_batch.py): 20 usage errors, one torch import."""
    from tests.helpers.cli_batch import run_all

    return dict(zip((tuple(a) for a, _ in BAD_INPUT), run_all("xtrain_core.train", [a for a, _ in BAD_INPUT], env=ENV)))


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
@pytest.mark.parametrize("args,needle", BAD_INPUT)
def test_bad_input_is_one_line_exit_2(args, needle, bad_input_runs):
    code, stdout, stderr = bad_input_runs[tuple(args)]
    assert code == 2
    assert stderr.count("\n") == 1 and needle in stderr, stderr
    assert "Traceback" not in stderr and stdout == ""


@pytest.mark.slow  # a launch per row (~3-7 s each on 2 cores): the rows above run the whole table in one process
@pytest.mark.parametrize("args,needle", BAD_INPUT[:3] + BAD_INPUT[7:8])
def test_bad_input_is_one_line_exit_2_in_its_own_process(args, needle):
    r = train(*args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_cuda_without_gpu_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = train("--device", "cuda")
    assert r.returncode == 2 and r.stderr.strip() == (
        "xtrain_core.train: error: --device cuda: no CUDA GPU is visible to torch; use --device cpu")


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_data_file_trains(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 50, encoding="utf-8")
    r = train("--data", str(f), "--accum-steps", "2", "--micro-batch", "2", "--steps", "2", "--seq-len", "32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("effective batch = 2 × 2 = 4 sequences (128 tokens)")


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_short_data_file_is_usage_error(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("hi")
    r = train("--data", str(f), "--seq-len", "32")
    assert r.returncode == 2 and "has 2 bytes; --seq-len 32 needs at least 34" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""  # nothing printed before the error


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
@pytest.mark.parametrize("env_threads,flag,want", [
    (None, [], "cpu: 1 intra-op thread per process"),  # auto: one, whatever the core count
    # the environment's word stands, and so does the flag
    ("2", [], "cpu: 2 intra-op threads per process"),
    (None, ["--threads", "2"], "cpu: 2 intra-op threads per process"),
])
def test_threads_auto_is_one_thread_unless_asked(env_threads, flag, want):
    """torch's default, one spinning OpenMP thread per core, collapsed 4-6x on a 2-core box with two busy
    neighbours (reports/cpu/cpu-threads.md); auto runs one thread (as torchrun does per rank)."""
    env = {k: v for k, v in ENV.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if env_threads:
        env["OMP_NUM_THREADS"] = env_threads
    r = subprocess.run([sys.executable, "-m", "xtrain_core.train", "--accum-steps", "2", "--micro-batch", "1",
                        "--steps", "1", "--seq-len", "8", *flag], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert want in r.stderr, r.stderr


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
def test_a_micro_batch_that_cannot_fit_is_refused_before_anything_allocates():
    """The advertised maximum on the benchmark model: one line with the estimate and the machine's memory
    (it was a 47-line allocator traceback), from a lower bound computed before the model is built."""
    from verify._internal.cli import available_memory
    from xtrain_core.config import PRESETS

    need = PRESETS["gpt2-ish"].step_bytes_at_least(65536, 512)
    if need <= available_memory("cpu")[0]:
        pytest.skip("this machine holds even that")
    r = train("--model", "gpt2-ish", "--micro-batch", "65536")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"xtrain_core.train: error: --micro-batch 65536 of --model gpt2-ish (S=512, fp32): "
                               f"needs at least {need / 2**30:,.1f} GiB, the machine has "), r.stderr
    assert r.stderr.rstrip().endswith("GiB (MemAvailable); pass a smaller --micro-batch (and a larger --accum-steps: "
                                      "the same effective batch)")


def test_the_memory_floor_is_below_what_a_step_holds():
    """step_bytes_at_least never refuses a run that fits: on the tiny and small models it is below the
    parameters' 16 bytes an element plus the tensors one forward saves for backward, as counted by
    verify.memory's probe (saved_tensors_hooks), in fp32 and under bf16 autocast."""
    import torch

    from verify.memory.probes import saved_activation_bytes
    from xtrain_core.config import PRESETS
    from xtrain_core.model import build_model

    for name in ("tiny", "small"):
        cfg = PRESETS[name]
        model = build_model(cfg, 0, device=torch.device("cpu"))
        for B in (1, 3):
            x = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len))
            saved = saved_activation_bytes(model, model.loss_batched, x, x)["saved_bytes"]
            assert cfg.step_bytes_at_least(B, cfg.seq_len) <= 16 * cfg.n_params + saved, (name, B)
            assert cfg.step_bytes_at_least(B, cfg.seq_len, "bf16") < cfg.step_bytes_at_least(B, cfg.seq_len)


def test_check_fits_names_the_estimate_and_the_machine(monkeypatch):
    import _xtrain_cli as _cli

    monkeypatch.setattr(_cli, "available_memory", lambda device: (2 * 2**30, "MemAvailable"))
    _cli.check_fits(2**30, "cpu", "--x 1", "pass less")  # fits: nothing
    with pytest.raises(_cli.UsageError) as e:
        _cli.check_fits(3 * 2**30, "cpu", "--x 3", "pass less", at_least=True)
    assert str(e.value) == "--x 3: needs at least 3.0 GiB, the machine has 2.0 GiB (MemAvailable); pass less"
