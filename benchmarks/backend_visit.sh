#!/usr/bin/env bash
# One short visit to the GPU machine for issue 24 (our kernels behind torch's SDPA):
# about 1-2 minutes on one H200.
#
#   OUT=/tmp/out bash benchmarks/backend_visit.sh
#
# 1. build in place for sm_90a, head dim 64 only (what the steps below need; all
#    cores), unless a CUDA build is already there;
# 2. tests/test_backend.py's CUDA cases (the activated path on CUDA, torch.compile and
#    a CUDA graph of it): $OUT/pytest_backend.log;
# 3. benchmarks/host_overhead.py --activated: host us per call of torch's SDPA, the
#    drop-in and the activated call (b1 h1 n16 d64 bf16 causal, the GPU kept busy so
#    that only host time is timed): $OUT/host_activated.json;
# 4. the layouts torch's own CUDA flash op returns for the inputs a Hugging Face
#    GPT-2 (q, k, v split from one projection: not dense) and Llama (q, k contiguous
#    after rotary, v a transposed view) give it, against its meta function's (which
#    the overrides follow): whether the overrides' re-layout copies match torch
#    eager: $OUT/layouts.json;
# 5. benchmarks/backend_train_step.py: HF Llama / GPT-2 training step, torch vs
#    activated vs the drop-in, step and host times: $OUT/backend_train_step.json.
# A summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashattn_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0
stamp() { echo "[$(date +%T)] $*"; }

stamp "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
if python3 -c "import flashattn_ext, torch, sys; sys.exit(0 if 'cuda=1' in torch.ops.flashattn_ext.build_info() else 1)" 2>/dev/null; then
  stamp "using the carried build"
else
  stamp "building (sm_90a, head dim 64)"
  t0=$(date +%s)
  FLASHATTN_CUDA_ARCHS=${FLASHATTN_CUDA_ARCHS:-90} FLASHATTN_HEAD_DIMS=${FLASHATTN_HEAD_DIMS:-64} \
    MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
    || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
  stamp "built in $(( $(date +%s) - t0 )) s"
fi

stamp "tests/test_backend.py -m cuda"
python3 -m pytest -q -m cuda tests/test_backend.py > "$OUT/pytest_backend.log" 2>&1 || status=1
tail -3 "$OUT/pytest_backend.log"

stamp "host time per call behind torch's SDPA"
python3 benchmarks/host_overhead.py --activated --json "$OUT/host_activated.json" > "$OUT/host_activated.log" 2>&1 || status=1

stamp "layouts of torch's own CUDA flash op"
python3 - "$OUT/layouts.json" > "$OUT/layouts.log" 2>&1 <<'PY' || status=1
import json, sys
import torch
aten = torch.ops.aten
b, n, h, d = 2, 128, 4, 64
x = torch.randn(b, n, 3 * h * d, device="cuda", dtype=torch.bfloat16)
split = [t.view(b, n, h, d).transpose(1, 2) for t in x.split(h * d, dim=2)]  # GPT-2: not dense
dense = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)  # Llama's q, k after rotary
tview = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # Llama's v
res = {}
for name, (q, k, v) in {"gpt2_split": split, "llama": (dense, dense.clone(), tview)}.items():
    out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    go = torch.randn_like(out[0])
    grads = aten._scaled_dot_product_flash_attention_backward(go, q, k, v, out[0], out[1], *out[2:6], 0.0, True, out[6], out[7])
    meta = [torch.empty_like(t, device="meta").stride() for t in (q, q, k, v)]
    res[name] = {
        "torch_eager": {"out": out[0].stride(), "dq": grads[0].stride(), "dk": grads[1].stride(), "dv": grads[2].stride()},
        "meta": dict(zip(("out", "dq", "dk", "dv"), meta)),
        "seed_offset": [str(out[6].dtype), list(out[6].shape), str(out[6].device), list(out[7].shape)],
    }
    print(name, json.dumps(res[name]))
json.dump(res, open(sys.argv[1], "w"), indent=1)
PY

stamp "HF training step (torch / activated / drop-in)"
if python3 -c "import transformers" 2>/dev/null; then
  python3 benchmarks/backend_train_step.py --json "$OUT/backend_train_step.json" > "$OUT/backend_train_step.log" 2>&1 || status=1
else
  echo "transformers is not installed here: backend_train_step.py skipped" | tee "$OUT/backend_train_step.log"
  status=1
fi

echo
echo "=== summary"
tail -1 "$OUT/pytest_backend.log"
grep -A20 "host us/call" "$OUT/host_activated.log"
cat "$OUT/layouts.log"
grep -E "^(llama|gpt2)|transformers" "$OUT/backend_train_step.log"
exit $status
