"""xtrain's token-weighted loss, mixed precision, skipped windows, partial windows and --docs data."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from xtrain_core.config import ModelConfig, OptimConfig
from xtrain_core.data import DocStream, FullWindows
from xtrain_core.model import IGNORE, build_model
from xtrain_core.trainer import AccumTrainer

CFG = ModelConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _batch(rows, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 32, (rows, 8), generator=g), torch.randint(0, 32, (rows, 8), generator=g)
    for r, n in enumerate(lengths):
        y[r, n:] = IGNORE
    return x, y


def test_token_weighted_window_is_the_token_mean_of_the_whole_batch():
    """Micro-batches of 12, 1 and 0 valid tokens: the boundary gradient is Σ CE over the 13 tokens / 13,
    not the mean of three micro-batch means (which the mean norm computes)."""
    x, y = _batch(6, [8, 4, 1, 0, 0, 0])
    micro = list(zip(x.chunk(3), y.chunk(3)))
    big = build_model(CFG, 0, dtype=torch.float64)
    F.cross_entropy(big(x).reshape(-1, 32), y.reshape(-1), ignore_index=IGNORE).backward()
    want = {k: p.grad for k, p in big.named_parameters()}
    for norm, close in (("tokens", True), ("mean", False)):
        t = AccumTrainer(build_model(CFG, 0, dtype=torch.float64), OptimConfig(max_grad_norm=None), 3, loss_norm=norm)
        for i, (a, b) in enumerate(micro):
            t.micro_step(a, b, i)
        got = t.grads()
        ok = all(torch.allclose(got[k], want[k], rtol=1e-10, atol=1e-12) for k in want)
        assert ok == close, norm
        if norm == "tokens":
            assert math.isclose(float(t.optimizer_step()), float(F.cross_entropy(big(x).detach().reshape(-1, 32), y.reshape(-1),
                                                                                   ignore_index=IGNORE)), rel_tol=1e-12)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("N", [1, 3])
def test_a_window_without_a_valid_token_is_skipped_whole(precision, N):
    t = AccumTrainer(build_model(CFG, 0), OptimConfig(lr=1e-2, warmup_steps=3), N, loss_norm="tokens",
                     precision=precision)
    before = {k: v.clone() for k, v in t.params().items()}
    empty = [_batch(2, [0, 0], seed=i) for i in range(N)]
    loss = t.train_step(empty)
    assert t.last_skipped and t.skipped_steps == 1 and math.isnan(float(loss))
    assert t.sched.last_epoch == 0  # the schedule did not advance
    assert all(torch.equal(before[k], v) for k, v in t.params().items())  # no update, no NaN
    t.train_step([_batch(2, [5, 8], seed=9 + i) for i in range(N)])  # the next window trains normally
    assert not t.last_skipped and t.sched.last_epoch == 1
    assert any(not torch.equal(before[k], v) for k, v in t.params().items())


def test_fp16_unscales_once_per_window_and_steps_the_scaler_once(monkeypatch):
    t = AccumTrainer(build_model(CFG, 0), OptimConfig(), 4, precision="fp16")
    calls = {"unscale_": 0, "step": 0, "update": 0}
    for name in calls:
        orig = getattr(t.scaler, name)

        def spy(*a, _n=name, _o=orig, **k):
            calls[_n] += 1
            return _o(*a, **k)

        monkeypatch.setattr(t.scaler, name, spy)
    for _ in range(2):
        t.train_step([_batch(2, [8, 8], seed=i) for i in range(4)])
    assert calls == {"unscale_": 2, "step": 2, "update": 2}


def test_fp16_grads_are_unscaled_before_clipping_and_reading():
    a = AccumTrainer(build_model(CFG, 0), OptimConfig(), 2, precision="fp16")
    b = AccumTrainer(build_model(CFG, 0), OptimConfig(), 2, precision="bf16")
    for i in range(2):
        x, y = _batch(2, [8, 8], seed=i)
        a.micro_step(x, y, i)
        b.micro_step(x, y, i)
    ga, gb = a.grads(), b.grads()
    for k in gb:  # the same gradient up to 16-bit rounding, not 65536 times it
        assert (ga[k] - gb[k]).norm() <= 0.05 * gb[k].norm() + 1e-6, k


def _pool_run(world, *args):
    from planted.broken_numerics import poisoned_window_job
    from verify._internal.ranks.pool import get_pool

    return get_pool(world).run(poisoned_window_job, *args)


@pytest.mark.distributed
@pytest.mark.parametrize("world,poison_rank", [(1, 0), (2, 1)])
def test_an_inf_in_micro_step_0_skips_the_window_on_every_rank(world, poison_rank):
    """fp16: an inf anywhere in the window — here in micro-step 0, on one rank — skips the whole step on
    every rank: no parameter moves, the schedule does not advance, the scale backs off."""
    for r in _pool_run(world, "xtrain", 3, poison_rank):
        assert r["last_skipped"] and not r["moved"] and r["finite"], r
        assert r["schedule_steps"] == 0 and r["scale_after"] == r["scale_before"] / 2, r


@pytest.mark.distributed
def test_a_trainer_that_sanitizes_non_finite_gradients_steps_the_poisoned_window():
    """The planted bug (nan_to_num per micro-step): the inf of micro-step 0 vanishes and the window is
    stepped — the check above rejects it."""
    (r,) = _pool_run(1, "sanitize", 3, 0)
    assert r["moved"] and not r["last_skipped"] and r["schedule_steps"] == 1, r


def test_a_partial_window_is_never_stepped_short():
    """Data that ends mid-window: FullWindows drops the tail (and counts it); train_step refuses fewer than N."""
    mbs = [_batch(2, [8, 8], seed=i) for i in range(7)]
    w = FullWindows(mbs, 3)
    windows = list(w)
    assert [len(x) for x in windows] == [3, 3] and w.dropped == 1
    t = AccumTrainer(build_model(CFG, 0), OptimConfig(), 3)
    for window in windows:
        t.train_step(window)
    with pytest.raises(ValueError, match="expected 3 micro-batches, got 1"):
        t.train_step(mbs[6:])
    with pytest.raises(RuntimeError, match=r"optimizer_step\(\) before the boundary: ran 1 of 3"):
        t.micro_step(*mbs[6], 0)
        t.optimizer_step()


def test_docs_one_sequence_per_line_padded_and_deterministic(tmp_path):
    f = tmp_path / "docs.txt"
    f.write_text("hello world\nx\n\n   \nsixteen bytes!!!\nabc\n", encoding="utf-8")
    s = DocStream(f, seq_len=8, seed=3)
    assert [d.decode() for d in s.docs] == ["hello world", "x", "sixteen bytes!!!", "abc"]  # blank lines skipped
    x, y = DocStream(f, 8, seed=3).next(8)  # two epochs, each in its own shuffled order
    counts = sorted(int((row != IGNORE).sum()) for row in y[:4])
    assert counts == [0, 2, 8, 8]  # "x" has no target; long documents are truncated to S
    for xr, yr in zip(x, y):
        n = int((yr != IGNORE).sum())
        assert torch.equal(xr[1:n], yr[:n - 1]) if n > 1 else True
        assert bool((xr[n:] == 0).all()) and bool((yr[n:] == IGNORE).all())  # right padding
    a, b = DocStream(f, 8, seed=3), DocStream(f, 8, seed=3)
    parts = [a.next(3) for _ in range(3)]
    whole = b.next(9)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(UnicodeDecodeError):
        DocStream(bad, 8)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "xtrain_core.train", *args], capture_output=True, text=True,
                          timeout=180, env=ENV, cwd=ROOT)


@pytest.mark.slow  # three CLI runs (~5 s)
def test_cli_docs_tokens_and_precision(tmp_path):
    f = tmp_path / "docs.txt"
    f.write_text("\n".join(["the quick brown fox jumps over the lazy dog", "a", "hi there"] * 4) + "\n")
    r = cli("--docs", str(f), "--accum-steps", "3", "--micro-batch", "2", "--steps", "3", "--seq-len", "16",
            "--precision", "bf16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == ("effective batch = 3 × 2 = 6 sequences (up to 96 tokens, padded; loss over "
                                        "valid tokens), bf16 autocast")
    assert r.stdout.splitlines()[-1].startswith("done: 3 steps, ")
    e = tmp_path / "empty-windows.txt"
    e.write_text("a\nb\nc\n")  # one byte each: no valid target anywhere
    r = cli("--docs", str(e), "--accum-steps", "2", "--micro-batch", "1", "--steps", "2", "--seq-len", "8")
    assert r.returncode == 0, r.stderr
    assert "step 0: skipped (no valid token in the window): no update, schedule not advanced" in r.stdout
    assert "done: 2 steps (2 skipped), 0 tokens" in r.stdout and "nan" not in r.stdout.lower()


BAD_NUMERICS = [
    (["--docs", "DOCS", "--loss-norm", "mean"], "--docs pads sequences, and --loss-norm mean weighs every "
                                                "micro-batch alike"),
    (["--docs", "DOCS", "--data", "DOCS"], "--data and --docs: pass one"),
    (["--docs", "/no/such/file"], "--docs /no/such/file: no such file; pass a UTF-8 text file, one document per line"),
    (["--docs", "BINARY"], "not UTF-8 text (byte "),
    (["--docs", "BLANK"], "holds no non-empty line"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--loss-norm", "sum"], "argument --loss-norm: invalid choice: 'sum'"),
]


def _files(folder) -> None:
    for k, v in {"DOCS": "a document\n", "BLANK": "\n  \n"}.items():
        (folder / k).write_text(v)
    (folder / "BINARY").write_bytes(b"\x00\xff\xfe text")


def _argv(folder, args) -> list:
    return [str(folder / a) if a in ("DOCS", "BLANK", "BINARY") else a for a in args]


@pytest.fixture(scope="module")
def bad_numerics_runs(tmp_path_factory):
    """Every row's main(argv) in one subprocess (tests/helpers/cli_batch.py): one torch import for the table."""
    from tests.helpers.cli_batch import run_all

    folder = tmp_path_factory.mktemp("bad-numerics")
    _files(folder)
    rows = [_argv(folder, a) for a, _ in BAD_NUMERICS]
    return dict(zip((tuple(a) for a, _ in BAD_NUMERICS), run_all("xtrain_core.train", rows, env=ENV, cwd=ROOT)))


@pytest.mark.slow  # launches an interpreter (a torch import: 3-7 s on 2 cores): CI, not the dev loop
@pytest.mark.parametrize("args,needle", BAD_NUMERICS)
def test_cli_bad_numerics_input_is_one_line_exit_2(args, needle, bad_numerics_runs):
    code, stdout, stderr = bad_numerics_runs[tuple(args)]
    assert code == 2 and stdout == "" and stderr.count("\n") == 1, stderr
    assert needle in stderr and "Traceback" not in stderr, stderr


@pytest.mark.slow  # a launch per row (~3-7 s each on 2 cores): the rows above run the whole table in one process
@pytest.mark.parametrize("args,needle", BAD_NUMERICS[:1] + BAD_NUMERICS[3:4])
def test_cli_bad_numerics_input_is_one_line_exit_2_in_its_own_process(tmp_path, args, needle):
    _files(tmp_path)
    r = cli(*_argv(tmp_path, args))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
