// Switches of the CPU kernels.
//
// One environment variable, read at each call (so that a test or a benchmark
// can choose it per call in one process):
//
//   FLASHATTN_CPU_LOWP_GEMM=auto|brgemm|own
//                                  the bfloat16 / float16 tile products
//                                  (tile_gemm.h): auto, the default, takes
//                                  oneDNN's brgemm where the CPU has matrix
//                                  units for the dtype (AMX) or, for bfloat16,
//                                  AMD's AVX512-BF16, and our float32 path
//                                  elsewhere; brgemm wherever oneDNN runs it
//                                  (e.g. Intel's AVX512-BF16 without AMX:
//                                  slower, for tests); own never
//
// Test switches, not in the environment: process-wide values that only the
// test-only op flashattn_ext::_cpu_test_knob (cpu_info.cpp) sets, for the
// tests that compare two ways of computing one result bitwise and for A/B
// timings; a call reads one with a relaxed atomic load. 0 is the default.
//
//   TestKnob::kNoKeySplit   1: no flash-decoding key split (flash_cpu_fwd.cpp)
//   TestKnob::kBwdPasses    1 / 2: the backward in one / two passes, instead
//                           of the shape rule (flash_cpu_bwd.cpp)
//   TestKnob::kNoFusedSoftmax  1: the forward's spans take
//                           online_softmax_step (and pack_pairs), not their
//                           fused AVX-512 step (softmax_span.cpp)
//   TestKnob::kClaimOneItem 1: the parallel loops' workers claim one item at
//                           a time, not guided runs (work_queue.h)
//   TestKnob::kBwdTilesInPlace  1 / 2: the backward's float32 products read
//                           the q, dO, k and v tiles in place (where their
//                           stride is admitted) / from contiguous copies,
//                           instead of the machine's rule (flash_cpu_bwd.cpp
//                           bwd_tile_operand)
//   TestKnob::kFewQueriesOneKey  1: on AVX-512 the decoding scores and
//                           P V product take one key a pass
//                           (few_query_scores_vec16, few_queries_pv_rows),
//                           instead of four keys against four query rows
//                           (tile_ops.cpp few_query_scores_blocked,
//                           few_queries_pv_blocked): bitwise the same results;
//                           the blocked passes are 1.03-1.32x faster on an
//                           AVX-512 EPYC (cpu_perf_log.md, session 29)
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace flashattn {
namespace cpu {

enum class LowpGemm { kAuto, kBrgemm, kOwn };

inline LowpGemm lowp_gemm_choice() {
  const char* v = std::getenv("FLASHATTN_CPU_LOWP_GEMM");
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "auto") == 0) return LowpGemm::kAuto;
  if (std::strcmp(v, "brgemm") == 0) return LowpGemm::kBrgemm;
  return LowpGemm::kOwn;
}

enum class TestKnob : int {
  kNoKeySplit = 0,
  kBwdPasses = 1,
  kNoFusedSoftmax = 2,
  kClaimOneItem = 3,
  kBwdTilesInPlace = 4,
  kFewQueriesOneKey = 5
};
constexpr int kNumTestKnobs = 6;

// The knob's value (one object per process: an inline function's static).
inline std::atomic<int>& test_knob(TestKnob knob) {
  static std::atomic<int> values[kNumTestKnobs];
  return values[static_cast<int>(knob)];
}

inline int test_knob_value(TestKnob knob) { return test_knob(knob).load(std::memory_order_relaxed); }

}  // namespace cpu
}  // namespace flashattn
