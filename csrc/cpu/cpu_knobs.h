// Environment knobs of the CPU kernels, read at each call (so that a
// benchmark can time a choice beside the default in one process, as the CUDA
// path's FLASHATTN_DISABLE_TMA does):
//
//   FLASHATTN_CPU_NO_KEY_SPLIT=1   no flash-decoding key split (flash_cpu_fwd.cpp)
//   FLASHATTN_CPU_LOWP_GEMM=auto|brgemm|own
//                                  the bfloat16 / float16 tile products
//                                  (tile_gemm.h): auto, the default, takes
//                                  oneDNN's brgemm where the CPU has matrix
//                                  units for the dtype (AMX) and our float32
//                                  path elsewhere; brgemm wherever oneDNN runs
//                                  it (e.g. AVX512-BF16 without AMX: slower,
//                                  for tests); own never
#pragma once

#include <cstdlib>
#include <cstring>

namespace flashattn {
namespace cpu {

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

enum class LowpGemm { kAuto, kBrgemm, kOwn };

inline LowpGemm lowp_gemm_choice() {
  const char* v = std::getenv("FLASHATTN_CPU_LOWP_GEMM");
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "auto") == 0) return LowpGemm::kAuto;
  if (std::strcmp(v, "brgemm") == 0) return LowpGemm::kBrgemm;
  return LowpGemm::kOwn;
}

}  // namespace cpu
}  // namespace flashattn
