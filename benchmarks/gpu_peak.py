"""Run one command and report its wall time and the GPU memory the box had in use at its peak (NVML, every process,
CUDA contexts included), as JSON on stdout's last line: how reports/scale/ measured the scale runs side by side.

    python -m benchmarks.gpu_peak LABEL -- COMMAND ...
"""
import json
import subprocess
import sys
import time

from verify.gpu_gate import GpuPeak


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m benchmarks.gpu_peak LABEL -- COMMAND ...", file=sys.stderr)
        return 2
    label, cmd = argv[0], argv[2:]
    t0 = time.monotonic()
    with GpuPeak() as peak:
        rc = subprocess.run(cmd).returncode
    print(json.dumps(dict(label=label, command=" ".join(cmd), returncode=rc, seconds=round(time.monotonic() - t0, 1),
                          gpu_peak_gib=None if peak.gib is None else round(peak.gib, 2))), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
