"""python -m verify.memory --effective-batch E [--device auto|cpu|cuda|cuda:K]
                        [--trainer xtrain|torch_ddp|fsdp2|fsdp2_keep|leaky_graph|MODULE:FACTORY]
                        [--model tiny|small|gpt2-ish] [--seq-len S] [--steps K] [--warmup K] [--out DIR]
                        [--threads T] [--anchor JSON]

Measures the peak memory of gradient accumulation and checks that it follows ONE micro-batch, not N.

  sweep A  fixed effective batch E: every N dividing E, with B = E/N
  sweep B  fixed micro-batch B = 1: N = 1, 2, 4, 8, ... up to E

Each configuration is isolated: on the CPU a fresh process per configuration (peak RSS above the RSS
right before the measured steps); on a GPU one process with a full allocator reset between
configurations (torch's max allocated/reserved, plus NVML device memory used sampled by a thread).
For an adapter that declares a memory model (Adapter(predicted_peak=...); xtrain's trainers do:
verify/adapters/xtrain_memory.py) every configuration also gets a PREDICTED peak of the same quantity the
probe measures, and the ratio measured/predicted (reported; exit 1 only if absurd).
Writes OUT/memory-E{E}.json, .md and .png (atomically, all or none). Exit status: 0 PASS, 1 FAIL (an
invariant fails), 3 INCONCLUSIVE (an invariant cannot be decided at this size: the output says how to make
it decidable), 2 bad input. The invariants:

  (a) fixed E: peak does not grow as N grows; peak(N=E, B=1) is well below peak(N=1, B=E)
  (b) fixed B: peak is flat within 2% for N >= 2; peak(N=2) - peak(N=1) <= the gradient buffers

The trainer is any adapter (verify.protocol.Adapter): its data, its model. --model and --seq-len set
xtrain's options (adapters whose defaults are verify.adapters.xtrain.XtrainOptions); any other adapter
is measured with its own defaults. This entry point is xtrain's wing (its default trainer, the short
names, --model/--seq-len and the H200 anchor are xtrain's); the library under it (plan, runners, probes,
invariants, prediction, anchor, report) knows no trainer. Under torchrun each rank measures its own process/device; rank 0
writes the report with per-rank peaks. Thresholds and what each figure includes: docs/design.md,
"Peak memory".
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from pathlib import Path

from xtrain_core.cli import resolve_device
from xtrain_core.config import PRESETS

from .._cli import Parser, Progress, UsageError, fail, int_at_least, positive_int, writable_dir
from ..adapters.xtrain_memory import ANCHOR, ANCHOR_NAME, anchor_applies
from .plan import Plan, plan_configs

MODE_TRAINERS = {"xtrain": "verify.adapters.xtrain:adapter", "torch_ddp": "verify.adapters.xtrain:torch_ddp",
                 "fsdp2": "verify.adapters.xtrain:fsdp2", "fsdp2_keep": "verify.adapters.xtrain:fsdp2_keep"}
"""Short --trainer names of the data-parallel modes of xtrain's GPT (benchmarks/memory_modes.py runs each)."""
ANCHOR_NOTE = ("plain torch on one H200, no xtrain code: the same GPT, fp32 with TF32 off, one warm-up step then 3 measured "
               "steps, AdamW(fused=True)")


# Sweep A measures N = 1, B = E: all E rows in ONE micro-batch, so E is bounded as a micro-batch is, by the
# largest one a run can meet (xtrain's MAX_MICRO_BATCH; tests/harness/test_settings.py holds them equal). Checked at
# parsing: the sweeps' plan enumerates E's divisors, which for an absurd E would never end.
MAX_E = 2**16


