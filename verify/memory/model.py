"""A memory model per data-parallel mode: the PREDICTED peak bytes per rank of one configuration (N, B),
of the same quantity the probe measures (pure arithmetic, no torch: tests/test_memory_modes.py).

Inputs: P parameter elements of b bytes (fp32: 4), W ranks, FSDP2's units (the root: embeddings, final
norm, head; then one per block) and a rank's shard (Σ ⌈dim0/W⌉·rest over the parameters, FSDP2's padding),
A = bytes of the tensors saved for backward by ONE forward at micro-batch B (probes.saved_activation_bytes,
measured directly, not from a peak: saved tensors, not temporaries) and L = bytes of that forward's logits.

The peak is assumed at the start of the LAST micro-step's backward: every activation alive, the
gradients held across micro-steps, the parameters gathered at that moment, and the loss's backward
temporaries (the gradient of the log-probabilities and of the logits: 2·L). Terms per mode:

  single      params P·b, AdamW 2P·b, grads P·b for N ≥ 2 (zero_grad(set_to_none) frees them every step;
              at N = 1 each appears while the activations it needed are freed: not at the peak), A, 2L
  xtrain      params, AdamW, the flat buffer (P+2)·b (grads + 2 loss slots; lives from construction), A, 2L
  torch_ddp   params, AdamW, DDP's buckets P·b, and for N ≥ 2 ANOTHER P·b: zero_grad(set_to_none=True)
              detaches .grad from the buckets even under gradient_as_bucket_view, so the no-sync micro-steps
              accumulate into fresh tensors, copied into the buckets by the sync backward (at N = 1 those
              fresh gradients are copied and freed one by one: not at the peak). Only bucket views with
              set_to_none=False keep the grads in the buckets; no views and no set_to_none keep a second
              copy between steps. A, 2L
  fsdp2       sharded params shard·b, AdamW on the shard 2·shard·b, unsharded grads: N ≥ 2 every unit's,
  fsdp2_keep  P·b, held through the no-sync window. N = 1: only transiently per unit (each unit reduces and
              frees its gradient in its own backward): reshard, ONE unit's (the largest) - the peak moves
              into the backward, where a block is gathered again while its gradient exists; keep, none - the
              peak is the end of the forward, every unit gathered and no gradient yet. Gathered parameters:
              reshard after forward, the root (FSDP2 keeps the root gathered from its forward to its
              backward) + 2 × the largest block (the one in use + one all-gather buffer in flight); keep,
              every unit P·b + one block in flight. A, 2L

What counts depends on the probe (`probe` argument):
  "cuda"  torch.cuda.max_memory_allocated: everything, so every term;
  "cpu"   peak RSS above the RSS right before the measured steps: the terms that exist between steps are in
          that baseline (params, AdamW state, the flat buffer, DDP's buckets) and drop out; what a step
          allocates and frees (activations, temporaries, gradients freed by set_to_none, gathered
          parameters) stays.
"""
from __future__ import annotations

from dataclasses import dataclass

MODES = ("single", "xtrain", "torch_ddp", "fsdp2", "fsdp2_keep")
ABSURD = (0.25, 4.0)
"""measured/predicted outside this range is not a modelling approximation (a term the size of the whole
peak is missing or double-counted, or the probe measured something else): the run fails."""

_ADAPTERS = {"adapter": None, "tokens_adapter": None, "single": "single", "data_parallel": "xtrain",
             "torch_ddp": "torch_ddp", "torch_ddp_tokens": "torch_ddp",
             "fsdp2": "fsdp2", "fsdp2_tokens": "fsdp2", "fsdp2_keep": "fsdp2_keep"}
CLASSES = {"single": "AccumTrainer", "xtrain": "DistAccumTrainer", "torch_ddp": "TorchDDPTrainer",
           "fsdp2": "FSDP2Trainer", "fsdp2_keep": "FSDP2Trainer"}


def mode_of(adapter_ref: str, world: int, trainer_class: str | None = None) -> str | None:
    """The mode of one of xtrain's adapters (verify.adapters.xtrain:NAME), None for any other trainer or
    when the trainer that ran (its class) is not the one the mode describes."""
    module, _, name = adapter_ref.partition(":")
    if module != "verify.adapters.xtrain" or name not in _ADAPTERS:
        return None
    mode = _ADAPTERS[name] or ("xtrain" if world > 1 else "single")
    return mode if trainer_class in (None, CLASSES[mode]) else None


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


