#!/usr/bin/env bash
# The A/Bs of the tuning-build switches that no GPU has timed yet, in one
# call on the GPU machine (~7 min with the build; results under $OUT/ab and
# $OUT/ab.tgz):
#   FLASHATTN_FWD_BIAS_STAGE=1   the 16-bit attn_mask through shared memory (session 28)
#   FLASHATTN_FWD_BATCH_MINOR=1  the batch-minor tile order for a mask shared by the batch (session 28)
#   FLASHATTN_DROPOUT_ONLY=1     the dropout-only forward / backward instances (session 29)
# Builds a tuning build (d64/128/256), runs the tests that reach the new code
# with the switches on, then bench_mask.py and bench_dropout.py --quick with
# the switches on and off (each part under its own timeout, so a hang costs
# only its part). benchmarks/NOTES.md, "The next GPU visit", says what to do
# with the outcome.
#
#   OUT=/tmp/out bash benchmarks/pending_ab_visit.sh
set -u
cd "$(dirname "$0")/.."
W=${OUT:-/tmp/flashattn_out}/ab
mkdir -p "$W"
export FLASHATTN_TUNING=1 PYTHONPATH=$PWD
timeout 240 env FLASHATTN_HEAD_DIMS=64,128,256 STAGES=build OUT="$W" bash benchmarks/gpu_visit.sh > "$W/build_stage.log" 2>&1
echo "build rc=$?"; tail -3 "$W/build_stage.log"
switches() { export FLASHATTN_FWD_BIAS_STAGE=$1 FLASHATTN_FWD_BATCH_MINOR=$1 FLASHATTN_DROPOUT_ONLY=$1; }
switches 1
timeout 100 python3 -m pytest -m cuda -q -x tests/test_sdpa.py -k "16bit_bias or long_sequences or hidden_tiles" \
  > "$W/pytest_staged_bias.log" 2>&1
echo "pytest staged bias rc=$?"; tail -2 "$W/pytest_staged_bias.log"
timeout 80 python3 -m pytest -m cuda -q -x tests/test_dropout.py > "$W/pytest_dropout_only.log" 2>&1
echo "pytest dropout-only rc=$?"; tail -2 "$W/pytest_dropout_only.log"
for on in 1 0; do
  switches $on
  timeout 70 python3 benchmarks/bench_mask.py --json "$W/mask_$on.json" --md "$W/mask_$on.md" --impls ours,cudnn \
    --masks none,bias_b,bias_h > "$W/mask_$on.log" 2>&1
  echo "bench_mask switches=$on rc=$?"
  timeout 60 python3 benchmarks/bench_dropout.py --quick --json "$W/dropout_$on.json" --md "$W/dropout_$on.md" \
    > "$W/dropout_$on.log" 2>&1
  echo "bench_dropout switches=$on rc=$?"
done
for f in mask_1 mask_0 dropout_1 dropout_0; do echo "== $f"; tail -12 "$W/$f.log"; done
(cd "$W/.." && tar czf ab.tgz ab)
