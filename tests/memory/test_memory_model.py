"""xtrain's memory model (xtrain_proof/memory.py): its arithmetic on known numbers, the GPT's sizes,
the activation counter, the hook each of xtrain's adapters declares, and the H200 anchor (plain torch):
the model reproduces it, it ships with the package, and the report compares against it."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tests.helpers.memory import REPO, fake_report

from xtrain_proof import memory as mm
from verify.memory.invariants import check_invariants
from verify.memory.plan import plan_configs
from verify.memory.probes import saved_activation_bytes

pytestmark = pytest.mark.memory

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


def _query(adapter, world=1, trainer_class=None, configs=((1, 2), (2, 1))):
    from xtrain_proof.adapters import XtrainOptions
    from verify.memory import PeakQuery
    from xtrain_core.config import PRESETS

    return PeakQuery(adapter=adapter, options=XtrainOptions(model=PRESETS["tiny"], seq_len=16), configs=configs,
                     world=world, device=torch.device("cpu"), probe="cpu", trainer_class=trainer_class)


def test_each_adapter_declares_its_mode_and_declines_another_trainer():
    """No name is matched: each of xtrain's adapters carries its mode in its hook; the mode declines a
    trainer class it does not describe (a planted bug built from the same adapter keeps the hook)."""
    from tests.helpers import memory_adapters

    from planted import broken
    from xtrain_proof import adapters as xtrain
    from verify.memory import Prediction

    cases = [(xtrain.adapter, 1, None, "single"), (xtrain.adapter, 2, "DistAccumTrainer", "xtrain"),
             (xtrain.tokens_adapter, 1, "AccumTrainer", "single"), (xtrain.single, 1, "AccumTrainer", "single"),
             (xtrain.data_parallel, 2, "DistAccumTrainer", "xtrain"), (xtrain.torch_ddp, 2, "TorchDDPTrainer", "torch_ddp"),
             (xtrain.torch_ddp_tokens, 2, None, "torch_ddp"), (xtrain.fsdp2, 2, "FSDP2Trainer", "fsdp2"),
             (xtrain.fsdp2_tokens, 2, None, "fsdp2"), (xtrain.fsdp2_keep, 2, "FSDP2Trainer", "fsdp2_keep")]
    for adapter, world, cls, mode in cases:
        p = adapter.predicted_peak(_query(adapter, world, cls))
        assert isinstance(p, Prediction) and p.mode == mode, (adapter, p)
        assert set(p.peaks) == {(1, 2), (2, 1)} and all(v["bytes"] == sum(v["terms"].values()) > 0 for v in p.peaks.values())
        assert p.source == "xtrain_proof/memory.py" and f"Mode **{mode}**" in p.text
    declined = xtrain.torch_ddp.predicted_peak(_query(xtrain.torch_ddp, 2, "AccumTrainer"))
    assert declined == "no memory model: xtrain's torch_ddp mode describes TorchDDPTrainer, AccumTrainer ran"
    leak = broken.MEMORY_BROKEN["leaky_graph"]
    assert isinstance(leak.predicted_peak(_query(leak, 1, "LeakyGraph")), str)
    assert memory_adapters.mlp.predicted_peak is None
    with pytest.raises(ValueError, match="unknown mode"):
        mm.predict("zero3", 1, Z, A, L, probe="cpu")
    with pytest.raises(ValueError, match="probe"):
        mm.predict("xtrain", 1, Z, A, L, probe="tpu")


def test_saved_activation_bytes_counts_saved_storages_once_without_parameters():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    x = torch.randn(4, 8)
    # Linear saves its input (4·8·4 B; its weight is a parameter: not counted), ReLU its output (4·16·4 B)
    assert saved_activation_bytes(m, lambda t: m(t).sum(), x) == dict(saved_bytes=128 + 256, saved_tensors=2, output_bytes=256)
    y = m(x)  # a tensor saved twice (mul saves both operands, the same storage) counts once
    assert saved_activation_bytes(m, lambda t: (m(t) * m(t)).sum(), x)["saved_bytes"] == 128 + 2 * 256
    assert y.shape == (4, 16)


def test_gpt_activations_grow_with_the_micro_batch():
    from xtrain_proof.adapters import tokens
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

    c = PRESETS["gpt2-ish"]
    with torch.device("meta"):
        m = GPT(c)
    z = mm.gpt_sizes(c.vocab_size, c.seq_len, c.n_layer, c.d_model, 1)
    for a in json.loads(mm.ANCHOR.read_text()):
        x = torch.zeros(a["B"], 512, dtype=torch.long, device="meta")
        acts = saved_activation_bytes(m, m.loss_batched, x, x)
        pred = mm.predict("single", a["N"], z, acts["saved_bytes"], acts["output_bytes"], probe="cuda")["bytes"]
        assert 1.0 <= a["peak_alloc_gib"] * 2**30 / pred < 1.1, (a, pred / 2**30)



def test_the_anchor_ships_with_the_package():
    """An installed (non-editable) verify finds the plain-torch anchor: package data beside xtrain's memory model."""
    tomllib = pytest.importorskip("tomllib")

    assert mm.ANCHOR.is_file() and Path(str(mm.ANCHOR)).parent == Path(mm.__file__).parent
    assert {(a["N"], a["B"]) for a in json.loads(mm.ANCHOR.read_text())} >= {(1, 32), (32, 1)}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert mm.ANCHOR_NAME in pyproject["tool"]["setuptools"]["package-data"]["xtrain_proof"]



