"""The scale plan's host-memory model checked on the CPU (docs/design/memory.md, "Scale plan"): the peak RSS growth of
one equivalence case (N = 3, B = 2, K steps) of the Llama recipe at 20M parameters, in bytes per parameter, beside
the plan's (K + 1)·16 + 24 for what an equivalence case keeps (scaleplan.KEPT_BYTES_PER_PARAMETER at K) plus 32 for
the live float64 trainer (on the CPU it is in host memory too).

    python -m benchmarks.scale_host [K]   # default 2 (the scale profile's largest); one K a process (the peak RSS only grows)
    python -m benchmarks.scale_host bug   # the failing path: the equivalence gate test, as verify.gpu_gate --scale runs
                                          # it (plugin, profile scale), on the recipe's per-micro token mean at 20M
"""
import dataclasses
import os
import resource
import sys
import time

import torch

import verify
from examples import llama_scale

PROBE = llama_scale.Size(vocab=8000, dim=512, layers=4, heads=8, kv_heads=2, ffn=1536, seq=32)
llama_scale.SIZES["probe"] = PROBE
probe = llama_scale._adapter("probe", f"Llama-shaped LM, {PROBE.parameters / 1e6:.0f}M")
probe_bug = dataclasses.replace(probe, factory=__import__("planted.scale_adapters").scale_adapters.MicroTokenMean,
                                name=f"broken: {probe.name}, per-micro token mean", ref=None)


def failing() -> float:
    """Peak RSS growth (bytes) of the equivalence gate test on probe_bug, as the scale command runs it (in a process
    started with the scale profile, as a user starts pytest: `bug` runs this in a child)."""
    import pytest

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--pyargs", "verify", "-k",
                        "accumulation_equals_big_batch", "--verify-trainer", "benchmarks.scale_host:probe_bug",
                        "--verify-report", "/tmp/scale-host-bug"])
    if code != 1:
        raise SystemExit(f"benchmarks.scale_host: the planted bug was not rejected (pytest exit {code})")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def growth(steps: int) -> float:
    """Peak RSS growth (bytes) of one equivalence case at `steps` steps, in a fresh process's terms."""
    llama_scale.SIZES["probe"] = PROBE
    case = verify.Case(accum_steps=3, micro_batch=2, steps=steps, seed=1, data_seed=2,
                       options=llama_scale.Options(size="probe"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    verify.check(verify.Gate.EQUIVALENCE, llama_scale.factory, case)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(2)
    P = PROBE.parameters
    if args and args[0] == "bug":  # the plugin reads its profile once, from the environment it starts in
        import subprocess

        return subprocess.run([sys.executable, "-m", "benchmarks.scale_host", "bug-child"],
                              env={**os.environ, "HYPOTHESIS_PROFILE": "scale"}).returncode
    if args and args[0] == "bug-child":
        t0, k = time.perf_counter(), 2  # the equivalence corner: N = 3, B = 2, K = 2
        g = failing()
        print(f"the failing path: {P / 1e6:.1f}M parameters, peak RSS growth {g / 2**30:.2f} GiB = {g / P:.0f} "
              f"B/parameter; plan {2 * 8 * (k + 1) + 24} + 32 = {2 * 8 * (k + 1) + 56}; {time.perf_counter() - t0:.0f} s")
        return 0
    k = int(args[0]) if args else 2
    t0 = time.perf_counter()
    g = growth(k)
    kept = 2 * 8 * (k + 1) + 2 * 4 + 2 * 8  # scaleplan.KEPT_BYTES_PER_PARAMETER, at this K
    print(f"K={k}: {P / 1e6:.1f}M parameters, peak RSS growth {g / 2**30:.2f} GiB = {g / P:.0f} B/parameter; "
          f"plan {kept} + 32 (the live float64 trainer) = {kept + 32}; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
