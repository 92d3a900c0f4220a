"""Memory per data-parallel mode: the memory model's arithmetic on known numbers (verify/memory/model.py),
the activation counter, and `python -m verify.memory.modes` end to end on the CPU (two modes through
torchrun, one of them FSDP2), plus its bad input (one line, exit 2)."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verify.memory import model as mm
from verify.memory.modes import main as modes_main
from verify.memory.probes import saved_activation_bytes

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(k, None)

# P = 1000 elements of 4 bytes, W = 2, shard 500, units: root 100 + two blocks of 450; A = 10 000, logits 1 000
Z = mm.Sizes(params=1000, elem_bytes=4, world=2, shard=500, units=(100, 450, 450))
A, L = 10_000, 1_000
STEP = A + 2 * L  # activations + the loss's backward temporaries, in every mode


@pytest.mark.parametrize("mode,N,cuda,cpu", [
    ("single", 1, 4000 + 8000 + STEP, STEP),                      # grads transient at N = 1
    ("single", 2, 4000 + 8000 + 4000 + STEP, 4000 + STEP),        # held across micro-steps, freed every step
    ("xtrain", 1, 4000 + 8000 + 4008 + STEP, STEP),               # flat buffer (P + 2 slots) lives between steps
    ("xtrain", 4, 4000 + 8000 + 4008 + STEP, STEP),
    ("torch_ddp", 1, 4000 + 8000 + 4000 + STEP, STEP),            # buckets between steps
    ("torch_ddp", 2, 4000 + 8000 + 4000 + 4000 + STEP, 4000 + STEP),  # + fresh grads in the no-sync window
    ("fsdp2", 1, 2000 + 4000 + 1800 + 4000 + STEP, 1800 + 4000 + STEP),  # one unit's grad; root + 2 blocks gathered
    ("fsdp2", 2, 2000 + 4000 + 4000 + 4000 + STEP, 4000 + 4000 + STEP),  # every unit's grad held
    ("fsdp2_keep", 1, 2000 + 4000 + 5800 + STEP, 5800 + STEP),       # every unit + 1 block gathered, no grad yet
    ("fsdp2_keep", 2, 2000 + 4000 + 4000 + 5800 + STEP, 4000 + 5800 + STEP),
])
def test_the_model_on_known_numbers(mode, N, cuda, cpu):
    assert mm.predict(mode, N, Z, A, L, probe="cuda")["bytes"] == cuda
    p = mm.predict(mode, N, Z, A, L, probe="cpu")
    assert p["bytes"] == cpu and sum(p["terms"].values()) == cpu


def test_torch_ddp_variants():
    cpu = lambda N, **k: mm.predict("torch_ddp", N, Z, A, L, probe="cpu", **k)["bytes"]  # noqa: E731
    assert cpu(2, bucket_view=True, set_to_none=False) == STEP  # grads stay bucket views: no second copy
    assert cpu(1, bucket_view=False, set_to_none=False) == STEP  # a second copy, but between steps (baseline)
    assert mm.predict("torch_ddp", 1, Z, A, L, probe="cuda", bucket_view=False, set_to_none=False)["bytes"] == \
        4000 + 8000 + 4000 + 4000 + STEP


def test_gpt_sizes_match_the_real_model():
    from xtrain_core.config import PRESETS
    from xtrain_core.model import build_model

    for W in (1, 2, 3):
        for name in ("tiny", "small"):
            c = PRESETS[name]
            z = mm.gpt_sizes(c.vocab_size, c.seq_len, c.n_layer, c.d_model, W)
            m = build_model(c, 0)
            assert z.params == sum(p.numel() for p in m.parameters()) == c.n_params
            assert z.units[1:] == tuple(sum(p.numel() for p in b.parameters()) for b in m.blocks)
            assert z.shard == sum(math.ceil(p.shape[0] / W) * math.prod(p.shape[1:]) for p in m.parameters())


def test_modes_classes_and_judging():
    assert mm.mode_of("verify.adapters.xtrain:adapter", 1) == "single"
    assert mm.mode_of("verify.adapters.xtrain:adapter", 2, "DistAccumTrainer") == "xtrain"
    assert mm.mode_of("verify.adapters.xtrain:fsdp2_keep", 2, "FSDP2Trainer") == "fsdp2_keep"
    assert mm.mode_of("verify.adapters.xtrain:torch_ddp", 2, "AccumTrainer") is None  # not what ran
    assert mm.mode_of("verify.adapters.broken:leaky_graph", 1) is None
    assert mm.mode_of("memory_adapters:mlp", 1) is None
    with pytest.raises(ValueError, match="unknown mode"):
        mm.predict("zero3", 1, Z, A, L, probe="cpu")
    with pytest.raises(ValueError, match="probe"):
        mm.predict("xtrain", 1, Z, A, L, probe="tpu")
    floor = 4 << 20
    assert mm.judge(1.05, 64 << 20, floor) == "ok" and mm.judge(5.0, 64 << 20, floor) == "absurd"
    assert mm.judge(0.2, 64 << 20, floor) == "absurd" and mm.judge(9.0, 8 << 20, floor) == "unjudged"
    assert mm.judge(None, 64 << 20, floor) == "unjudged"


def test_saved_activation_bytes_counts_saved_storages_once_without_parameters():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    x = torch.randn(4, 8)
    # Linear saves its input (4·8·4 B; its weight is a parameter: not counted), ReLU its output (4·16·4 B)
    assert saved_activation_bytes(m, lambda t: m(t).sum(), x) == dict(saved_bytes=128 + 256, saved_tensors=2, output_bytes=256)
    y = m(x)  # a tensor saved twice (mul saves both operands, the same storage) counts once
    assert saved_activation_bytes(m, lambda t: (m(t) * m(t)).sum(), x)["saved_bytes"] == 128 + 2 * 256
    assert y.shape == (4, 16)


def test_gpt_activations_grow_with_the_micro_batch():
    from verify.adapters.xtrain import tokens
    from xtrain_core.config import PRESETS
    from xtrain_core.model import build_model

    m = build_model(PRESETS["tiny"], 0)
    a = {}
    for B in (1, 2, 4):
        x, y = tokens(B, 0, None)
        a[B] = saved_activation_bytes(m, m.loss_batched, x, y)
        assert a[B]["output_bytes"] == B * 16 * 256 * 4  # logits (B, S, V) fp32
    assert 1.9 * a[1]["saved_bytes"] < a[2]["saved_bytes"] < 2 * a[1]["saved_bytes"] + 4096  # the mask is shared
    assert a[4]["saved_bytes"] > 3.9 * a[1]["saved_bytes"]


def test_the_model_reproduces_plain_torch_on_one_h200():
    """The shipped anchor (plain torch, gpt2-ish, S=512, one H200, torch.cuda.max_memory_allocated) against the
    'single' mode's prediction of the GPU quantity, activations counted on the meta device (no memory, no
    compute; the saved tensors' shapes are the GPU's): within 10 % at every (N, B), 0.4 % at B = 32."""
    from xtrain_core.config import PRESETS
    from xtrain_core.model import GPT

    from verify.memory.plan import DEFAULT_ANCHOR

    c = PRESETS["gpt2-ish"]
    with torch.device("meta"):
        m = GPT(c)
    z = mm.gpt_sizes(c.vocab_size, c.seq_len, c.n_layer, c.d_model, 1)
    for a in json.loads(DEFAULT_ANCHOR.read_text()):
        x = torch.zeros(a["B"], 512, dtype=torch.long, device="meta")
        acts = saved_activation_bytes(m, m.loss_batched, x, x)
        pred = mm.predict("single", a["N"], z, acts["saved_bytes"], acts["output_bytes"], probe="cuda")["bytes"]
        assert 1.0 <= a["peak_alloc_gib"] * 2**30 / pred < 1.1, (a, pred / 2**30)


# -- the modes runner -------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--modes", "xtrain,zero3"], "unknown mode zero3"),
    (["--world", "100000", "--effective-batch", "200000"], "--world 100000 exceeds the"),
    (["--effective-batch", "5", "--world", "2"], "not divisible by --world 2"),
    (["--name", "a/b"], "--name a/b"),
])
def test_modes_bad_input_is_one_line_exit_2(args, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        modes_main([*args, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and err.startswith("verify.memory.modes: error:")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.memory
@pytest.mark.distributed
@pytest.mark.slow
def test_modes_end_to_end_on_cpu(tmp_path):
    """xtrain's flat buffer and FSDP2 (reshard after forward), each through torchrun with 2 gloo ranks (E=8:
    5 configurations per rank): the combined report, its fields, every mode flat at fixed B and within
    15 % of its prediction. ~45 s on 2 cores."""
    cmd = [sys.executable, "-m", "verify.memory.modes", "--effective-batch", "8", "--world", "2", "--device", "cpu",
           "--modes", "xtrain,fsdp2", "--model", "small", "--seq-len", "256", "--warmup", "1", "--out", str(tmp_path),
           "--name", "mm"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=str(REPO),
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"verify.memory.modes timed out; stderr tail: {err[-2000:]}")
    assert p.returncode == 0, out + err[-3000:]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["mm.json", "mm.md", "mm.png"]
    rep = json.loads((tmp_path / "mm.json").read_text())
    assert rep["kind"] == "memory-modes" and rep["verdict"] == "PASS" and "git_commit" in rep
    s = rep["settings"]
    assert (s["effective_batch"], s["world_size"], s["device"], s["model_name"], s["seq_len"], s["warmup_steps"]) == \
        (8, 2, "cpu", "small", 256, 1)
    assert [m["mode"] for m in rep["modes"]] == ["xtrain", "fsdp2"]
    assert [m["trainer_class"] for m in rep["modes"]] == ["DistAccumTrainer", "FSDP2Trainer"]
    for m in rep["modes"]:
        assert m["verdict"] == "PASS" and m["exit_code"] == 0 and m["model_check"] == "PASS"
        assert set(m["invariants"].values()) == {"PASS"} and m["flat_fixed_B"]["status"] == "PASS"
        assert [(r["N"], r["B"]) for r in m["rows"]] == [(1, 4), (2, 2), (4, 1), (1, 1), (2, 1)]
        for r in m["rows"]:
            assert len(r["measured"]) == 2 and r["predicted_bytes"] > 0 and r["terms"]
            assert all(0.85 < x < 1.15 for x in r["ratio"]), (m["mode"], r)
        inner = m["report"]
        assert inner["prediction"]["mode"] == m["mode"] and inner["prediction"]["probe"] == "cpu"
        assert all(x["process_group"] == dict(backend="gloo", world=2) for c in inner["configs"] for x in c["ranks"])
    fsdp = rep["modes"][1]["rows"]
    by = {(r["N"], r["B"]): r for r in fsdp}
    # FSDP2's no-sync window: every unit's unsharded gradient (P·4 bytes) joins the peak from N = 2 on
    P = rep["settings"]["n_params"]
    assert by[(2, 1)]["terms"]["unsharded gradients, every unit (no-sync window)"] == 4 * P
    assert by[(2, 1)]["peak_bytes"] - by[(1, 1)]["peak_bytes"] > 2 * P  # measured: the window costs memory
    md = (tmp_path / "mm.md").read_text()
    assert "**PASS**" in md and "## Measured vs predicted" in md and "is the peak flat in N?" in md and "mm.png" in md
    assert (tmp_path / "mm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[1/2] xtrain: PASS" in err and "[2/2] fsdp2: PASS" in err
    assert "meas/pred" in out and "verdict: PASS" in out


@pytest.mark.memory
@pytest.mark.distributed
@pytest.mark.slow
def test_a_mode_past_its_time_is_killed_whole_and_reported(tmp_path):
    """--budget: a mode that runs out of time is an ERROR line (exit 1), the next is not started, and nothing
    of the killed run survives (torchrun starts its ranks in sessions of their own: killed by pid)."""
    r = subprocess.run([sys.executable, "-m", "verify.memory.modes", "--modes", "fsdp2,xtrain", "--budget", "6",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=ENV, cwd=str(REPO), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "[1/2] fsdp2: ERROR in" in r.stderr and "timed out after 6 s" in r.stderr
    assert "xtrain: ERROR in 0.0 s — not run: --budget 6 s spent" in r.stderr
    rep = json.loads((tmp_path / "memory-modes.json").read_text())
    assert rep["verdict"] == "FAIL" and [m["verdict"] for m in rep["modes"]] == ["ERROR", "ERROR"]
    run_dir = rep["modes"][0]["command"].split("--out ")[1].split()[0]
    alive = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            alive += [d] if run_dir.encode() in Path(f"/proc/{d}/cmdline").read_bytes() else []
        except OSError:
            pass
    assert not alive, f"processes of the killed run survive: {alive}"