def test_anchor_comparison_and_gpu_rendering_without_a_gpu(tmp_path):
    """The H200 report's anchor section, rendered from rows that reproduce plain torch's own numbers."""
    from xtrain_proof import adapters as xtrain
    from verify.memory import report as memreport
    from verify.memory.anchor import compare_anchor, target_ratio
    from verify.memory.plan import GiB, Plan
    from xtrain_core.config import PRESETS, OptimConfig

    anchor = json.loads(mm.ANCHOR.read_text())
    opts = xtrain.XtrainOptions(model=PRESETS["gpt2-ish"], seq_len=512, optim=OptimConfig())
    plan = Plan(E=32, world=1, rank=0, device=torch.device("cuda", 0), adapter=xtrain.adapter, trainer="xtrain",
                options=opts, model_name="gpt2-ish", steps=3, threads=1, out=tmp_path, anchor=mm.ANCHOR,
                configs=plan_configs(32))
    by = {(a["N"], a["B"]): a for a in anchor}
    by[(4, 1)] = dict(by[(2, 1)], N=4)  # the anchor has no (4,1) / (16,1): use the flat B=1 value
    by[(16, 1)] = dict(by[(2, 1)], N=16)
    rows = [dict(N=c.N, B=c.B, eff=c.N * c.B, sweeps=list(c.sweeps), rank=0, grad_bytes=int(by[(c.N, c.B)]["static_gib"] / 4 * GiB),
                 peak_bytes=int(by[(c.N, c.B)]["peak_alloc_gib"] * GiB), peak_reserved_bytes=int(by[(c.N, c.B)]["peak_reserved_gib"] * GiB),
                 nvml_peak_used_bytes=int(by[(c.N, c.B)]["nvml_peak_gib"] * GiB), nvml_period_s=0.002, nvml_mean_interval_s=0.0021,
                 step_ms=by[(c.N, c.B)]["step_ms"], tok_s=by[(c.N, c.B)]["tok_s"], static_bytes=int(by[(c.N, c.B)]["static_gib"] * GiB))
            for c in plan.configs]
    a = compare_anchor(plan, rows)
    assert a["source"] == "xtrain_proof/h200_torch_single_E32.json (shipped with the package)"
    assert target_ratio(anchor) == 0.126  # plain torch's 2.0413 / 16.2643 GiB = 0.1255, rounded up
    assert [t["status"] for t in a["targets"]] == ["PASS", "PASS"]
    assert abs(a["targets"][0]["ours"] - 0.1255) < 1e-3 and a["targets"][0]["anchor"] == pytest.approx(a["targets"][0]["ours"], rel=1e-6)
    worse = [dict(r, peak_bytes=r["peak_bytes"] + 64 * 2**20) if (r["N"], r["B"]) == (32, 1) else r for r in rows]
    assert compare_anchor(plan, worse)["targets"][0]["status"] == "FAIL"  # 64 MiB more at (32,1): ratio 0.1294
    from dataclasses import replace

    assert compare_anchor(replace(plan, anchor=None), rows) is None
    # which runs the anchor applies to is xtrain's rule (the CLI drops it elsewhere): gpt2-ish, S=512, E=32, one GPU
    assert mm.anchor_applies(opts, E=32, world=1, cuda=True)
    for o, E, world, cuda in ((replace(opts, seq_len=256), 32, 1, True), (opts, 16, 1, True), (opts, 32, 2, True),
                              (opts, 32, 1, False), (None, 32, 1, True)):
        assert not mm.anchor_applies(o, E=E, world=world, cuda=cuda)
    inv = check_invariants([rows], E_local=32, cuda=True)
    assert [v["status"] for v in inv] == ["PASS"] * 4, inv
    rep = fake_report()
    rep.update(settings=dict(rep["settings"], effective_batch=32, device="cuda:0", model_name="gpt2-ish", seq_len=512),
               machine_info=dict(rep["machine_info"], gpu="NVIDIA H200", driver="580", nvml="ok", cuda="13.0"),
               probe=dict(rep["probe"], nvml="n"), invariants=inv, anchor=dict(a, verdict="PASS"),
               configs=[dict(N=r["N"], B=r["B"], eff=r["eff"], sweeps=r["sweeps"], peak_bytes=r["peak_bytes"], ranks=[r]) for r in rows])
    rep["verdict"] = memreport.overall(rep)
    assert rep["verdict"] == "PASS"
    memreport.write_all(rep, tmp_path)
    md = (tmp_path / "memory-E32.md").read_text()
    assert "## Beside plain torch (the anchor)" in md and "| 32 | 1 | 2.041 / 2.041 |" in md and "period 2 ms" in md
    assert "(anchor) PASS" in memreport.text_table(rep)
