"""xtrain's memory model, one per data-parallel mode (single, xtrain, torch_ddp, fsdp2, fsdp2_keep): the
PREDICTED peak bytes per rank of one configuration (N, B), of the quantity verify.memory's probe measures
("cuda": every term; "cpu": what a step allocates above the pre-step RSS). Pure arithmetic, checked by
tests/memory/test_memory_model.py; offered through the generic hook `Adapter(predicted_peak=...)`
(`predicted_peak(mode)`; each adapter names its mode, no name is matched). `ANCHOR`: plain torch on one
H200, xtrain's GPT.

Inputs (P, W, FSDP2 units and shard, activations A, logits L), where the peak is assumed and every term per
mode and probe: docs/design/memory.md, "Memory per data-parallel mode".
"""
from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

MODES = ("single", "xtrain", "torch_ddp", "fsdp2", "fsdp2_keep")
CLASSES = {"single": "AccumTrainer", "xtrain": "DistAccumTrainer", "torch_ddp": "TorchDDPTrainer",
           "fsdp2": "FSDP2Trainer", "fsdp2_keep": "FSDP2Trainer"}
"""The trainer class each mode describes: a mode declines any other (a planted bug built from the same
adapter, xtrain_proof.adapters.variant, keeps the hook but not the class)."""


@dataclass(frozen=True)
class Sizes:
    params: int  # P
    elem_bytes: int  # b
    world: int  # W
    shard: int  # elements of one rank's FSDP2 shard, padded
    units: tuple[int, ...]  # FSDP2 units' elements: the root first, then the blocks


