"""xtrain's memory preset: what `python -m verify.memory` adds when xtrain's trainer is the configured default
(Adapter(memory_preset=...)): the short --trainer names of its data-parallel modes, --model/--seq-len (a preset
GPT at a sequence length) and the plain-torch H200 anchor (xtrain_memory.ANCHOR)."""
from __future__ import annotations

from xtrain_core.config import PRESETS, OptimConfig

from verify.memory.cli import UsageError, Wing, positive_int
from xtrain_proof.memory import ANCHOR, ANCHOR_NAME, anchor_applies
from xtrain_proof.options import XtrainOptions

MODE_TRAINERS = {"xtrain": "xtrain_proof.adapters:adapter", "torch_ddp": "xtrain_proof.adapters:torch_ddp",
                 "fsdp2": "xtrain_proof.adapters:fsdp2", "fsdp2_keep": "xtrain_proof.adapters:fsdp2_keep"}
"""Short --trainer names of the data-parallel modes of xtrain's GPT (benchmarks/memory_modes.py runs each)."""
ANCHOR_NOTE = ("plain torch on one H200, no xtrain code: the same GPT, fp32 with TF32 off, one warm-up step then 3 "
               "measured steps, AdamW(fused=True)")


def add_flags(parser) -> None:
    parser.add_argument("--model", choices=sorted(PRESETS), default=None,
                        help="xtrain's trainer only: model preset (default: small on cpu, gpt2-ish on cuda, the anchor's model)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="xtrain's trainer only: S (default: the model's limit)")


def options_from_flags(adapter, args, cuda: bool, flag: str):
    """XtrainOptions from --model/--seq-len for adapters of xtrain's options (their defaults are an XtrainOptions),
    else the adapter's defaults, and then --model/--seq-len are an error."""
    if not isinstance(adapter.defaults, XtrainOptions):
        given = [f for f, v in (("--model", args.model), ("--seq-len", args.seq_len)) if v is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise UsageError(f"{' and '.join(given)} {verb} to xtrain's trainer only; "
                             f"{flag} {args.trainer} ({adapter.name}) is measured with its adapter's defaults")
        return adapter.defaults, None
    name = args.model or ("gpt2-ish" if cuda else "small")
    model = PRESETS[name]
    seq = args.seq_len or model.seq_len
    if seq > model.seq_len:
        raise UsageError(f"--seq-len {seq} exceeds --model {name}'s limit of {model.seq_len}; "
                         f"pass --seq-len ≤ {model.seq_len}")
    options = XtrainOptions(model=model, seq_len=seq, optim=OptimConfig())
    described = dict(name=name, config=model.__dict__.copy(), seq_len=seq, n_params=model.n_params,
                     text=f"L={model.n_layer} h={model.n_head} d={model.d_model} V={model.vocab_size}")
    return options, described


def anchor(options, *, E: int, world: int, cuda: bool):
    path = ANCHOR if ANCHOR.is_file() else None
    return path, anchor_applies(options, E=E, world=world, cuda=cuda), ANCHOR_NOTE


PRESET = Wing(trainers=dict(MODE_TRAINERS), default="xtrain",
              trainer_help="xtrain (the default), torch_ddp, fsdp2, fsdp2_keep (xtrain's GPT under torch DDP no_sync / "
                           "FSDP2), or MODULE:FACTORY naming an adapter",
              flags=add_flags, options=options_from_flags, anchor=anchor, sources=("xtrain_core", "xtrain_proof", "verify"),
              anchor_help=f"{ANCHOR_NAME}, shipped with xtrain's wing; applies to xtrain's gpt2-ish GPT at S=512, "
                          "E=32 on one GPU")