def judge(ratio: float | None, predicted: int, floor: int) -> str:
    """'ok', 'absurd', or 'unjudged' (no ratio, or a prediction under 4 × the probe's noise floor)."""
    if ratio is None or predicted < 4 * floor:
        return "unjudged"
    return "ok" if ABSURD[0] <= ratio <= ABSURD[1] else "absurd"


# -- applied to a verify.memory report ----------------------------------------------------------

QUANTITY = {
    "cpu": "the same quantity as the CPU probe: what a step allocates above the RSS right before the measured "
           "steps (activations, the loss's backward temporaries, gradients a step creates, FSDP2's gathered "
           "parameters); parameters, AdamW state, xtrain's flat buffer and DDP's buckets exist between steps, "
           "sit in the probe's baseline and are not counted",
    "cuda": "the same quantity as the GPU probe (torch.cuda.max_memory_allocated): every term, parameters, "
            "gradients, AdamW state and buffers included",
}


def _fmt(b: int, report: dict) -> str:
    from .plan import fmt_bytes, report_unit

    return f"{fmt_bytes(b, report)} {report_unit(report)[0]}"


def add_predictions(report: dict, plan, acts: dict | None, error: str | None = None) -> None:
    """Predicted peak per configuration and rank (`predicted_bytes`, `pred_ratio` = measured/predicted in
    every rank row; `predicted_bytes`, `predicted_terms` per configuration) and the `prediction` section:
    mode, inputs, the quantity predicted, verdict (FAIL only for an absurd ratio, see model.ABSURD)."""
    from .invariants import tolerance

    ok = [x for c in report["configs"] for x in c["ranks"] if "error" not in x]
    cls = {x.get("trainer_class") for x in ok}
    mode = mode_of(plan.adapter.locate(), plan.world, cls.pop() if len(cls) == 1 else None) \
        if plan.model is not None and ok else None
    probe = "cuda" if plan.cuda else "cpu"
    claim = "measured/predicted within the absurd bounds " + f"[{ABSURD[0]}, {ABSURD[1]}] (reported, not judged inside them)"
    for c in report["configs"]:
        c.update(predicted_bytes=None, predicted_terms=None)
        for x in c["ranks"]:
            x.update(predicted_bytes=None, pred_ratio=None)
    if mode is None or acts is None:
        why = error or ("no memory model for this trainer (xtrain, torch_ddp, fsdp2, fsdp2_keep only)" if mode is None
                        else "activations not measured")
        report["prediction"] = dict(mode=mode, verdict="N/A", claim=claim, rows=[why], reason=why)
        return
    m = plan.model
    z = gpt_sizes(m.vocab_size, m.seq_len, m.n_layer, m.d_model, plan.world, elem_bytes=4)
    floor, _ = tolerance(plan.cuda)
    absurd, judged = [], 0
    for c in report["configs"]:
        a = acts[c["B"]]
        pred = predict(mode, c["N"], z, a["saved_bytes"], a["output_bytes"], probe=probe)
        c.update(predicted_bytes=pred["bytes"], predicted_terms=pred["terms"],
                 pred_ratio=None if c["peak_bytes"] is None else c["peak_bytes"] / pred["bytes"])
        for x in c["ranks"]:
            if "error" in x:
                continue
            r = x["peak_bytes"] / pred["bytes"] if pred["bytes"] > 0 else None
            x.update(predicted_bytes=pred["bytes"], pred_ratio=r)
            verdict = judge(r, pred["bytes"], floor)
            judged += verdict != "unjudged"
            if verdict == "absurd":
                absurd.append(f"rank {x['rank']}: N={c['N']},B={c['B']} measured {_fmt(x['peak_bytes'], report)} / "
                              f"predicted {_fmt(pred['bytes'], report)} = {r:.2f}")
    status = "FAIL" if absurd else "PASS" if judged else "N/A"
    report["prediction"] = dict(
        mode=mode, probe=probe, quantity=QUANTITY[probe], verdict=status, claim=claim, absurd_bounds=list(ABSURD),
        rows=absurd or ([] if judged else [f"every prediction under 4 × the noise floor ({_fmt(floor, report)})"]),
        sizes=dict(params=z.params, elem_bytes=z.elem_bytes, world=z.world, shard=z.shard, units=list(z.units)),
        activations={str(B): v for B, v in sorted(acts.items())}, model="verify/memory/model.py", doc=__doc__)