def gpt_sizes(vocab: int, seq_len: int, n_layer: int, d: int, world: int, elem_bytes: int = 4) -> Sizes:
    """xtrain's GPT (xtrain_core/model.py) from its config: parameter shapes, units and a rank's shard."""
    root = [(vocab, d), (seq_len, d), (d,), (d,), (vocab, d)]  # tok, pos, ln.{weight,bias}, head
    block = [(d,)] * 4 + [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    numel = lambda shapes: sum(s[0] * (s[1] if len(s) > 1 else 1) for s in shapes)  # noqa: E731
    padded = lambda shapes: sum(-(-s[0] // world) * (s[1] if len(s) > 1 else 1) for s in shapes)  # noqa: E731
    units = (numel(root), *[numel(block)] * n_layer)
    return Sizes(params=sum(units), elem_bytes=elem_bytes, world=world,
                 shard=padded(root) + n_layer * padded(block), units=units)


def terms(mode: str, N: int, z: Sizes, activations: int, logits: int, *, bucket_view: bool = True,
          set_to_none: bool = True):
    """[(name, bytes, between_steps)]: between_steps terms exist before the measured steps (the CPU
    probe's baseline holds them). bucket_view / set_to_none: torch_ddp's gradient_as_bucket_view and
    zero_grad(set_to_none) (TorchDDPTrainer: True, True)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    b, P = z.elem_bytes, z.params
    step = [("activations (saved for backward, one micro-batch)", activations, False),
            ("loss backward temporaries (2 × logits)", 2 * logits, False)]
    if mode in ("single", "xtrain", "torch_ddp"):
        out = [("parameters", P * b, True), ("AdamW state (2 × params)", 2 * P * b, True)]
        if mode == "single" and N >= 2:
            out.append(("gradients, held across micro-steps", P * b, False))
        if mode == "xtrain":
            out.append(("flat gradient buffer + 2 loss slots", (P + 2) * b, True))
        if mode == "torch_ddp":
            out.append(("DDP buckets", P * b, True))
            if not set_to_none and not bucket_view:
                out.append(("gradients (kept between steps)", P * b, True))
            elif set_to_none and N >= 2:
                out.append(("gradients outside the buckets (no-sync window)", P * b, False))
        return out + step
    root, blocks = z.units[0], z.units[1:] or (0,)
    out = [("sharded parameters (params / W)", z.shard * b, True),
           ("AdamW state on the shard (2 × params / W)", 2 * z.shard * b, True)]
    if N >= 2:
        out.append(("unsharded gradients, every unit (no-sync window)", P * b, False))
    elif mode == "fsdp2":
        out.append(("unsharded gradient of one unit (the largest), transient", max(z.units) * b, False))
    if mode == "fsdp2":
        out.append(("gathered parameters: root + 2 × largest block", (root + 2 * max(blocks)) * b, False))
    else:
        out.append(("gathered parameters: every unit + 1 block in flight", (P + max(blocks)) * b, False))
    return out + step


def predict(mode: str, N: int, z: Sizes, activations: int, logits: int, *, probe: str, **ddp):
    """{'bytes': the predicted peak of what `probe` ('cpu' or 'cuda') measures, 'terms': {name: bytes} of the
    terms counted}."""
    if probe not in ("cpu", "cuda"):
        raise ValueError(f"probe must be cpu or cuda, got {probe!r}")
    counted = [(n, v) for n, v, base in terms(mode, N, z, activations, logits, **ddp)
               if probe == "cuda" or not base]
    return dict(bytes=sum(v for _, v in counted), terms=dict(counted))


# -- the hook: verify.memory.PeakQuery -> verify.memory.Prediction ----------------------------------

QUANTITY = {
    "cpu": "the same quantity as the CPU probe: what a step allocates above the RSS right before the measured "
           "steps (activations, the loss's backward temporaries, gradients a step creates, FSDP2's gathered "
           "parameters); parameters, AdamW state, xtrain's flat buffer and DDP's buckets exist between steps, "
           "sit in the probe's baseline and are not counted",
    "cuda": "the same quantity as the GPU probe (torch.cuda.max_memory_allocated): every term, parameters, "
            "gradients, AdamW state and buffers included",
}


def activations(options, Bs, device, batch) -> dict[int, dict]:
    """The activation input of the model, per micro-batch size B: one forward of xtrain's GPT
    (options.model) on B rows of `batch(rows)`, on `device`, counted by verify.memory.probes.
    saved_activation_bytes (bytes saved for backward, and the logits' bytes). Measured after the peak
    probes: on the GPU its memory is freed before anything else runs."""
    import torch
    from xtrain_core.model import build_model

    from verify.memory.probes import saved_activation_bytes

    model = build_model(options.model, 0, device=device)
    loss = model.loss_batched if getattr(options, "loss_norm", "mean") == "mean" else model.loss_sum
    out = {}
    for B in sorted(set(Bs)):
        x, y = batch(B)
        out[B] = saved_activation_bytes(model, loss, x.to(device), y.to(device))
    del model, loss  # the bound loss method holds the model too
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def predicted_peak(mode: str | None):
    """The `predicted_peak` hook of one of xtrain's adapters: its mode (None: xtrain's default adapter,
    AccumTrainer alone, DistAccumTrainer at world > 1)."""

    def hook(q):
        from verify.memory.plan import byte_unit
        from verify.memory.prediction import Prediction

        m = mode or ("xtrain" if q.world > 1 else "single")
        if q.trainer_class not in (None, CLASSES[m]):
            return f"no memory model: xtrain's {m} mode describes {CLASSES[m]}, {q.trainer_class} ran"
        o = q.options
        z = gpt_sizes(o.model.vocab_size, o.model.seq_len, o.model.n_layer, o.model.d_model, q.world, elem_bytes=4)
        try:
            acts = activations(o, [B for _, B in q.configs], q.device,
                               lambda rows: q.adapter.batch(rows, 1 << 16, o))
        except Exception as e:  # noqa: BLE001
            from verify.memory.probes import one_line

            return f"activations not measured: {one_line(e)}"
        peaks = {(N, B): predict(m, N, z, acts[B]["saved_bytes"], acts[B]["output_bytes"], probe=q.probe)
                 for N, B in q.configs}
        unit, scale = byte_unit(q.probe == "cuda")
        amount = (lambda b: f"{b / scale:.3f}") if unit == "GiB" else (lambda b: f"{b / scale:.1f}")  # noqa: E731
        text = (f"Mode **{m}** (`xtrain_proof/memory.py`): P = {z.params:,} parameter elements × "
                f"{z.elem_bytes} B, W = {z.world}, FSDP2 shard {z.shard:,} elements, units (root, blocks) "
                f"{z.units[0]:,}, {z.units[1] if len(z.units) > 1 else 0:,} × {len(z.units) - 1}. Activations of one "
                "micro-batch (bytes saved for backward by one forward, counted by saved_tensors_hooks; saved tensors, "
                "not temporaries), {unit}: " + ", ".join(f"B={B}: {amount(v['saved_bytes'])}" for B, v in sorted(acts.items())) + ".")
        return Prediction(mode=m, peaks=peaks, quantity=QUANTITY[q.probe], text=text, source="xtrain_proof/memory.py",
                          inputs=dict(sizes=dict(params=z.params, elem_bytes=z.elem_bytes, world=z.world, shard=z.shard,
                                                 units=list(z.units)),
                                      activations={str(B): v for B, v in sorted(acts.items())}), doc=__doc__)

    hook.__qualname__ = hook.__name__ = f"predicted_peak_{mode or 'xtrain'}"
    return hook


# -- the anchor: plain torch, no xtrain code, the same GPT on one H200 ----------------------------

ANCHOR_NAME = "h200_torch_single_E32.json"
ANCHOR = importlib.resources.files(__package__).joinpath(ANCHOR_NAME)
"""Plain torch on one H200 (gpt2-ish, S=512, E=32), shipped inside the package so an installed verify
finds it too (benchmarks/plain_torch.py measured it)."""


def anchor_applies(options, *, E: int, world: int, cuda: bool) -> bool:
    """The anchor's setting: xtrain's options with the gpt2-ish GPT at S=512, E=32, one GPU."""
    from xtrain_core.config import PRESETS

    model = getattr(options, "model", None)
    return cuda and world == 1 and E == 32 and model == PRESETS["gpt2-ish"] and options.seq_len == 512
