#!/usr/bin/env bash
# The scale tier's GPU measurements (reports/scale/), one phase per device call (each under 10 minutes):
#   side   the 134M measurement side by side: the equivalence gate, dev profile, old tree vs this one
#   plan   the 1.1B trainer's memory plan alone
#   good   python -m verify.gpu_gate --scale on the 1.1B recipe
#   bug    the same on its per-micro token-mean bug (planted/scale_adapters.py)
#   gates  the gates alone (TRAINER=..., GATES=<pytest -k expression>, EXTRA=<more pytest arguments>)
#   memory the memory probe alone, as gpu_gate --scale runs it (TRAINER=..., E=...), its GPU peak measured
# usage: bash benchmarks/scale_gpu.sh PHASE OUT   (plan: python -m verify.gpu_gate --scale --plan-only, TRAINERS=...)
set -u
phase=$1 out=$2
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
py=python3
case $phase in
side)
  $py -m benchmarks.scale_old_tree /tmp/scale-old >/dev/null
  eq=(-m pytest -p no:cacheprovider -p _xtrain_pytest.entry -q -rs --pyargs verify -k accumulation_equals_big_batch
      --verify-trainer examples.llama_scale:m134 --verify-device cuda -p no:xdist)
  for side in new old; do
    dir=$PWD; [ $side = old ] && dir=/tmp/scale-old
    (cd "$dir" && HYPOTHESIS_PROFILE=dev $py -m benchmarks.gpu_peak "$side 134M equivalence, dev profile" -- $py "${eq[@]}" \
       > "$out/side-$side.log" 2>&1; tail -1 "$out/side-$side.log" >> "$out/side.jsonl")
  done ;;
plan)
  for t in ${TRAINERS:-examples.llama_scale:billion}; do
    $py -m verify.gpu_gate --scale --plan-only --trainer "$t" --out "$out/plan-${t##*:}" 2>&1 | tail -3
  done ;;
good)
  $py -m verify.gpu_gate --scale --trainer examples.llama_scale:billion --out "$out/good" > "$out/good.log" 2>&1  # kept if the call is cut
  tail -8 "$out/good.log" ;;
gates)  # the gates step alone, without the plan, measured; GATES narrows it (-k) so one gate fits one 10-minute call:
  # the 1.1B recipe's equivalence and bit-exact took ~545 s together (reports/scale/)
  HYPOTHESIS_PROFILE=scale XTRAIN_TEST_THREADS=$(( $(nproc) < 16 ? $(nproc) : 16 )) $py -m benchmarks.gpu_peak "1.1B gates (${GATES:-all three}), profile scale" -- $py -m pytest -p no:cacheprovider \
    -p _xtrain_pytest.entry -q -rs --pyargs verify -k "${GATES:-accumulation_equals_big_batch or accum1_bit_identical or reported_metrics}" \
    --verify-trainer "${TRAINER:-examples.llama_scale:billion}" --verify-device cuda -p no:xdist ${EXTRA:-} > "$out/gates.log" 2>&1
  tail -4 "$out/gates.log" ;;
memory)
  $py -m benchmarks.gpu_peak "1.1B memory probe, effective batch ${E:-512}, the sweeps' ends" -- $py -m verify.memory \
    --trainer "${TRAINER:-examples.llama_scale:billion}" --effective-batch "${E:-512}" --sweep ends --steps 1 \
    --device cuda:0 --out "$out/memory" > "$out/memory.log" 2>&1
  tail -6 "$out/memory.log" ;;
bug)
  $py -m verify.gpu_gate --scale --trainer planted.scale_adapters:billion --out "$out/bug" > "$out/bug.log" 2>&1  # kept if the call is cut
  tail -8 "$out/bug.log" ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
