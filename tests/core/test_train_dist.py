"""The CLI under torchrun (gloo, world 2): the effective-batch line, rank-0-only output, the same losses
as one process on the same effective batch, and bad input as one line + exit 2 on every rank."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--accum-steps", "2", "--micro-batch", "2", "--steps", "3", "--seq-len", "16"]


def torchrun(*args, world=2, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "xtrain_core.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def single(*args, env=ENV):
    return subprocess.run([sys.executable, "-m", "xtrain_core.train", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


@pytest.mark.parametrize("impl", ["xtrain", "torch"])
def test_torchrun_world2_matches_one_process(impl):
    r = torchrun(*ARGS, "--ddp-impl", impl)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "effective batch = 2 × 2 × 2 = 8 sequences (128 tokens)", r.stdout
    assert len(lines) == 2 and lines[1].startswith("done: 3 steps, 384 tokens in "), r.stdout  # rank 0 only
    # the same 8 sequences per step in one process (N=2 micro-steps of B=4): the same loss trajectory
    s = single("--accum-steps", "2", "--micro-batch", "4", "--steps", "3", "--seq-len", "16")
    assert s.returncode == 0, s.stderr
    assert lines[1].split("loss ")[-1] == s.stdout.splitlines()[-1].split("loss ")[-1], (r.stdout, s.stdout)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("args,needle", [
    (["--accum-steps", "0"], "argument --accum-steps: must be ≥ 1, got 0"),
    (["--device", "cuda:1"], "--device cuda:1: under torchrun each rank uses cuda:LOCAL_RANK; pass --device cuda"),
], ids=["accum0", "device-index"])
def test_bad_input_on_every_rank_is_one_line_exit_2(rank, args, needle):
    """Each rank (as torchrun starts it: RANK/WORLD_SIZE/LOCAL_RANK) validates before any process group
    exists, prints one line and exits 2: no rank waits for another, no traceback."""
    env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    r = single(*args, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_two_nodes_through_torchrun_rendezvous():
    """Multi-node as torchrun does it (c10d rendezvous, one process per 'node', both on this host):
    the same losses as one node of two processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=xtrain-test", "-m", "xtrain_core.train", *ARGS]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
             for _ in range(2)]
    outs = [n.communicate(timeout=180) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    printed = [o[0] for o in outs if o[0]]
    assert len(printed) == 1, outs  # rank 0 only, on whichever node got it
    lines = printed[0].splitlines()
    assert lines[0] == "effective batch = 2 × 2 × 2 = 8 sequences (128 tokens)"
    s = single("--accum-steps", "2", "--micro-batch", "4", "--steps", "3", "--seq-len", "16")  # one process, B=4
    assert lines[1].split("loss ")[-1] == s.stdout.splitlines()[-1].split("loss ")[-1], (lines, s.stdout)


def test_torchrun_docs_token_weighted_matches_one_process(tmp_path):
    """Padded documents, --loss-norm tokens (the --docs default): world 2 × N=2 × B=2 prints the losses of
    one process with N=2 × B=4 — the global token count rides in the boundary all-reduce."""
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(["gradient accumulation", "a", "token weighted means over valid tokens only",
                               "xy", "padded"] * 3) + "\n")
    args = ["--docs", str(docs), "--steps", "3", "--seq-len", "16", "--accum-steps", "2"]
    r = torchrun(*args, "--micro-batch", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    s = single(*args, "--micro-batch", "4")
    assert s.returncode == 0, s.stderr
    last = lambda out: out.splitlines()[-1].split("loss ")[-1]  # noqa: E731
    assert last(r.stdout) == last(s.stdout), (r.stdout, s.stdout)


def test_torchrun_fsdp2_matches_one_process():
    """FSDP2 (--ddp-impl fsdp2), world 2 × N=2 × B=2: the final loss of one process on batches of 8."""
    r = torchrun("--ddp-impl", "fsdp2", "--accum-steps", "2", "--micro-batch", "2", "--steps", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    s = single("--accum-steps", "1", "--micro-batch", "8", "--steps", "3")
    assert s.returncode == 0, s.stderr
    got, want = (float(out.splitlines()[-1].split("-> ")[-1]) for out in (r.stdout, s.stdout))
    assert abs(got - want) <= 1e-3 * abs(want), (r.stdout, s.stdout)


def test_fsdp2_with_fp16_is_refused_before_any_group_exists():
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    r = single("--ddp-impl", "fsdp2", "--precision", "fp16", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--ddp-impl fsdp2 --precision fp16: not offered" in r.stderr


def test_a_dropped_dist_trainer_frees_its_memory_without_the_cyclic_gc(tmp_path):
    """A trainer a user drops (a sweep building one per trial) must free its AdamW state at once: its gradient hooks live on the model's parameters, and a strong reference from them back to
    the trainer made a cycle only gc.collect() frees — on 2×H200 each dropped trainer kept 4 × params of
    GPU memory alive through the next configurations of a memory sweep."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from xtrain_core.config import ModelConfig, OptimConfig
    from xtrain_core.distributed import DistAccumTrainer
    from xtrain_core.model import build_model

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    model = build_model(ModelConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8), 0)
    x = torch.randint(0, 16, (2, 8))

    def train_one_step():
        trainer = DistAccumTrainer(model, OptimConfig(), 2)
        for micro in range(2):
            trainer.micro_step(x, x, micro)
        trainer.optimizer_step()
        return trainer

    # The first trainer of a process pulls in torch's lazy imports, whose caught exceptions leave frames
    # (holding the trainer under construction) in garbage cycles of their own: not the trainer's doing.
    train_one_step()
    gc.collect()
    gc.disable()
    try:
        trainer = train_one_step()
        # (the flat buffer itself lives on as the model's .grad views, as any trainer leaves .grad behind)
        alive, opt = weakref.ref(trainer), weakref.ref(trainer.opt)
        del trainer
        assert alive() is None and opt() is None, (
            "a dropped DistAccumTrainer is still alive (a reference cycle through its parameter hooks?): "
            f"trainer {'alive' if alive() is not None else 'freed'}, AdamW and its state "
            f"{'alive' if opt() is not None else 'freed'}")
        model(x)  # the model lives on: the old hooks must be harmless
    finally:
        gc.enable()
        dist.destroy_process_group()
