"""The training CLI streams --data / --docs files: a step holds its batches, not the file (it held ~10× the
file: a 1 GB file peaked at 10.7 GB for one 512-token step)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One training step in a fresh interpreter, then its own peak RSS (ru_maxrss, KiB on Linux) on the last line.
PEAK = ("import resource, runpy, sys\n"
        "sys.argv = ['xtrain_core.train', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('xtrain_core.train', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n")


def _peak(flag: str, path) -> int:
    r = subprocess.run([sys.executable, "-c", PEAK, flag, str(path), "--model", "tiny", "--seq-len", "16", "--steps",
                        "1", "--micro-batch", "2", "--threads", "1"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
@pytest.mark.parametrize("flag", ["--data", "--docs"])
def test_a_big_file_costs_less_memory_than_its_size(tmp_path, flag):
    """The same step on a 64-byte file and on a 128 MiB one (NUL bytes, valid UTF-8: --docs reads it as one
    document): the big file may add at most its own size to the peak. Held whole, the bytes, a bytearray copy
    and int64 tokens alone were 10× it."""
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    small.write_bytes(b"\0" * 64)
    size = 128 << 20
    with open(big, "wb") as f:
        f.truncate(size)  # a sparse file of zeros: no time spent writing it
    extra = _peak(flag, big) - _peak(flag, small)
    assert extra < size, f"{flag}: a {size >> 20} MiB file added {extra >> 20} MiB to the peak"
