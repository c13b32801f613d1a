// flashattn_ext::cpu_runtime_info: what the CPU kernels do on this machine,
// and flashattn_ext::_cpu_test_knob, the test switches of cpu_knobs.h,
// for benchmarks and tests (ops of no tensors, registered for every
// dispatch key).
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "cpu_knobs.h"
#include "flash_cpu.h"
#include "tile_gemm.h"
#include "tile_ops.h"
#include "work_queue.h"

namespace flashattn {
namespace {

// "key=value;...":
//   peak_workers   the most worker threads of the kernels' parallel loops
//                  that ran at once since the last reset (reset_peak=True
//                  reads and restarts it)
//   bf16_gemm, fp16_gemm   the tile products of that dtype now: "brgemm"
//                  (oneDNN, on the matrix units where the CPU has them) or
//                  "float32" (our float32 path), then in brackets what the
//                  machine offers (tile_gemm.h lowp_gemm_status)
//   fused_softmax  the forward spans' fused float32 softmax step now
//                  (softmax_span.cpp): "avx512bf16", "avx2" or "none"
//   bwd_tiles      how the backward's float32 products read the q, dO, k
//                  and v tiles now (flash_cpu_bwd.cpp): "copied" or "in_place"
std::string cpu_runtime_info(bool reset_peak) {
  std::string s = "peak_workers=" + std::to_string(cpu::WorkerBudget::peak_running(reset_peak));
  for (auto [name, kind] :
       {std::pair{"bf16_gemm", ScalarKind::kBFloat16}, std::pair{"fp16_gemm", ScalarKind::kFloat16}}) {
    s += std::string(";") + name + "=" + (cpu::lowp_gemm_enabled(kind) ? "brgemm" : "float32") + "(" +
         cpu::lowp_gemm_status(kind) + ")";
  }
  const cpu::FusedSoftmax fused = cpu::fused_softmax_step();
  s += std::string(";fused_softmax=") + (fused == cpu::FusedSoftmax::kAvx512Bf16 ? "avx512bf16"
                                         : fused == cpu::FusedSoftmax::kAvx2     ? "avx2"
                                                                                 : "none");
  s += std::string(";bwd_tiles=") + (bwd_cpu_copies_tiles() ? "copied" : "in_place");
  return s;
}

// A test switch of cpu_knobs.h by name ("no_key_split", "bwd_passes",
// "no_fused_softmax", "claim_one_item", "bwd_tiles_in_place",
// "few_queries_one_key"): sets
// it to `value` (0: the default) and returns its value before; value -1 only
// reads it. For tests and A/B timings, not for models: it is process-wide.
int64_t cpu_test_knob(const std::string& name, int64_t value) {
  cpu::TestKnob knob;
  if (name == "no_key_split") {
    knob = cpu::TestKnob::kNoKeySplit;
  } else if (name == "bwd_passes") {
    knob = cpu::TestKnob::kBwdPasses;
  } else if (name == "no_fused_softmax") {
    knob = cpu::TestKnob::kNoFusedSoftmax;
  } else if (name == "claim_one_item") {
    knob = cpu::TestKnob::kClaimOneItem;
  } else if (name == "bwd_tiles_in_place") {
    knob = cpu::TestKnob::kBwdTilesInPlace;
  } else if (name == "few_queries_one_key") {
    knob = cpu::TestKnob::kFewQueriesOneKey;
  } else {
    TORCH_CHECK_VALUE(false, "flashattn_ext: no CPU test knob named '", name,
                      "' (no_key_split, bwd_passes, no_fused_softmax, claim_one_item, bwd_tiles_in_place, "
                      "few_queries_one_key)");
  }
  std::atomic<int>& v = cpu::test_knob(knob);
  return value < 0 ? v.load() : v.exchange(static_cast<int>(value));
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_FRAGMENT(flashattn_ext, m) {
  m.def("cpu_runtime_info(bool reset_peak=False) -> str", &flashattn::cpu_runtime_info);
  m.def("_cpu_test_knob(str name, int value=-1) -> int", &flashattn::cpu_test_knob);
}
