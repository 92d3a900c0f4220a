"""What a verify.memory run measures: the configurations of both sweeps, the trainer (an Adapter) and its
options, the device, the world. `build_plan` turns the flags into a Plan or a UsageError naming the flag;
it measures nothing.
"""
from __future__ import annotations

import importlib.resources
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xtrain_core.cli import UsageError, resolve_device, writable_dir
from xtrain_core.config import PRESETS, ModelConfig

MiB, GiB = 2**20, 2**30


def byte_unit(cuda: bool) -> tuple[str, int]:
    """The one rule of every table, plot and progress line: GiB on a GPU, MiB on the CPU."""
    return ("GiB", GiB) if cuda else ("MiB", MiB)


def report_unit(report: dict) -> tuple[str, int]:
    return byte_unit(report["settings"]["device"].startswith("cuda"))


def fmt_bytes(b, report: dict) -> str:
    """Bytes in the report's unit (3 decimals of a GiB, 1 of a MiB); — for None."""
    if b is None:
        return "—"
    unit, scale = report_unit(report)
    return f"{b / scale:.3f}" if unit == "GiB" else f"{b / scale:.1f}"
ANCHOR_NAME = "h200_torch_single_E32.json"
DEFAULT_ANCHOR = importlib.resources.files(__package__).joinpath(ANCHOR_NAME)
"""Plain torch on one H200 (gpt2-ish, S=512, E=32), shipped inside the package so an installed verify
finds it too."""
XTRAIN = "xtrain"
MODE_TRAINERS = {"torch_ddp": "verify.adapters.xtrain:torch_ddp", "fsdp2": "verify.adapters.xtrain:fsdp2",
                 "fsdp2_keep": "verify.adapters.xtrain:fsdp2_keep"}
"""Short --trainer names of the other data-parallel modes of xtrain's GPT (verify/memory/model.py knows them)."""


@dataclass
class Config:
    N: int
    B: int
    sweeps: tuple[str, ...]


@dataclass
class Plan:
    E: int
    world: int
    rank: int
    device: Any  # torch.device
    adapter: Any  # verify.protocol.Adapter
    trainer: str
    """--trainer as given: xtrain, a planted bug's name, or MODULE:FACTORY."""
    options: Any
    """Spec.options of every configuration: XtrainOptions built from --model/--seq-len for adapters of
    xtrain's options, else the adapter's own defaults."""
    steps: int
    threads: int
    out: Path
    anchor: Any  # Path or importlib.resources Traversable, or None
    model_name: str | None = None
    warmup: int = 1
    """Warm-up optimizer steps before the probe: 1 in one process (the anchor's protocol), 2 under torchrun
    (torch DDP rebuilds its gradient buckets in the forward of its second iteration)."""
    configs: list[Config] = field(default_factory=list)

    @property
    def E_local(self) -> int:
        return self.E // self.world

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def model(self) -> ModelConfig | None:
        """The GPT's config when the options are xtrain's, else None (the model is the adapter's business)."""
        return getattr(self.options, "model", None) if self.model_name is not None else None

    @property
    def seq_len(self) -> int | None:
        return self.options.seq_len if self.model_name is not None else None


