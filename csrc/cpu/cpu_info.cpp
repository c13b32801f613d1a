// flashattn_ext::cpu_runtime_info: what the CPU kernels do on this machine,
// for benchmarks and tests (an op of no tensors, registered for every
// dispatch key).
#include <torch/library.h>

#include <string>
#include <utility>

#include "tile_gemm.h"
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
std::string cpu_runtime_info(bool reset_peak) {
  std::string s = "peak_workers=" + std::to_string(cpu::WorkerBudget::peak_running(reset_peak));
  for (auto [name, kind] :
       {std::pair{"bf16_gemm", ScalarKind::kBFloat16}, std::pair{"fp16_gemm", ScalarKind::kFloat16}}) {
    s += std::string(";") + name + "=" + (cpu::lowp_gemm_enabled(kind) ? "brgemm" : "float32") + "(" +
         cpu::lowp_gemm_status(kind) + ")";
  }
  return s;
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_FRAGMENT(flashattn_ext, m) {
  m.def("cpu_runtime_info(bool reset_peak=False) -> str", &flashattn::cpu_runtime_info);
}
