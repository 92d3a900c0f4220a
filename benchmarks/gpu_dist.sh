#!/usr/bin/env bash
# The data-parallel GPU run, one command from the repo root (no pip install needed):
#
#     bash benchmarks/gpu_dist.sh W OUT          # W = GPUs = world (2, 4 or 8)
#
# 1. step time side by side: xtrain's DistAccumTrainer, xtrain's model under torch DDP no_sync, and the
#    plain-torch loop (benchmarks/plain_torch.py) under DDP no_sync; preset gpt2-ish, N=4, B=8 per rank,
#    fp32, TF32 off, interleaved reps, median; the flight recorder's collectives per optimizer step; peak memory.
# 2. what a distributed gate example costs on NCCL, cold (spawn) vs warm, worlds 1, 2 and W.
# 3. the distributed gates on NCCL, worlds 1..W: verify/test_gates_dist.py (the default adapter, through
#    the pytest plugin) and tests/harness/test_gates_dist.py (xtrain's own trainers and the broken ones), both
#    `-m distributed`; hypothesis profile gpu for W ≤ 2, ci above, to stay within 8 minutes: the three
#    steps are capped at 150 + 90 + 220 s.
# Writes under OUT (9 files): gpus.txt, bench_steps_wW.log, bench_dist_steps_cuda_wW.json,
# bench_pools_nccl.log, bench_dist_pools_nccl.json, nccl_suite_wW.log, nccl_suite_wW.xml and the gates'
# run report verify-report.json / verify-report.md (there, not over the repo's reports/).
set -uo pipefail
W=${1:?usage: bash benchmarks/gpu_dist.sh WORLD OUT_DIR}
OUT=${2:?usage: bash benchmarks/gpu_dist.sh WORLD OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute, before changing directory
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
PROFILE=$([ "$W" -le 2 ] && echo gpu || echo ci)
# The gates' pytest plugin comes with `pip install xtrain` (entry point); from a bare tree, load it by
# name. Never both: pytest refuses a plugin registered twice.
PLUGIN=$("$PY" -c "from importlib.metadata import entry_points as e
print('' if any(p.value == '_xtrain_pytest.entry' for p in e(group='pytest11')) else '-p _xtrain_pytest.entry')")
t0=$(date +%s)
{ nvidia-smi -L; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"; env | grep -E '^NCCL_' ; } > "$OUT/gpus.txt" 2>&1

timeout -s INT 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$W" -m benchmarks.bench_dist \
    --device cuda --out "$OUT" > "$OUT/bench_steps_w$W.log" 2>&1
echo "[1] step time, rc=$? ($(( $(date +%s) - t0 )) s)"; grep -A6 "median ms/step" "$OUT/bench_steps_w$W.log"

timeout -s INT 90 "$PY" -m benchmarks.bench_dist --backend nccl --worlds "1,2,$W" --reps 8 --drawn 12 \
    --out "$OUT" > "$OUT/bench_pools_nccl.log" 2>&1
echo "[2] example cost, rc=$? ($(( $(date +%s) - t0 )) s)"; grep "^world" "$OUT/bench_pools_nccl.log"

XTRAIN_DIST_BACKEND=nccl XTRAIN_DIST_MAX_WORLD="$W" HYPOTHESIS_PROFILE="$PROFILE" timeout -s INT 220 \
    "$PY" -m pytest $PLUGIN verify/test_gates_dist.py tests/harness/test_gates_dist.py -m distributed \
    --verify-backend nccl -n 2 -p no:cacheprovider -q --durations=15 --hypothesis-show-statistics \
    --verify-report "$OUT" --junitxml="$OUT/nccl_suite_w$W.xml" > "$OUT/nccl_suite_w$W.log" 2>&1
echo "[3] NCCL gates (profile $PROFILE), rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 4 "$OUT/nccl_suite_w$W.log"
