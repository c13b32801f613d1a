#!/usr/bin/env bash
# Nsight Compute profiles of chosen cases (one kernel launch each): the summary
# sections into $OUT/ncu_NAME.txt and the per-instruction stall samples,
# summarized by benchmarks/ncu_stalls.py, into $OUT/stalls_NAME.txt.
#   CASES="bwd128_4k" OUT=/tmp/out benchmarks/ncu_visit.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
prof() {  # name kernel-regex args...
  local name=$1 kern=$2; shift 2
  timeout 150 ncu --clock-control none -k "regex:$kern" -c 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section SourceCounters --import-source no -f -o "/tmp/ncu_$name" \
    python3 benchmarks/profile_case.py "$@" > "$OUT/ncu_$name.log" 2>&1
  echo "== $name rc=$?"
  ncu --import "/tmp/ncu_$name.ncu-rep" --page details > "$OUT/ncu_$name.txt" 2>&1
  ncu --import "/tmp/ncu_$name.ncu-rep" --page source --print-source sass --csv > "/tmp/src_$name.csv" 2>&1
  python3 benchmarks/ncu_stalls.py "/tmp/src_$name.csv" > "$OUT/stalls_$name.txt" 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Warp Cycles Per Issued" "$OUT/ncu_$name.txt" | head -4
  head -22 "$OUT/stalls_$name.txt"
}
for c in ${CASES:-bwd128_4k bwd128_1k_causal}; do
  case $c in
    bwd128_4k) prof $c flash_bwd_sm90_ws_kernel --d 128 --n 4096 --bwd ;;
    bwd128_1k_causal) prof $c flash_bwd_sm90_ws_kernel --d 128 --n 1024 --causal --bwd ;;
    bwd64_4k) prof $c flash_bwd_sm90_ws_kernel --d 64 --n 4096 --bwd ;;
    det64_4k) prof $c flash_bwd_sm90_ws_kernel --d 64 --n 4096 --bwd --deterministic ;;  # against bwd64_4k
    det128_4k) prof $c flash_bwd_sm90_ws_kernel --d 128 --n 4096 --bwd --deterministic ;;  # against bwd128_4k
    fwd128_1k_causal) prof $c flash_fwd_sm90_ws --d 128 --n 1024 --causal ;;
    fwd128_4k) prof $c flash_fwd_sm90_ws --d 128 --n 4096 ;;
    fwd128_1k) prof $c flash_fwd_sm90_ws --d 128 --n 1024 ;;
    fwd128_512) prof $c flash_fwd_sm90_ws --d 128 --n 512 ;;  # the short-sequence forward (4 key blocks a tile)
    fwd64_1k_causal) prof $c flash_fwd_sm90_ws --d 64 --n 1024 --causal ;;
    bwd256_4k) prof $c flash_bwd_sm90_ws_split --d 256 --n 4096 --bwd ;;
  esac
done
