#!/usr/bin/env bash
# Peak memory per data-parallel mode on 2 GPUs, one command from the repo root (no pip install needed):
#
#     bash benchmarks/memory_modes_gpu.sh OUT
#
# `python -m benchmarks.memory_modes` on CUDA (NCCL, one GPU per rank): xtrain's flat buffer, torch DDP no_sync,
# FSDP2 (reshard after forward) and FSDP2 keep, each a `torchrun --nproc-per-node 2 -m verify.memory` run
# of the gpt2-ish GPT at S=512, E=8 (4 rows per rank: sweep A N=1,2,4; sweep B N=1,2,4 at B=1), fp32 with
# TF32 off, 2 warm-up + 3 measured steps per configuration; the probe is torch.cuda.max_memory_allocated
# (everything: parameters, gradients, AdamW state, activations), and the memory model predicts that same
# quantity. 18–28 s per mode on 2 H200s (99 s in all, measured 2026-11-30); the modes share a 165 s budget (a mode
# that would start past it is reported as not run) and each is capped at 120 s: under 3 minutes in all.
# Writes under OUT: gpus.txt, memory-modes-cuda.json / .md / .png (every mode's full verify.memory report
# is inside the JSON), memory-modes-cuda.log (the per-mode progress and the table).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/memory_modes_gpu.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute, before changing directory
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
t0=$(date +%s)
{ nvidia-smi -L; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; } > "$OUT/gpus.txt" 2>&1
timeout -s INT 178 "$PY" -m benchmarks.memory_modes --device cuda --world 2 --effective-batch 8 --model gpt2-ish \
    --seq-len 512 --timeout 120 --budget 165 --out "$OUT" --name memory-modes-cuda 2>&1 | tee "$OUT/memory-modes-cuda.log"
rc=${PIPESTATUS[0]}
echo "memory per mode, rc=$rc ($(( $(date +%s) - t0 )) s)"
exit "$rc"
