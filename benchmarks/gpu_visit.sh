#!/usr/bin/env bash
# One visit to the lent GPU machine: build (or reuse a carried build), kernel
# check, GPU tests, sanitizers, benchmark; logs and JSON under $OUT, a short
# table printed last.
#
#   STAGES="build check test sanitize bench" OUT=/tmp/out benchmarks/gpu_visit.sh
#
# build:    reuse flashattn_ext/_C.abi3.so if it imports with CUDA kernels,
#           else build in place with all cores (FLASHATTN_CUDA_ARCHS default 90 here)
# check:    benchmarks/kernel_check.py (correctness matrix, race check, quick perf)
# test:     the pytest suite's cuda cases (-m cuda), one process per test file
#           (TEST_FILES, default tests/test_*.py), so a crash in one file cannot hide the others:
#           per-file passed/failed/skipped/errors and exit code in
#           $OUT/pytest_summary.tsv, logs in $OUT/pytest_<file>.log; exit code >= 128
#           (killed by a signal, e.g. a segfault) is reported as CRASH and fails the stage
# selftest: python -m flashattn_ext (the README's main job)
# sanitize: compute-sanitizer memcheck and racecheck on a small case per Hopper backward kernel
#           (SAN_CASES=mask: only the attn_mask tile-skipping case; SAN_CASES=dropout: only dropout's;
#           SAN_CASES=paged: only the paged-KV cases)
# bench:    benchmarks/bench_gpu.py, the standard grid (BENCH_ARGS to narrow it,
#           e.g. BENCH_ARGS=--quick); JSON, markdown and its summary under $OUT
# tune:     only when named in STAGES, on a FLASHATTN_TUNING=1 build (export it
#           before the build stage): benchmarks/tune.py over the candidate tile
#           configurations (TUNE_ARGS, default the forward at d64/d128, 512..16k),
#           $OUT/tune.json and tune.log
# ring:     only when named in STAGES: examples/context_parallel.py --threads
#           RING_THREADS (4) --overlap-report at each of RING_SEQLENS (32768 131072),
#           each under RING_TIMEOUT (150 s); logs and JSON under $OUT
# crash:    only when named in STAGES: the pytest run of CRASH_TESTS (default
#           tests/test_errors.py) under cuda-gdb, for a native backtrace of a
#           segfault ($OUT/crash_gdb.log)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashattn_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build check test selftest sanitize bench"}   # add "crash" for the cuda-gdb stage
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
stamp() { echo "[$(date +%T)] $*"; }

stamp "GPU: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader 2>/dev/null)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"

if has build; then
  if python3 -c "import flashattn_ext, torch, sys; sys.exit(0 if 'cuda=1' in torch.ops.flashattn_ext.build_info() else 1)" 2>/dev/null; then
    stamp "using the carried build: $(python3 -c 'import flashattn_ext, torch; print(torch.ops.flashattn_ext.build_info())')"
  else
    stamp "building in place"
    t0=$(date +%s)
    FLASHATTN_CUDA_ARCHS=${FLASHATTN_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} FLASHATTN_PTXAS_VERBOSE=1 \
      python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -50 "$OUT/build.log"; exit 1; }
    stamp "built in $(( $(date +%s) - t0 )) s"
  fi
fi

if has check; then
  stamp "kernel check"
  python3 benchmarks/kernel_check.py --json "$OUT/check.json" ${CHECK_ARGS:-} > "$OUT/check.log" 2>&1 || status=1
  grep -E "^FAIL|correctness|race|perf" "$OUT/check.log"
fi