def plan_configs(e_local: int) -> list[Config]:
    """Sweep A (N | E, B = E/N, ascending N), then sweep B (B = 1, N = 1, 2, 4, ... ≤ E); shared ones once."""
    a = [(n, e_local // n) for n in range(1, e_local + 1) if e_local % n == 0]
    b, n = [], 1
    while n <= e_local:
        b.append((n, 1))
        n *= 2
    out = [Config(n, bb, ("A", "B") if (n, bb) in b else ("A",)) for n, bb in a]
    out += [Config(n, bb, ("B",)) for n, bb in b if (n, bb) not in a]
    return out


def trainer_names() -> list[str]:
    from ..adapters.broken import MEMORY_BROKEN

    return [XTRAIN, *MODE_TRAINERS, *sorted(MEMORY_BROKEN)]


def resolve_adapter(name: str, flag: str = "--trainer"):
    """'xtrain' (verify.adapters.xtrain:adapter), torch_ddp / fsdp2 / fsdp2_keep (MODE_TRAINERS), a planted memory bug (verify.adapters.broken.MEMORY_BROKEN)
    or 'MODULE:FACTORY' naming an Adapter. AdapterError with a one-line reason naming `flag`."""
    from ..protocol import DEFAULT_REF, AdapterError, load_adapter

    if name == XTRAIN:
        return load_adapter(DEFAULT_REF, option=flag)
    if name in MODE_TRAINERS:
        return load_adapter(MODE_TRAINERS[name], option=flag)
    if ":" not in name:
        from ..adapters.broken import MEMORY_BROKEN

        if name in MEMORY_BROKEN:
            return MEMORY_BROKEN[name]
        raise AdapterError(f"{flag} {name}: unknown trainer; use one of {', '.join(trainer_names())} or "
                           f"MODULE:FACTORY naming an adapter (e.g. mypkg.train:adapter)")
    return load_adapter(name, option=flag)


def _options(adapter, args, cuda: bool, flag: str):
    """(options, model_name): XtrainOptions from --model/--seq-len for adapters of xtrain's options (their
    defaults are an XtrainOptions), else the adapter's defaults; --model/--seq-len are then an error."""
    from xtrain_core.config import OptimConfig

    from ..adapters.xtrain import XtrainOptions

    if not isinstance(adapter.defaults, XtrainOptions):
        given = [f for f, v in (("--model", args.model), ("--seq-len", args.seq_len)) if v is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to xtrain's trainer only; "
                             f"{flag} {args.trainer} ({adapter.name}) is measured with its adapter's defaults")
        return adapter.defaults, None
    model_name = args.model or ("gpt2-ish" if cuda else "small")
    model = PRESETS[model_name]
    seq = args.seq_len or model.seq_len
    if seq > model.seq_len:
        raise UsageError(f"--seq-len {seq} exceeds --model {model_name}'s limit of {model.seq_len}; "
                         f"pass --seq-len ≤ {model.seq_len}")
    return XtrainOptions(model=model, seq_len=seq, optim=OptimConfig()), model_name


def _device(name: str, world: int):
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local if world > 1 else 0)
        return torch.device("cpu")  # the CLI says so once the flags are known to be valid
    device = resolve_device(name)
    if device.type == "cuda" and world > 1:
        return torch.device("cuda", local)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def build_plan(args) -> Plan:
    """Flags -> Plan, or UsageError naming the flag. Runs nothing."""
    import pickle

    import torch

    from ..protocol import AdapterError

    flag = getattr(args, "trainer_flag", None) or "--trainer"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = _device(args.device, world)
    E = args.effective_batch
    if E % world:
        raise UsageError(f"--effective-batch {E} is not divisible by the world size {world}; E = N × B × world")
    try:
        adapter = resolve_adapter(args.trainer, flag)
        adapter.locate()  # the CPU probe processes import it by this reference
    except AdapterError as e:
        raise UsageError(str(e)) from None
    options, model_name = _options(adapter, args, device.type == "cuda", flag)
    if device.type == "cpu":
        try:
            pickle.dumps(options)
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"{flag} {args.trainer}: the adapter's defaults cannot be pickled for the probe "
                             f"processes ({type(e).__name__}: {e})") from None
    anchor = Path(args.anchor) if args.anchor else (DEFAULT_ANCHOR if DEFAULT_ANCHOR.is_file() else None)
    if args.anchor and not anchor.is_file():
        raise UsageError(f"--anchor {args.anchor}: no such file")
    out = Path(args.out)
    if rank == 0:
        writable_dir("--out", args.out)
    plan = Plan(E=E, world=world, rank=rank, device=device, adapter=adapter, trainer=args.trainer, options=options,
                model_name=model_name, steps=args.steps or (3 if device.type == "cuda" else 1),
                warmup=args.warmup or (2 if world > 1 else 1),
                threads=args.threads or torch.get_num_threads(), out=out, anchor=anchor)
    plan.configs = plan_configs(plan.E_local)
    return plan
