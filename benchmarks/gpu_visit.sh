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
# test:     the pytest suite's cuda cases (tests/, -m cuda)
# selftest: python -m flashattn_ext (the README's main job)
# sanitize: compute-sanitizer memcheck and racecheck on a small case
# bench:    benchmarks/bench_gpu.py, the standard grid (BENCH_ARGS to narrow it)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashattn_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build check test selftest sanitize bench"}
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
  stamp "pytest (cuda)"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q --maxfail=30 -m cuda -p no:cacheprovider tests ${TEST_ARGS:-} \
    > "$OUT/pytest.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30
  tail -3 "$OUT/pytest.log"
fi

if has selftest; then
  stamp "self-check (python -m flashattn_ext)"
  python3 -m flashattn_ext --json "$OUT/selftest.json" > "$OUT/selftest.log" 2>&1 || status=1
  tail -25 "$OUT/selftest.log"
fi

if has sanitize; then
  stamp "compute-sanitizer"
  cat > /tmp/san.py <<'EOF'
import torch, flashattn_ext
from flashattn_ext import _ops
for det in (False, True):
    for d in (64, 128):
        q = torch.randn(1, 130, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 70, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 70, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        o, lse = _ops.fwd(q, k, v, 0.125, -1, 0, True, det)
        o.sum().backward()
torch.cuda.synchronize()
print("sanitizer case ran")
EOF
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 python3 /tmp/san.py > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  done
fi

if has bench && [ -f benchmarks/bench_gpu.py ]; then
  stamp "benchmark"
  python3 benchmarks/bench_gpu.py --json "$OUT/bench.json" --md "$OUT/bench.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40
fi

stamp "visit done, status $status"
exit $status