class _Trainer(argparse.Action):
    """--trainer / --verify-trainer (one destination): remembers the spelling, for the error messages."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.trainer_flag = option_string


def parse_args(argv=None):
    p = Parser(prog="verify.memory", description=__doc__.split("\n\n")[1],
               epilog="Exit status: 0 PASS (all invariants hold), 1 FAIL (one fails), 3 INCONCLUSIVE (one cannot be "
                      "decided at this size; not a failure), 2 bad input.")
    p.add_argument("--effective-batch", type=int_at_least(1, MAX_E), default=32, metavar="E",
                   help=f"E: rows (sequences) per optimizer step, over all ranks (default 32; ≤ {MAX_E}: "
                        f"sweep A runs all E rows as one micro-batch)")
    p.add_argument("--device", default="auto", help="auto (cuda if visible, else cpu), cpu, cuda or cuda:K")
    p.add_argument("--trainer", "--verify-trainer", dest="trainer", action=_Trainer, default="xtrain",
                   metavar="NAME|MODULE:FACTORY",
                   help="trainer to measure: xtrain (default: verify.adapters.xtrain:adapter), torch_ddp, fsdp2, "
                        "fsdp2_keep (xtrain's GPT under torch DDP no_sync / FSDP2, verify.adapters.xtrain:NAME), "
                        "leaky_graph (a planted memory bug, verify/adapters/broken.py), or MODULE:FACTORY naming an adapter")
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="xtrain's trainer only: model preset (default: small on cpu, gpt2-ish on cuda, the anchor's model)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="xtrain's trainer only: S (default: the model's limit)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="measured optimizer steps per configuration, after the warm-up (default: cpu 1, cuda 3 as the anchor)")
    p.add_argument("--warmup", type=positive_int, default=None, metavar="K",
                   help="warm-up optimizer steps before the measured ones (default: 1 in one process, as the anchor; "
                        "2 under torchrun: torch DDP rebuilds its gradient buckets in its second iteration)")
    p.add_argument("--out", default="reports", help="directory for memory-E{E}.json/.md/.png (default reports/)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU intra-op threads (default: torch's)")
    p.add_argument("--anchor", default=None,
                   help=f"plain-torch anchor JSON (default: {ANCHOR_NAME}, shipped inside verify/adapters/; "
                        "applies to xtrain's gpt2-ish GPT at S=512, E=32 on one GPU)")
    p.set_defaults(trainer_flag="--trainer")
    return p.parse_args(argv)


def _usage_fail(msg: str, rank: int):
    if rank == 0:
        fail(msg)
    raise SystemExit(2)


def _init_dist(plan: Plan):
    import torch
    import torch.distributed as dist

    if plan.world > 1 and not dist.is_initialized():
        if plan.cuda:
            torch.cuda.set_device(plan.device)
        dist.init_process_group("nccl" if plan.cuda else "gloo")


def _report(plan: Plan, per_rank, argv, t0) -> dict:
    from . import report as rep
    from .invariants import check_invariants
    from .prediction import add_predictions
    from .runners import nvml_status

    verdicts = check_invariants(per_rank, E_local=plan.E_local, cuda=plan.cuda)
    nvml = nvml_status(plan)[1] if plan.cuda else None
    report = rep.assemble(plan, per_rank, verdicts, nvml=nvml)
    add_predictions(report, plan)
    report["wall_s"] = time.perf_counter() - t0
    report["command"] = "python -m verify.memory " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if report["anchor"] is not None:
        report["anchor"]["verdict"] = "PASS" if all(t["status"] == "PASS" for t in report["anchor"]["targets"]) else "FAIL"
    report["verdict"] = rep.overall(report)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        plan = build_plan(args)
    except UsageError as e:
        _usage_fail(str(e), rank)
    if args.device == "auto" and not plan.cuda and rank == 0:
        print("verify.memory: no CUDA GPU visible to torch; measuring the CPU path "
              "(a fresh process per configuration)", file=sys.stderr, flush=True)
    from . import report as rep
    from .runners import dist_or_none, run_sweeps

    try:
        _init_dist(plan)
        t0 = time.perf_counter()
        rows = run_sweeps(plan, Progress(len(plan.configs), label="memory "))
        dist = dist_or_none()
        if dist is not None:
            per_rank = [None] * plan.world
            dist.all_gather_object(per_rank, rows)
        else:
            per_rank = [rows]
        code = 0
        if plan.rank == 0:
            report = _report(plan, per_rank, argv, t0)
            paths = rep.write_all(report, plan.out)
            print(rep.text_table(report), flush=True)
            print("wrote " + ", ".join(str(p) for p in paths), flush=True)
            code = rep.EXIT_CODES[report["verdict"]]
        if dist is not None:
            box = [code]
            dist.broadcast_object_list(box, src=0)
            code = box[0]
            dist.barrier()
            dist.destroy_process_group()
        return code
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except UsageError as e:
        _usage_fail(str(e), rank)


# -- flags -> Plan: xtrain's names, options and anchor ---------------------------------------------

def trainer_names() -> list[str]:
    from ..adapters.broken import MEMORY_BROKEN

    return [*MODE_TRAINERS, *sorted(MEMORY_BROKEN)]


def resolve_adapter(name: str, flag: str = "--trainer"):
    """'xtrain' (verify.adapters.xtrain:adapter), torch_ddp / fsdp2 / fsdp2_keep (MODE_TRAINERS), a planted
    memory bug (verify.adapters.broken.MEMORY_BROKEN)
    or 'MODULE:FACTORY' naming an Adapter. AdapterError with a one-line reason naming `flag`."""
    from ..protocol import AdapterError, load_adapter

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

    from ..adapters.xtrain_options import XtrainOptions

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
    anchor = Path(args.anchor) if args.anchor else (ANCHOR if ANCHOR.is_file() else None)
    if args.anchor and not anchor.is_file():
        raise UsageError(f"--anchor {args.anchor}: no such file")
    if model_name is None or not anchor_applies(options, E=E, world=world, cuda=device.type == "cuda"):
        anchor = None  # the anchor is xtrain's GPT in one setting: nothing to compare elsewhere
    out = Path(args.out)
    if rank == 0:
        writable_dir("--out", args.out)
    model = None if model_name is None else options.model
    plan = Plan(E=E, world=world, rank=rank, device=device, adapter=adapter, trainer=args.trainer, options=options,
                model_name=model_name, model=None if model is None else model.__dict__.copy(),
                seq_len=None if model is None else options.seq_len, n_params=None if model is None else model.n_params,
                sources=("xtrain_core", "verify"), steps=args.steps or (3 if device.type == "cuda" else 1),
                warmup=args.warmup or (2 if world > 1 else 1),
                threads=args.threads or torch.get_num_threads(), out=out, anchor=anchor, anchor_note=ANCHOR_NOTE)
    plan.configs = plan_configs(plan.E_local)
    return plan


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo's teardown at interpreter exit sometimes aborts the process after a clean run; the group is
        # already destroyed and the report written, so leave without running it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
