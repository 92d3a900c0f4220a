"""python -m verify.memory --effective-batch E [--device auto|cpu|cuda|cuda:K] [--trainer NAME|MODULE:FACTORY]
                        [--model M] [--seq-len S] [--steps K] [--warmup K] [--sweep full|ends] [--out DIR]
                        [--threads T] [--anchor JSON]

Measures the peak memory of gradient accumulation and checks that it follows ONE micro-batch, not N: sweep A
at fixed effective batch E (every N dividing E, B = E/N), sweep B at fixed B = 1 (N = 1, 2, 4, ... up to E),
each configuration isolated; an adapter's memory model (MemoryModel(predicted_peak=...)) is reported beside.
Writes OUT/memory-E{E}.json, .md and .png. Exit status: 0 PASS, 1 FAIL (an invariant fails, or an absurd
prediction), 3 INCONCLUSIVE (not decidable at this size), 2 bad input. A trainer family extends this command line
with a `Wing` (xtrain's: xtrain_proof/memory.py). Invariants, thresholds, isolation: docs/design/memory.md.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from verify._internal.cli import (Parser, Progress, UsageError, check_fits, fail, int_at_least, positive_int, resolve_device, writable_dir)
from verify._internal.settings import launcher_var
from verify.memory.plan import SWEEPS, Plan, plan_configs

# What a wing (a trainer family's flags and options) and a sweep over this command line (benchmarks/memory_modes.py)
# use: the Wing itself, and the plumbing that makes their bad input one line and exit status 2, as this command's.
__all__ = ["Wing", "main", "UsageError", "Parser", "fail", "positive_int", "writable_dir"]


@dataclass(frozen=True)
class Wing:
    """What a trainer family adds to the command line (xtrain's: xtrain_proof.memory.WING). Every
    field is optional: without a wing, --trainer MODULE:FACTORY is measured with its adapter's defaults."""

    trainers: dict = field(default_factory=dict)
    """short --trainer name -> an Adapter or its 'MODULE:FACTORY' reference"""
    default: str | None = None
    """the --trainer default (a short name or a reference); None: --trainer is required"""
    trainer_help: str = ""
    flags: Callable | None = None
    """flags(parser): adds the wing's own flags"""
    options: Callable | None = None
    """options(adapter, args, cuda, flag) -> (Spec.options, model or None): the options its flags build, and
    what the report says of the model (dict: name, config, text, seq_len, n_params); UsageError for a flag
    that does not apply"""
    anchor: Callable | None = None
    """anchor(options, E=, world=, cuda=) -> (default anchor path or None, applies: bool, note)"""
    anchor_help: str = ""
    sources: tuple[str, ...] = ("verify",)
    """packages whose source the report's sources_sha256 covers (with the adapter's own module)"""


# Sweep A measures N = 1, B = E: all E rows in ONE micro-batch, so E is bounded as a micro-batch is, by the
# largest one a run can meet (xtrain's MAX_MICRO_BATCH; tests/harness/test_settings.py holds them equal). Checked at
# parsing: the sweeps' plan enumerates E's divisors, which for an absurd E would never end.
MAX_E = 2**16


class _Trainer(argparse.Action):
    """--trainer / --verify-trainer (one destination): remembers the spelling, for the error messages."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.trainer_flag = option_string


def parse_args(argv=None, wing: Wing | None = None):
    wing = wing or Wing()
    p = Parser(prog="verify.memory", description=__doc__.split("\n\n")[1],
               epilog="Exit status: 0 PASS (all invariants hold), 1 FAIL (one fails), 3 INCONCLUSIVE (one cannot be "
                      "decided at this size; not a failure), 2 bad input.")
    p.add_argument("--effective-batch", type=int_at_least(1, MAX_E), default=32, metavar="E",
                   help=f"E: rows (sequences) per optimizer step, over all ranks (default 32; ≤ {MAX_E}: "
                        f"sweep A runs all E rows as one micro-batch)")
    p.add_argument("--device", default="auto", help="auto (cuda if visible, else cpu), cpu, cuda or cuda:K")
    p.add_argument("--trainer", "--verify-trainer", dest="trainer", action=_Trainer, default=wing.default,
                   metavar="NAME|MODULE:FACTORY" if wing.trainers else "MODULE:FACTORY",
                   help="trainer to measure: " + (wing.trainer_help or "MODULE:FACTORY naming an adapter"))
    if wing.flags is not None:
        wing.flags(p)
    p.add_argument("--steps", type=positive_int, default=None,
                   help="measured optimizer steps per configuration, after the warm-up (default: cpu 1, cuda 3 as the anchor)")
    p.add_argument("--warmup", type=positive_int, default=None, metavar="K",
                   help="warm-up optimizer steps before the measured ones (default: 1 in one process, as the anchor; "
                        "2 under torchrun: torch DDP rebuilds its gradient buckets in its second iteration)")
    p.add_argument("--sweep", choices=SWEEPS, default="full",
                   help="full: every N dividing E and every power of two (default); ends: N = 1, 2 and E of each "
                        "sweep, five runs however large E is (a production-size trainer: see verify.gpu_gate --scale)")
    p.add_argument("--out", default="reports", help="directory for memory-E{E}.json/.md/.png (default reports/)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU intra-op threads (default: torch's)")
    p.add_argument("--anchor", default=None,
                   help="plain-torch anchor JSON" + (f" (default: {wing.anchor_help})" if wing.anchor_help else ""))
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
    from verify.memory import report as rep
    from verify.memory.invariants import check_invariants
    from verify.memory.prediction import add_predictions
    from verify.memory.runners import nvml_status

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


def main(argv=None, wing: Wing | None = None) -> int:
    """The command line: `python -m verify.memory` is main(wing=xtrain's)."""
    wing = wing or Wing()
    args = parse_args(argv, wing)
    rank = int(launcher_var("RANK", "0"))
    try:
        plan = build_plan(args, wing)
    except UsageError as e:
        _usage_fail(str(e), rank)
    if args.device == "auto" and not plan.cuda and rank == 0:
        print("verify.memory: no CUDA GPU visible to torch; measuring the CPU path "
              "(a fresh process per configuration)", file=sys.stderr, flush=True)
    from verify.memory import report as rep
    from verify.memory.runners import dist_or_none, run_sweeps

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


# -- flags -> Plan -----------------------------------------------------------------------------------

def resolve_adapter(name: str, wing: Wing, flag: str = "--trainer"):
    """A short name of the wing, or 'MODULE:FACTORY' naming an Adapter. AdapterError with a one-line reason
    naming `flag`."""
    from verify._internal.protocol import Adapter, AdapterError, load_adapter

    if name in wing.trainers:
        a = wing.trainers[name]
        return a if isinstance(a, Adapter) else load_adapter(a, option=flag)
    if ":" not in name:
        names = f"one of {', '.join(wing.trainers)} or " if wing.trainers else ""
        raise AdapterError(f"{flag} {name}: unknown trainer; use {names}MODULE:FACTORY naming an adapter "
                           f"(e.g. mypkg.train:adapter)")
    return load_adapter(name, option=flag)


def _device(name: str, world: int):
    import torch

    local = int(launcher_var("LOCAL_RANK", "0"))
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local if world > 1 else 0)
        return torch.device("cpu")  # the CLI says so once the flags are known to be valid
    device = resolve_device(name)  # one rule with xtrain's CLI (verify/_internal/cli.py)
    if device.type == "cuda" and world > 1:
        return torch.device("cuda", local)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_fits(adapter, options, e_local: int, world: int, device) -> None:
    """Before anything is measured or written: sweep A's largest configuration (N=1, B=E per rank) estimated
    from the adapter's own memory model at B=1 and B=2, extrapolated linearly in B (activations and logits
    grow with the rows, the parameters and optimizer state do not), against the device's available memory.
    Without a model, or where it declines, nothing is estimated (the run goes ahead as before)."""
    if adapter.predicted_peak is None or e_local <= 2:
        return
    from verify.memory.prediction import PeakQuery, Prediction

    q = PeakQuery(adapter=adapter, options=options, configs=((1, 1), (1, 2)), world=world, device=device,
                  probe="cuda", trainer_class=None)  # "cuda": every tensor, the parameters included
    if device.type == "cuda":  # the peaks are measured in this process: the model's estimate runs in its own
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            p = child.submit(_predict, adapter, q).result()
    else:  # the CPU probe measures each configuration in a fresh process
        p = adapter.predicted_peak(q)
    if not isinstance(p, Prediction):
        return
    one, two = p.peaks[(1, 1)]["bytes"], p.peaks[(1, 2)]["bytes"]
    check_fits(one + (e_local - 1) * max(0, two - one), device,
               f"--effective-batch {e_local * world} (sweep A runs N=1, B={e_local}{' per rank' if world > 1 else ''})",
               f"pass a smaller --effective-batch (the adapter's memory model, {p.mode}, at B=1 and 2, linear in B)")


def _predict(adapter, query):
    """adapter.predicted_peak(query), in a child process: whatever it allocates on the GPU leaves with it."""
    return adapter.predicted_peak(query)


def build_plan(args, wing: Wing | None = None) -> Plan:
    """Flags -> Plan, or UsageError naming the flag. Runs nothing."""
    import pickle

    import torch

    from verify._internal.protocol import AdapterError

    wing = wing or Wing()
    flag = getattr(args, "trainer_flag", None) or "--trainer"
    if args.trainer is None:
        raise UsageError("--trainer MODULE:FACTORY is required: name the adapter to measure (e.g. mypkg.train:adapter)")
    world = int(launcher_var("WORLD_SIZE", "1"))
    rank = int(launcher_var("RANK", "0"))
    device = _device(args.device, world)
    E = args.effective_batch
    if E % world:
        raise UsageError(f"--effective-batch {E} is not divisible by the world size {world}; E = N × B × world")
    try:
        adapter = resolve_adapter(args.trainer, wing, flag)
        adapter.locate()  # the CPU probe processes import it by this reference
    except AdapterError as e:
        raise UsageError(str(e)) from None
    options, model = (wing.options(adapter, args, device.type == "cuda", flag) if wing.options
                      else (adapter.defaults, None))
    if device.type == "cpu":
        try:
            pickle.dumps(options)
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"{flag} {args.trainer}: the adapter's defaults cannot be pickled for the probe "
                             f"processes ({type(e).__name__}: {e})") from None
    default, applies, note = wing.anchor(options, E=E, world=world, cuda=device.type == "cuda") if wing.anchor \
        else (None, args.anchor is not None, "")
    anchor = Path(args.anchor) if args.anchor else default
    if args.anchor and not anchor.is_file():
        raise UsageError(f"--anchor {args.anchor}: no such file")
    if not applies:
        anchor = None  # an anchor is one model in one setting: nothing to compare elsewhere
    _check_fits(adapter, options, E // world, world, device)
    out = Path(args.out)
    if rank == 0:
        writable_dir("--out", args.out)
    model = model or {}
    plan = Plan(E=E, world=world, rank=rank, device=device, adapter=adapter, trainer=args.trainer, options=options,
                model_name=model.get("name"), model=model.get("config"), model_text=model.get("text"),
                seq_len=model.get("seq_len"),
                n_params=model.get("n_params"), sources=wing.sources,
                steps=args.steps or (3 if device.type == "cuda" else 1), warmup=args.warmup or (2 if world > 1 else 1),
                threads=args.threads or torch.get_num_threads(), out=out, anchor=anchor, anchor_note=note,
                sweep=args.sweep)
    plan.configs = plan_configs(plan.E_local, plan.sweep)
    return plan