if has test; then
  stamp "pytest (cuda), one process per test file"
  summary="$OUT/pytest_summary.tsv"
  # TEST_FILES (default every tests/test_*.py) splits the suite over two calls of
  # a visit; the summary then gets its header once, in the first.
  [ -s "$summary" ] || printf "file\trc\tpassed\tfailed\tskipped\terrors\tdeselected\tverdict\n" > "$summary"
  count() {  # count WORD LOG: the number before WORD on pytest's closing line; ? when there is none (a crash)
    local line
    line=$(tail -5 "$2" | grep -E "[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran" | tail -1)
    if [ -z "$line" ]; then echo "?"; return; fi
    echo "$line" | grep -oE "[0-9]+ $1" | head -1 | cut -d' ' -f1 | grep . || echo 0
  }
  for f in ${TEST_FILES:-tests/test_*.py}; do
    name=$(basename "$f" .py)
    log="$OUT/pytest_$name.log"
    timeout ${TEST_TIMEOUT:-300} python3 -X faulthandler -m pytest -q --maxfail=30 -m cuda -p no:cacheprovider \
      "$f" ${TEST_ARGS:-} > "$log" 2>&1
    rc=$?
    passed=$(count passed "$log"); failed=$(count failed "$log"); skipped=$(count skipped "$log")
    errors=$(count error "$log"); deselected=$(count deselected "$log")
    if [ $rc -eq 0 ]; then verdict=ok
    elif [ $rc -eq 5 ]; then verdict="ok (no cuda tests)"       # pytest: nothing selected
    elif [ $rc -eq 124 ]; then verdict="TIMEOUT (${TEST_TIMEOUT:-300} s)"
    elif [ $rc -ge 128 ]; then verdict="CRASH (signal $((rc - 128)))"
    elif [ $rc -eq 1 ]; then verdict=FAILED
    else verdict="ERROR (pytest exit $rc)"
    fi
    printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n" "$name" "$rc" "$passed" "$failed" "$skipped" "$errors" "$deselected" \
      "$verdict" >> "$summary"
    case "$verdict" in ok*) ;; *) status=1 ;; esac
  done
  column -t -s $'\t' "$summary" 2>/dev/null || cat "$summary"
  for log in "$OUT"/pytest_test_*.log; do
    grep -E "^(FAILED|ERROR)" "$log" | head -10
    grep -E "Fatal Python error|Segmentation fault" -A12 "$log" | head -30
  done
fi

if has selftest; then
  stamp "self-check (python -m flashattn_ext)"
  python3 -m flashattn_ext --json "$OUT/selftest.json" > "$OUT/selftest.log" 2>&1 || status=1
  tail -25 "$OUT/selftest.log"
fi

if has sanitize; then
  stamp "compute-sanitizer"
  cat > /tmp/san.py <<'EOF'
