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
For the trainers whose data-parallel mode verify/memory/model.py knows (xtrain, torch_ddp, fsdp2,
fsdp2_keep; xtrain alone is AccumTrainer) every configuration also gets a PREDICTED peak of the same
quantity the probe measures, and the ratio measured/predicted (reported; exit 1 only if absurd).
Writes OUT/memory-E{E}.json, .md and .png (atomically, all or none). Exit status: 0 PASS, 1 FAIL (an
invariant fails), 3 INCONCLUSIVE (an invariant cannot be decided at this size: the output says how to make
it decidable), 2 bad input. The invariants:

  (a) fixed E: peak does not grow as N grows; peak(N=E, B=1) is well below peak(N=1, B=E)
  (b) fixed B: peak is flat within 2% for N >= 2; peak(N=2) - peak(N=1) <= the gradient buffers

The trainer is any adapter (verify.protocol.Adapter): its data, its model. --model and --seq-len set
xtrain's options (adapters whose defaults are verify.adapters.xtrain.XtrainOptions); any other adapter
is measured with its own defaults. Under torchrun each rank measures its own process/device; rank 0
writes the report with per-rank peaks. Thresholds and what each figure includes: docs/design.md,
"Peak memory".
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from xtrain_core.cli import Parser, UsageError, fail, int_at_least, positive_int
from xtrain_core.config import PRESETS

from .plan import ANCHOR_NAME, Plan, build_plan


# Sweep A measures N = 1, B = E: all E rows in ONE micro-batch, so E is bounded as a micro-batch is, by the
# largest one a run can meet (xtrain's MAX_MICRO_BATCH; tests/test_settings.py holds them equal). Checked at
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
                   help=f"plain-torch anchor JSON (default: {ANCHOR_NAME}, shipped inside verify/memory/)")
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


def _activations(plan: Plan):
    """(activations per B, None) for the memory model, or (None, a one-line reason): a prediction is reported,
    so failing to measure its input never fails the run."""
    from . import model as mm
    from .probes import one_line
    from .runners import activations

    if plan.model is None or mm.mode_of(plan.adapter.locate(), plan.world) is None:
        return None, None
    try:
        return activations(plan), None
    except Exception as e:  # noqa: BLE001
        return None, f"activations not measured: {one_line(e)}"


def _report(plan: Plan, per_rank, argv, t0) -> dict:
    from . import model as mm
    from . import report as rep
    from .invariants import check_invariants
    from .runners import nvml_status

    verdicts = check_invariants(per_rank, E_local=plan.E_local, cuda=plan.cuda)
    nvml = nvml_status(plan)[1] if plan.cuda else None
    report = rep.assemble(plan, per_rank, verdicts, nvml=nvml)
    mm.add_predictions(report, plan, *_activations(plan))
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
        rows = run_sweeps(plan)
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


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo's teardown at interpreter exit sometimes aborts the process after a clean run; the group is
        # already destroyed and the report written, so leave without running it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
