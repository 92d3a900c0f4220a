"""The native reference on a GPU (issue 44 item 3; docs/design/tolerance.md, "The native reference"): fixed cases of
the equivalence gate, each a JSON line (trainer, case, verdict, seconds, the first line of a failure).

    python -m benchmarks.native_gpu fp8             # examples.fp8_torchao in real FP8 (compute capability ≥ 8.9)
                                                    # and planted/native_adapters' FP8 trainers; needs torchao
    python -m benchmarks.native_gpu liger VERSION   # examples.liger_flce on the installed liger-kernel VERSION

benchmarks/native_gpu.sh runs both on a GPU box (wheels carried in .whl/).
"""
from __future__ import annotations

import json
import sys
import time

import torch

import verify

CASES = [verify.Case(accum_steps=n, micro_batch=b, steps=2, seed=s, data_seed=s + 1, device="cuda")
         for s, (n, b) in enumerate(((2, 2), (3, 2), (4, 1), (3, 3)), start=1)]
PADDED = verify.Case(accum_steps=3, micro_batch=2, steps=2, seed=1, data_seed=2, lengths=(0, 0, 16, 5, 16, 9),
                     device="cuda")


def judge(label: str, adapter, cases, **extra) -> int:
    bad = 0
    for case in cases:
        t0 = time.perf_counter()
        try:
            r = verify.check(verify.Gate.EQUIVALENCE, adapter, case)
            verdict, line = "pass", f"{r.worst}: error / bound {r.ratio:.3g}"
        except verify.GateFailure as e:
            verdict, line = "rejected", str(e).splitlines()[0][:400]
        except Exception as e:  # noqa: BLE001  (a crash is a row too)
            verdict, line, bad = "error", f"{type(e).__name__}: {e}"[:400], bad + 1
        print(json.dumps(dict(trainer=label, case=str(case), verdict=verdict, seconds=round(time.perf_counter() - t0, 2),
                              line=line, gpu=torch.cuda.get_device_name(), torch=torch.__version__, **extra)), flush=True)
    return bad


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("fp8", "liger") or (args[0] == "liger" and len(args) < 2):
        print("usage: python -m benchmarks.native_gpu fp8 | liger VERSION", file=sys.stderr)
        return 2
    if args[0] == "fp8":
        import torchao

        from examples import fp8_torchao
        from planted import native_adapters as na

        real = torch.cuda.get_device_capability() >= (8, 9)
        extra = dict(torchao=torchao.__version__, float8="real" if real else "emulated")
        bad = judge("examples.fp8_torchao:factory", fp8_torchao.factory, CASES + [PADDED], **extra)
        bad += judge("planted.native_adapters:fp8_delayed (honest)", na.fp8_delayed, CASES, **extra)
        bad += judge("planted.native_adapters:fp8_micro_token_mean", na.fp8_micro_token_mean, [PADDED], **extra)
        bad += judge("planted.native_adapters:fp8_delayed_per_forward", na.fp8_delayed_per_forward, CASES[:2], **extra)
        return 1 if bad else 0
    import liger_kernel  # noqa: F401

    from examples import liger_flce

    return 1 if judge(f"examples.liger_flce:factory, liger-kernel {args[1]}", liger_flce.factory, CASES,
                      liger_kernel=args[1]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
