#!/usr/bin/env bash
# The CPU-only measurement of issue 23 on the GPU machine's Xeon, one visit
# (no GPU used; about 3 minutes on its 16 cores):
#
#   bash benchmarks/cpu_visit.sh          # results under $OUT (default /tmp/cpu_visit)
#
#   1. builds the CPU kernels in place (FLASHATTN_CPU_ONLY=1, all cores);
#   2. records the machine (lscpu) and what the kernels run bf16/fp16 products
#      on there (cpu_runtime_info: brgemm on AMX, or our float32 path);
#   3. runs the tests of the brgemm (AMX) path and of the threads, which can
#      only run their AMX case on such a machine (tests.txt);
#   4. times bench_cpu.py on the issue's grid (b4 h16 d128, n 1024 / 4096,
#      fwd, fwd+bwd, decode; ours and torch's SDPA, median of 5) at 16 threads,
#      then n 1024 and decode at 4 and at 1 thread (fewer repetitions): one
#      JSON per thread count, cpu_bench_xeon_<N>threads.json.
# Each step has its own time limit, so that a slow step still leaves the
# others' results; the last lines printed are the tables.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/cpu_visit}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
T0=$SECONDS
say() { echo "=== cpu_visit: $* (at $((SECONDS - T0)) s)"; }

lscpu >"$OUT/lscpu.txt" 2>&1
grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|amx_tile|amx_bf16|amx_fp16' /proc/cpuinfo | sort -u | tr '\n' ' '
echo

say build
if ! FLASHATTN_CPU_ONLY=1 MAX_JOBS="$(nproc)" timeout 300 "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"
  exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, flashattn_ext; print(torch.__version__, torch.get_num_threads(), 'threads;', \
torch.ops.flashattn_ext.cpu_runtime_info(False))" | tee "$OUT/runtime_info.txt"

say tests
timeout 60 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cpu_lowp.py tests/test_cpu_parallel.py \
  tests/test_cpu_kernels.py -k "lowp or auto or split or threads or large_query_blocks or dtype_and_mask" \
  >"$OUT/tests.txt" 2>&1
echo "pytest rc $?"
tail -3 "$OUT/tests.txt"

GRID=(--batch 4 --heads 16 --head-dim 128 --impls ours,sdpa --dtypes float32,bfloat16)
say "bench, 16 threads"
timeout 150 "$PY" benchmarks/bench_cpu.py "${GRID[@]}" --seqlens 1024,4096 --modes fwd,fwd+bwd,decode \
  --reps 5 --warmup 1 --threads 16 --json "$OUT/cpu_bench_xeon_16threads.json" >"$OUT/bench_16.txt" 2>&1
say "bench, 4 threads"
timeout 35 "$PY" benchmarks/bench_cpu.py "${GRID[@]}" --seqlens 1024 --modes fwd,fwd+bwd,decode \
  --reps 3 --warmup 1 --threads 4 --json "$OUT/cpu_bench_xeon_4threads.json" >"$OUT/bench_4.txt" 2>&1
say "bench, 1 thread"
timeout 40 "$PY" benchmarks/bench_cpu.py "${GRID[@]}" --seqlens 1024 --modes fwd,decode \
  --reps 3 --warmup 1 --threads 1 --json "$OUT/cpu_bench_xeon_1threads.json" >"$OUT/bench_1.txt" 2>&1
say done
for n in 16 4 1; do
  echo "--- $n threads"
  grep -v -E '^(torch|ours:|mode|decode:|wrote)' "$OUT/bench_$n.txt" | cut -c1-90
done
