"""python -m verify.selftest [--verify-trainer MODULE:FACTORY] [--verify-report DIR]
                          [--verify-backend gloo|nccl] [--verify-device cpu|cuda] [--max-world W]

Plants each fault operator (verify.selftest.operators) in your trainer, runs the gates on every mutant,
prints operator × gate with verdicts and the mutation score, and adds the table to
DIR/verify-report.{json,md}. Exit status: 0 every operator killed and the unwrapped trainer passes,
1 an operator survived where its bug can exist or the unwrapped trainer fails a gate, 2 bad input.
"""
from __future__ import annotations

import os
import sys

from .._cli import Parser, Progress, fail, positive_int


def parse_args(argv=None):
    p = Parser(prog="verify.selftest", description=__doc__.split("\n\n")[1])
    p.add_argument("--verify-trainer", metavar="MODULE:FACTORY", default="verify.adapters.xtrain:adapter",
                   help="the adapter to test (default: xtrain's trainer)")
    p.add_argument("--verify-report", metavar="DIR", default="reports",
                   help="directory of verify-report.json/.md (default ./reports)")
    p.add_argument("--verify-backend", choices=("gloo", "nccl"), default=None,
                   help="process-group backend for the data-parallel cases (default gloo)")
    p.add_argument("--verify-device", choices=("cpu", "cuda"), default=None, help="device (default cpu)")
    p.add_argument("--max-world", type=positive_int, default=None,
                   help="largest world of the data-parallel cases (default: every world the gates draw, "
                        "XTRAIN_DIST_MIN_WORLD..XTRAIN_DIST_MAX_WORLD, 1..4)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.verify_report)
    if os.path.exists(out) and not os.path.isdir(out):
        fail(f"--verify-report {args.verify_report}: exists and is not a directory; pass a directory")
    if args.verify_backend:
        os.environ["XTRAIN_DIST_BACKEND"] = args.verify_backend
    device = args.verify_device or os.environ.get("XTRAIN_TEST_DEVICE", "cpu")
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            fail("--verify-device cuda: no CUDA GPU is visible to torch; use --verify-device cpu")
        os.environ["XTRAIN_TEST_DEVICE"] = "cuda"
        if not args.verify_backend:
            os.environ["XTRAIN_DIST_BACKEND"] = "nccl"
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        from .._meta import fp32_only

        fp32_only()
    from ..protocol import AdapterError, load_adapter

    try:
        adapter = load_adapter(args.verify_trainer)
    except AdapterError as e:
        fail(str(e))
    if adapter.defaults is None and adapter.options is not None:
        fail(f"--verify-trainer {args.verify_trainer}: the adapter draws options but declares no defaults; "
             f"give it defaults= for the self-test's fixed cases")
    torch.set_num_threads(int(os.environ.get("XTRAIN_TEST_THREADS", "1")))
    from . import run_selftest

    bar = Progress(1, label="selftest ")

    def progress(done, total, what):
        bar.total = total
        bar.update(done, what)

    try:
        res = run_selftest(adapter, max_world=args.max_world, device=device, progress=progress)
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    finally:
        from ..pool import close_all

        close_all()
    listed = [str(c).split(" seed")[0] + (" W=1" if i >= res.n_single and c.world == 1 else "")
              for i, c in enumerate(res.cases)]
    print(f"self-test of {res.trainer}: {len(res.cases)} cases ({', '.join(listed)})"
          + (f"; data-parallel at worlds {res.worlds}" if res.worlds else ""))
    print(res.table())
    d = res.as_dict()
    print(f"mutation score {res.score} in {res.seconds:.0f} s: {d['verdict']}")
    from .. import report

    paths = report.write(out, trainer=res.trainer, settings=dict(device=device, selftest_worlds=res.worlds),
                         selftest=d, device=device, declarations=adapter.declarations())
    print("wrote " + ", ".join(paths))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
