#!/usr/bin/env bash
# The native reference on a GPU box (reports/native/): torchao FP8 in real FP8 and Liger's fused linear cross-entropy
# before (0.8.1) and after (0.8.5) its reduction="none" fix (PR #1298). Wheels travel in .whl/ (gitignored):
#   pip download --no-deps torchao==0.18.0 liger-kernel==0.8.1 liger-kernel==0.8.5 -d .whl   (liger's into .whl/liger/)
# usage: bash benchmarks/native_gpu.sh OUT
set -u
out=$1
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/torchao-*.whl || exit 2
for v in 0.8.1 0.8.5; do
  mkdir -p "/tmp/liger-$v" && python3 -m zipfile -e ".whl/liger/liger_kernel-$v-py3-none-any.whl" "/tmp/liger-$v"
done
PYTHONPATH=/tmp/site python3 -m benchmarks.native_gpu fp8 > "$out/fp8.jsonl" 2> "$out/fp8.err"
for v in 0.8.1 0.8.5; do
  PYTHONPATH="/tmp/liger-$v" python3 -m benchmarks.native_gpu liger "$v" >> "$out/liger.jsonl" 2>> "$out/liger.err"
done
# every row to stdout too: a device call returns a limited number of files, and its output's tail always
python3 - "$out" <<'PY'
import json, sys, collections
for f in ("fp8", "liger"):
    c = collections.Counter()
    for line in open(f"{sys.argv[1]}/{f}.jsonl"):
        r = json.loads(line); c[(r["trainer"], r["verdict"])] += 1
        print(f"{r['trainer']} | {r['case']} | {r['verdict']} | {r['seconds']} s | {r['line'][:160]}")
    for (t, v), n in sorted(c.items()):
        print(f"{t}: {v} ×{n}")
PY
