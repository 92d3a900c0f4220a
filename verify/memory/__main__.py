"""`python -m verify.memory`: the generic command line (verify/memory/cli.py, `--help` for the flags) run
with xtrain's wing: xtrain's trainer by default, the short trainer names of its data-parallel modes and of
the planted memory bug, --model/--seq-len (xtrain's options: a preset GPT at a sequence length) and the
plain-torch H200 anchor (verify/adapters/xtrain_memory.py). This module is the one place verify.memory
meets xtrain (tests/harness/test_border.py: WING_ENTRIES); the library under it knows no trainer.
"""
from __future__ import annotations

import os
import sys

from xtrain_core.config import PRESETS

from ..settings import launcher_var
from .._cli import UsageError, positive_int
from ..adapters.broken import MEMORY_BROKEN
from ..adapters.xtrain_memory import ANCHOR, ANCHOR_NAME, anchor_applies
from .cli import Wing
from .cli import main as _main

MODE_TRAINERS = {"xtrain": "verify.adapters.xtrain:adapter", "torch_ddp": "verify.adapters.xtrain:torch_ddp",
                 "fsdp2": "verify.adapters.xtrain:fsdp2", "fsdp2_keep": "verify.adapters.xtrain:fsdp2_keep"}
"""Short --trainer names of the data-parallel modes of xtrain's GPT (benchmarks/memory_modes.py runs each)."""
ANCHOR_NOTE = ("plain torch on one H200, no xtrain code: the same GPT, fp32 with TF32 off, one warm-up step then 3 "
               "measured steps, AdamW(fused=True)")


def _flags(p) -> None:
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="xtrain's trainer only: model preset (default: small on cpu, gpt2-ish on cuda, the anchor's model)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="xtrain's trainer only: S (default: the model's limit)")


def _options(adapter, args, cuda: bool, flag: str):
    """XtrainOptions from --model/--seq-len for adapters of xtrain's options (their defaults are an
    XtrainOptions), else the adapter's defaults; --model/--seq-len are then an error."""
    from xtrain_core.config import OptimConfig

    from ..adapters.xtrain_options import XtrainOptions

    if not isinstance(adapter.defaults, XtrainOptions):
        given = [f for f, v in (("--model", args.model), ("--seq-len", args.seq_len)) if v is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to xtrain's trainer only; "
                             f"{flag} {args.trainer} ({adapter.name}) is measured with its adapter's defaults")
        return adapter.defaults, None
    name = args.model or ("gpt2-ish" if cuda else "small")
    model = PRESETS[name]
    seq = args.seq_len or model.seq_len
    if seq > model.seq_len:
        raise UsageError(f"--seq-len {seq} exceeds --model {name}'s limit of {model.seq_len}; "
                         f"pass --seq-len ≤ {model.seq_len}")
    return (XtrainOptions(model=model, seq_len=seq, optim=OptimConfig()),
            dict(name=name, config=model.__dict__.copy(), seq_len=seq, n_params=model.n_params,
                 text=f"L={model.n_layer} h={model.n_head} d={model.d_model} V={model.vocab_size}"))


def _anchor(options, *, E: int, world: int, cuda: bool):
    return (ANCHOR if ANCHOR.is_file() else None, anchor_applies(options, E=E, world=world, cuda=cuda), ANCHOR_NOTE)


WING = Wing(trainers={**MODE_TRAINERS, **{k: MEMORY_BROKEN[k] for k in sorted(MEMORY_BROKEN)}}, default="xtrain",
            trainer_help="xtrain (default: verify.adapters.xtrain:adapter), torch_ddp, fsdp2, fsdp2_keep (xtrain's GPT "
                         "under torch DDP no_sync / FSDP2, verify.adapters.xtrain:NAME), leaky_graph (a planted memory "
                         "bug, verify/adapters/broken.py), or MODULE:FACTORY naming an adapter",
            flags=_flags, options=_options, anchor=_anchor, sources=("xtrain_core", "verify"),
            anchor_help=f"{ANCHOR_NAME}, shipped inside verify/adapters/; applies to xtrain's gpt2-ish GPT at S=512, "
                        "E=32 on one GPU")


def main(argv=None) -> int:
    return _main(argv, WING)


if __name__ == "__main__":
    code = main()
    if int(launcher_var("WORLD_SIZE", "1")) > 1:
        # gloo's teardown at interpreter exit sometimes aborts the process after a clean run; the group is
        # already destroyed and the report written, so leave without running it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
