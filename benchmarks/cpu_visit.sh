#!/usr/bin/env bash
# The CPU-only measurement of issue 23 on the GPU machine's Xeon, one visit
# (no GPU used; about 4-5 minutes on its 16 cores with a build there, ~1 more
# without):
#
#   OUT=/path bash benchmarks/cpu_visit.sh      # results under $OUT (default /tmp/cpu_visit)
#
#   1. the build: the one in place (a GPU visit's CUDA build: the CPU kernels
#      are the same code) when it imports and has this code's CPU ops; else
#      (or CPU_VISIT_BUILD=1) the CPU kernels alone, built with all cores in a
#      scratch copy of the tree under $TMPDIR, so an in-place CUDA build is
#      never overwritten. build.txt says which, and the code measured (commit,
#      hash of csrc/cpu: bench_cpu.py's cpu_src);
#   2. records the machine (lscpu, the ISA flags) and what the kernels run
#      bf16/fp16 products on there (cpu_runtime_info: brgemm on AMX, or our
#      float32 path);
#   3. the tests of the brgemm (AMX) path and of the threads, whose AMX case
#      runs only on such a machine (tests.txt);
#   4. bench_cpu.py, ours against torch's SDPA, interleaved: the issue's grid
#      (b4 h16 d128, n 1024 / 4096, fwd, fwd+bwd, decode b1/b4 32/8 heads cache
#      1k/4k; float32, bfloat16; median of 5) at 16 threads, bench_cpu.py's
#      default grid (b1 h8 d64, n 512..2048) at 16 threads, then n 1024 and
#      decode at 4 threads and at 1 thread: one JSON and one markdown table per
#      run (cpu_bench_xeon_*.json / .md), all tables in cpu_visit.md.
# Each step has its own time limit, so that a slow step still leaves the
# others' results; the last lines printed are the tables (ratios above 1 in bold).
# CPU_VISIT_QUICK=1 checks the script itself on any machine: tiny grids at 2
# threads, one repetition.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/cpu_visit}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
T0=$SECONDS
say() { echo "=== cpu_visit: $* (at $((SECONDS - T0)) s)"; }

lscpu >"$OUT/lscpu.txt" 2>&1
grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|amx_tile|amx_bf16|amx_fp16' /proc/cpuinfo | sort -u | tr '\n' ' '
echo
COMMIT="$(git rev-parse --short=12 HEAD 2>/dev/null || echo none)"

say build
has_cpu_ops() {  # the in-place build imports and has this code's CPU ops
  PYTHONPATH="$PWD" "$PY" -c "import torch, flashattn_ext; torch.ops.flashattn_ext._cpu_test_knob('no_key_split')" \
    >/dev/null 2>&1
}
if [[ "${CPU_VISIT_BUILD:-0}" != 1 ]] && has_cpu_ops; then
  echo "in-place build (commit $COMMIT)" | tee "$OUT/build.txt"
  so=$(ls flashattn_ext/_C*.so | head -1)
  newer=$(find csrc \( -name '*.cpp' -o -name '*.h' \) -newer "$so" 2>/dev/null | head -3 | tr '\n' ' ')
  [[ -n $newer ]] && echo "note: sources newer than the build: $newer" | tee -a "$OUT/build.txt"
else
  SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/cpu_visit_build.XXXXXX")"
  tar cf - --exclude='*.so' --exclude='__pycache__' setup.py pyproject.toml csrc flashattn_ext tests benchmarks |
    tar xf - -C "$SCRATCH"
  echo "CPU-only build in $SCRATCH (commit $COMMIT)" | tee "$OUT/build.txt"
  t0=$SECONDS
  if ! (cd "$SCRATCH" && FLASHATTN_CPU_ONLY=1 MAX_JOBS="$(nproc)" timeout 240 "$PY" setup.py build_ext --inplace \
    >"$OUT/build.log" 2>&1); then
    tail -30 "$OUT/build.log"
    exit 1
  fi
  echo "built in $((SECONDS - t0)) s" | tee -a "$OUT/build.txt"
  cd "$SCRATCH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, flashattn_ext; print(torch.__version__, torch.get_num_threads(), 'threads;', \
torch.ops.flashattn_ext.cpu_runtime_info(False))" | tee "$OUT/runtime_info.txt"

say tests
timeout 40 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cpu_lowp.py tests/test_cpu_parallel.py \
  tests/test_cpu_kernels.py -k "lowp or auto or split or threads or one_pass or large_query_blocks or dtype_and_mask or fused_softmax_step" \
  >"$OUT/tests.txt" 2>&1
echo "pytest rc $? (124: cut at its time limit)"
tail -3 "$OUT/tests.txt"

bench() {  # $1: name, $2: time limit (s); the rest: bench_cpu.py's arguments
  local name=$1 limit=$2
  shift 2
  say "bench $name"
  timeout "$limit" "$PY" benchmarks/bench_cpu.py --impls ours,sdpa --dtypes float32,bfloat16 "$@" "${QUICK[@]}" \
    --json "$OUT/cpu_bench_xeon_$name.json" --markdown "$OUT/cpu_bench_xeon_$name.md" >"$OUT/bench_$name.txt" 2>&1
  echo "rc $? (124: cut at its time limit; the rows so far are in bench_$name.txt)"
}
GRID=(--batch 4 --heads 16 --head-dim 128)
QUICK=()
[[ ${CPU_VISIT_QUICK:-0} == 1 ]] && QUICK=(--seqlens 128 --decode-caches 512 --reps 1 --warmup 0 --threads 2)
# (ours_paged: decoding on 16-key pages, read in place; decode rows only)
bench 16threads 180 "${GRID[@]}" --seqlens 1024,4096 --modes fwd,fwd+bwd,decode --reps 5 --warmup 1 --threads 16 \
  --impls ours,sdpa,ours_paged
bench default_16threads 25 --seqlens 512,1024,2048 --modes fwd,fwd+bwd --reps 5 --warmup 1 --threads 16
bench 4threads 60 "${GRID[@]}" --seqlens 1024 --modes fwd,fwd+bwd,decode --reps 3 --warmup 1 --threads 4 \
  --impls ours,sdpa,ours_paged
bench 1threads 30 "${GRID[@]}" --seqlens 1024 --modes fwd,decode --reps 3 --warmup 1 --threads 1
say done
for name in 16threads default_16threads 4threads 1threads; do
  if [[ -s "$OUT/cpu_bench_xeon_$name.md" ]]; then
    cat "$OUT/cpu_bench_xeon_$name.md"
  else
    echo "($name: no table; its output:)"
    grep -v -E '^(ours:|wrote)' "$OUT/bench_$name.txt" | cut -c1-100
  fi
  echo
done >"$OUT/cpu_visit.md"
cat "$OUT/cpu_visit.md"
