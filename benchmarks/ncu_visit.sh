#!/usr/bin/env bash
# Nsight Compute stall profile of chosen cases (one kernel launch each) into $OUT/ncu_*.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
prof() {  # name kernel-regex args...
  local name=$1 kern=$2; shift 2
  timeout 120 ncu --clock-control none -k "regex:$kern" -c 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 benchmarks/profile_case.py "$@" > "$OUT/ncu_$name.txt" 2>&1
  echo "== $name rc=$?"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Issue Slots Busy|No Eligible" "$OUT/ncu_$name.txt" | head -8
}
prof bwd128_4k flash_bwd_sm90_ws_kernel --d 128 --n 4096 --bwd
prof bwd128_1k_causal flash_bwd_sm90_ws_kernel --d 128 --n 1024 --causal --bwd
prof fwd128_1k_causal flash_fwd_sm90_ws --d 128 --n 1024 --causal
