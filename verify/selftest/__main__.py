"""python -m verify.selftest [--verify-trainer MODULE:FACTORY] [--verify-report DIR]
                          [--verify-backend gloo|nccl] [--verify-device cpu|cuda] [--max-world W]
                          [--every-case]

Plants each fault operator (verify.selftest.operators) in your trainer, runs the gates on every mutant
until one rejects it (--every-case: on every case), prints operator × gate with verdicts and the mutation
score (kills by a gate only), and adds the table to DIR/verify-report.{json,md}. Exit status: 0 every operator
killed and the unwrapped trainer passes; 1 an operator survived where its bug can exist or the unwrapped trainer
fails a gate; 2 bad input; 3 a run raised instead of reaching a verdict (the trainer, its factory or data maker,
a pool job or its timeout: an "error" cell, its cause printed below the table, never counted as a kill).
"""
from __future__ import annotations

import os
import sys

from verify._internal.cli import Parser, Progress, fail, positive_int


def parse_args(argv=None):
    from verify._internal.settings import Settings, env_of

    d = Settings()  # the defaults, for the help
    p = Parser(prog="verify.selftest", description=__doc__.split("\n\n")[1])
    p.add_argument("--verify-trainer", metavar="MODULE:FACTORY", default=None,
                   help="the adapter to test (default: the configured default trainer, xtrain's)")
    p.add_argument("--verify-report", metavar="DIR", default="reports",
                   help="directory of verify-report.json/.md (default ./reports)")
    p.add_argument("--verify-backend", metavar="gloo|nccl", default=None,
                   help=f"process-group backend for the data-parallel cases (default ${env_of('backend')}, else nccl "
                        f"on cuda and gloo on the cpu)")
    p.add_argument("--verify-device", metavar="cpu|cuda", default=None,
                   help=f"device (default ${env_of('device')} or {d.device})")
    p.add_argument("--max-world", type=positive_int, default=None,
                   help=f"largest world of the data-parallel cases (default: every world the gates draw, "
                        f"{env_of('min_world')}..{env_of('max_world')}, {d.min_world}..{d.max_world})")
    p.add_argument("--every-case", action="store_true",
                   help="run every gate on every case where an operator's bug exists (the whole operator × gate "
                        "matrix); by default a mutant stops at the first gate that rejects it")
    return p.parse_args(argv)


def max_world_bound(s) -> tuple[int, str]:
    """The largest --max-world this box runs, and why: the worlds the self-test has cases for (DIST), the
    gates' largest world (XTRAIN_DIST_MAX_WORLD), and under NCCL the GPUs."""
    from verify.selftest import DIST

    bound, why = max(DIST), f"the self-test has data-parallel cases for worlds 1..{max(DIST)}"
    cap = s.world_cap()
    if cap < bound:
        gpus = s.backend == "nccl" and cap < s.max_world
        bound, why = cap, (f"nccl has {cap} GPU(s) here" if gpus else f"{s.where('max_world')} (worlds the gates draw)")
    return bound, why


def main(argv=None) -> int:
    args = parse_args(argv)
    from verify._internal.protocol import AdapterError, load_adapter
    from verify._internal.settings import Settings, SettingError, check_report_dir, install
    from verify._internal.trainers import trainer_ref

    try:  # every option checked here, before anything runs or is written
        s = Settings.from_env(device=args.verify_device, backend=args.verify_backend)
        s.check_machine()
        check_report_dir(args.verify_report, "--verify-report")
        if args.max_world is not None:
            bound, why = max_world_bound(s)
            if args.max_world > bound:
                fail(f"--max-world {args.max_world}: {why}; pass --max-world ≤ {bound}")
        args.verify_trainer = trainer_ref(args.verify_trainer)
        adapter = load_adapter(args.verify_trainer)
        adapter.check_factory(s.device)
    except (SettingError, AdapterError) as e:
        fail(str(e))
    out, device = os.path.abspath(args.verify_report), s.device
    install(s)  # this process's Settings: its pools (and their ranks, pickled) and strategies read these
    s.setup_device()
    import torch

    if adapter.defaults is None and adapter.options is not None:
        fail(f"--verify-trainer {args.verify_trainer}: the adapter draws options but declares no defaults; "
             f"give it defaults= for the self-test's fixed cases")
    torch.set_num_threads(s.threads)
    from verify.selftest import run_selftest

    bar = Progress(1, label="selftest ")

    def progress(done, total, what):
        bar.total = total
        bar.update(done, what)

    try:
        res = run_selftest(adapter, max_world=args.max_world, device=device, progress=progress,
                           every_case=args.every_case)
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    finally:
        from verify._internal.ranks.pool import close_all

        close_all()
    from verify.selftest import _short

    listed = [_short(c, i >= res.n_single) for i, c in enumerate(res.cases)]
    print(f"self-test of {res.trainer}: {len(res.cases)} cases ({', '.join(listed)})"
          + (f"; data-parallel at worlds {res.worlds}" if res.worlds else "")
          + (f"; on {', '.join(res.meshes)}" if res.meshes else ""))
    print(res.table())
    for line in res.error_lines():  # each distinct cause once: the table's cells say only "error"
        print(line)
    d = res.as_dict()
    print(f"mutation score {res.score} in {res.seconds:.0f} s: {d['verdict']}")
    from verify._internal import report

    replaced = report.replaces(out, res.trainer)
    paths = report.write(out, trainer=res.trainer, settings=dict(device=device, selftest_worlds=res.worlds,
                                                                     **({"selftest_meshes": res.meshes} if res.meshes else {})),
                         selftest=d, device=device, declarations=adapter.declarations())
    print("wrote " + ", ".join(paths) + (f"; they replaced {replaced} (--verify-report DIR keeps one per trainer)"
                                        if replaced else ""))
    return res.exit_code


if __name__ == "__main__":
    sys.exit(main())