import os, sys
import torch, flashattn_ext
from flashattn_ext import _ops
# The Hopper backward kernels (64/96/128 split keys, 192/256 split the head
# dim), causal and not (the deterministic mode's plain and rotated sweeps: two
# key blocks or more), varlen batches through the TMA forward and backward,
# flash_attn_with_kvcache's prefill route and its split-KV decoding (the
# combine kernel launched as a programmatic dependent; pages of 256 keys).
# Racecheck runs a subset ("race": one configuration of each kernel): the
# whole list at 130 x 200 ran past 300 s under it (session 6, visit 3).
race = sys.argv[1:] == ["race"]
# Paged k/v read in place (issue 25): flash_attn_varlen_func with block_table on the
# TMA forward (pages of 16, 48, 256 keys: boxes of 16 / 16 / whole tiles) and the
# mma.sync one, a table with unused entries out of range and a sequence past its
# last page; paged, cache_batch_idx and cache_leftpad prefills on the TMA forward.
if os.environ.get("SAN_CASES", "paged") == "paged":
    for route in ("tma", "sm80"):
        os.environ["FLASHATTN_DISABLE_SM90"] = "1" if route == "sm80" else "0"
        for d, page in ((64, 16), (128, 48), (128, 256), (256, 16)):
            lens = [70, 0, 300, 129]
            per = max(-(-n // page) for n in lens) + 1
            kp = torch.randn(per * len(lens) + 2, page, 2, d, device="cuda", dtype=torch.bfloat16)
            table = torch.randperm(per * len(lens), device="cuda").view(len(lens), per).int()
            table[:, -1] = 10**6  # never a visible key's page
            cu = torch.tensor([0, 70, 70, 370, 499], dtype=torch.int32, device="cuda")
            q = torch.randn(499, 4, d, device="cuda", dtype=torch.bfloat16)
            for causal in (False, True):
                flashattn_ext.flash_attn_varlen_func(q, kp, kp, cu, cu, 300, 300, causal=causal, block_table=table)
    os.environ["FLASHATTN_DISABLE_SM90"] = "0"
    q = torch.randn(2, 100, 4, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(3, 512, 2, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([450, 100], dtype=torch.int32, device="cuda")
    flashattn_ext.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=seqlens,
                                         cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32, device="cuda"))
    flashattn_ext.flash_attn_with_kvcache(q, kc[:2], kc[:2], cache_seqlens=seqlens, causal=True,
                                         cache_leftpad=torch.tensor([3, 90], dtype=torch.int32, device="cuda"))
    table = torch.tensor([[3, 0, 6, 1], [2, 7, 4, 5]], dtype=torch.int32, device="cuda")
    kp = torch.randn(8, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
    flashattn_ext.flash_attn_with_kvcache(q, kp, kp, cache_seqlens=seqlens, block_table=table, causal=True)
    if os.environ.get("SAN_CASES") == "paged":
        torch.cuda.synchronize()
        print("sanitizer case ran")
        sys.exit(0)
# Dropout in the Hopper forward and both backward kernels (and the mma.sync ones at
# head dim 32), causal and not, with a bool mask, varlen, deterministic.
if os.environ.get("SAN_CASES", "dropout") == "dropout":
    for d in (32, 64, 128, 256):
        q = torch.randn(2, 4, 200, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(2, 2, 200, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for causal in (False, True):
            o = flashattn_ext.scaled_dot_product_attention(q, kv, kv, dropout_p=0.2, is_causal=causal, enable_gqa=True)
            o.sum().backward()
        pad = torch.arange(200, device="cuda") < torch.tensor([150, 200], device="cuda")[:, None]
        flashattn_ext.scaled_dot_product_attention(q, kv, kv, attn_mask=pad[:, None, None], dropout_p=0.1,
                                                   enable_gqa=True).sum().backward()
    cu = torch.tensor([0, 1, 70, 70, 200], dtype=torch.int32, device="cuda")
    q = torch.randn(200, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for det in (False, True):
        o = flashattn_ext.flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu, cu, 130, 130, dropout_p=0.3, causal=True,
                                                 deterministic=det)
        o.sum().backward()
    if os.environ.get("SAN_CASES") == "dropout":
        torch.cuda.synchronize()
        print("sanitizer case ran")
        sys.exit(0)
# An attn_mask whose tiles are hidden, mixed and visible (csrc/cuda/mask_skip.cuh:
# skipped key blocks in the forward, skipped query blocks in the backward, a
# tile with no visible block), deterministic or not, with a float mask's gradient.
doc = torch.arange(400, device="cuda") // 130
allowed = doc[:, None] == doc[None, :]
allowed[200:330] = False
for det in (False, True):
    torch.use_deterministic_algorithms(det, warn_only=True)
    for d in (64, 128, 256):
        q = torch.randn(1, 4, 400, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(1, 2, 400, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fm = torch.zeros(400, 400, device="cuda", dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
        for m in (allowed, fm.requires_grad_()):
            flashattn_ext.scaled_dot_product_attention(q, kv, kv, attn_mask=m, enable_gqa=True).sum().backward()
        # a bf16 bias read through shared memory (hopper/fwd_sm90_bias_stage.cuh), 397 keys: the last chunk zero-filled
        kr = torch.randn(1, 2, 397, d, device="cuda", dtype=torch.bfloat16)
        rb = torch.randn(1, 4, 400, 400, device="cuda", dtype=torch.bfloat16)[..., :397]
        flashattn_ext.scaled_dot_product_attention(q, kr, kr, attn_mask=rb, enable_gqa=True).sum().backward()
torch.use_deterministic_algorithms(False)
if os.environ.get("SAN_CASES") == "mask":  # only the case above
    torch.cuda.synchronize()
    print("sanitizer case ran")
    sys.exit(0)
for det in (False, True):
    for d in (64, 128, 256) if race else (64, 96, 128, 192, 256):
        for wr in (0, -1):
            q = torch.randn(1, 65, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, 130, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, 130, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            o, lse = _ops.fwd(q, k, v, 0.125, -1, wr, True, det)
            o.sum().backward()
cu = torch.tensor([0, 1, 70, 70, 200], dtype=torch.int32, device="cuda")
for d in (128, 256):
    q = torch.randn(200, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    o = flashattn_ext.flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu, cu, 130, 130, causal=True)
    o.sum().backward()
kc = torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
q = torch.randn(2, 100, 4, 128, device="cuda", dtype=torch.bfloat16)
seqlens = torch.tensor([150, 7], dtype=torch.int32, device="cuda")
flashattn_ext.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=seqlens, causal=True)
q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(2, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
seqlens = torch.tensor([1000, 333], dtype=torch.int32, device="cuda")
flashattn_ext.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=seqlens, num_splits=4)
table = torch.tensor([[3, 0, 6, 1], [2, 7, 4, 5]], dtype=torch.int32, device="cuda")
kp = kc.reshape(8, 256, 2, 128)
flashattn_ext.flash_attn_with_kvcache(q, kp, kp.clone(), cache_seqlens=seqlens, block_table=table, num_splits=4)
torch.cuda.synchronize()
print("sanitizer case ran")
EOF
  for tool in memcheck racecheck; do
    timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 9 python3 /tmp/san.py \
      $([ $tool = racecheck ] && echo race) > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  done
fi

if has tune; then
  stamp "tune: ${TUNE_ARGS:=--passes fwd --dims 64,128 --seqlens 512,1024,2048,4096,8192,16384}"
  # shellcheck disable=SC2086
  python3 benchmarks/tune.py --json "$OUT/tune.json" $TUNE_ARGS > "$OUT/tune.log" 2>&1 || status=1
  cat "$OUT/tune.log"
fi

if has crash; then
  stamp "crash: ${CRASH_TESTS:-tests/test_errors.py} under cuda-gdb"
  gdb=$(command -v cuda-gdb || ls ${CUDA_HOME:-/usr/local/cuda}/bin/cuda-gdb 2>/dev/null | head -1)
  if [ -z "$gdb" ]; then
    echo "crash: cuda-gdb not found (PATH, \$CUDA_HOME/bin)"; status=1
  else
    timeout ${CRASH_TIMEOUT:-540} "$gdb" -batch -ex run -ex bt --args \
      python3 -X faulthandler -m pytest -x -q -m cuda -p no:cacheprovider ${CRASH_TESTS:-tests/test_errors.py} \
      > "$OUT/crash_gdb.log" 2>&1
    echo "crash: cuda-gdb rc=$?; the signal and the first frames of the backtrace (full log: crash_gdb.log):"
    grep -E "received signal|CUDA Exception|^#[0-9]+ " "$OUT/crash_gdb.log" | head -25 | cut -c1-220
    if grep -qE "received signal|CUDA Exception" "$OUT/crash_gdb.log"; then status=1; fi
    tail -4 "$OUT/crash_gdb.log" | cut -c1-220
  fi
fi

if has ring; then
  # The ring's ranks as threads of one process on this GPU (issue 24's one-GPU overlap
  # measurement): RING_THREADS ranks at each of RING_SEQLENS tokens, fwd+bwd, causal,
  # each run under its own limit (SIGABRT: a hang leaves its Python traceback in the log).
  for n in ${RING_SEQLENS:-32768 131072}; do
    log="$OUT/ring_threads${RING_THREADS:-4}_$n.log"
    stamp "ring: ${RING_THREADS:-4} ranks as threads, $n tokens"
    timeout -s ABRT -k 5 ${RING_TIMEOUT:-150} python3 -X faulthandler examples/context_parallel.py \
      --threads ${RING_THREADS:-4} --seqlen "$n" --iters 3 --warmup 1 --overlap-report \
      --json "$OUT/ring_threads${RING_THREADS:-4}_$n.json" > "$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || { status=1; echo "ring: exit $rc"; tail -c 1500 "$log"; }
    grep -E "^ring|overlap" "$log"
  done
fi

if has bench && [ -f benchmarks/bench_gpu.py ]; then
  stamp "benchmark"
  # progress and errors to bench.log; the summary table (stdout) to bench.txt, printed last
  python3 benchmarks/bench_gpu.py --json "$OUT/bench.json" --md "$OUT/bench.md" ${BENCH_ARGS:-} \
    > "$OUT/bench.txt" 2> "$OUT/bench.log"
  rc=$?
  if [ $rc -ne 0 ]; then echo "bench_gpu.py exit $rc"; tail -20 "$OUT/bench.log"; status=1; fi
  cat "$OUT/bench.txt"
fi

stamp "visit done, status $status"
exit $status
