// The two dropout ops that are not attention (schemas in csrc/ops.cpp):
// dropout_rng_state draws a call's [seed, offset] from torch's generator,
// dropout_keep_mask draws the keep mask of csrc/philox.h as the kernels do.
//
// The CPU generator (mt19937) has no Philox offset: the seed is a fresh
// 64-bit draw (gen->random64(), as torch's CPU bernoulli takes a seed from it
// for its own stream), the offset 0; torch.manual_seed replays the draws, and
// every call gets a seed of its own. The CUDA ops (cuda/dropout_cuda.cpp)
// take torch's graph-safe draw instead: philox_cuda_state(increment) under
// the generator's mutex, unpacked on the device by a one-thread kernel that
// writes rng_state (as FlashAttention-2 writes its rng_state), so that a
// captured graph's replays read the generator's advancing offset.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <mutex>

#include "attention_api.h"
#include "philox.h"

namespace flashattn {
namespace {

// (The CPU draw consumes no offset: batch and heads_q matter to the CUDA one.)
at::Tensor dropout_rng_state_cpu(const at::Tensor& like, int64_t batch, int64_t heads_q) {
  TORCH_CHECK_VALUE(batch >= 0 && heads_q >= 0, "flashattn_ext: dropout_rng_state: batch and heads_q must be >= 0");
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  uint64_t seed;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    seed = gen->random64();
  }
  at::Tensor state = at::empty({2}, like.options().dtype(at::kLong).device(at::kCPU));
  state.data_ptr<int64_t>()[0] = static_cast<int64_t>(seed);
  state.data_ptr<int64_t>()[1] = 0;
  return state;
}

at::Tensor dropout_keep_mask_cpu(const at::Tensor& rng_state, int64_t batch, int64_t heads_q, int64_t seqlen_q,
                                 int64_t seqlen_k, double dropout_p) {
  TORCH_CHECK_VALUE(batch >= 0 && heads_q >= 0 && seqlen_q >= 0 && seqlen_k >= 0,
                    "flashattn_ext: dropout_keep_mask: sizes must be >= 0");
  DropoutParams d = make_dropout(dropout_p, rng_state, at::Device(at::kCPU));
  if (!d.enabled()) d.keep_threshold = dropout_keep_threshold(0.0);  // p = 0 keeps everything
  at::Tensor keep = at::empty({batch, heads_q, seqlen_q, seqlen_k}, rng_state.options().dtype(at::kBool));
  bool* out = keep.data_ptr<bool>();
  const int64_t groups = (seqlen_k + 31) / 32 * 4;
  at::parallel_for(0, batch * heads_q * seqlen_q, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / seqlen_q, i = row % seqlen_q;
      const uint64_t plane = dropout_plane(d.offset, bh / heads_q, heads_q, bh % heads_q);
      bool* dst = out + row * seqlen_k;
      for (int64_t u = 0; u < groups; ++u) {
        const uint32_t bits =
            dropout_keep_bits(d.seed, plane, static_cast<uint32_t>(i), static_cast<uint32_t>(u), d.keep_threshold);
        for (int s = 0; s < 8; ++s) {
          const int64_t j = dropout_group_key(static_cast<uint32_t>(u), s);
          if (j < seqlen_k) dst[j] = (bits >> s) & 1u;
        }
      }
    }
  });
  return keep;
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn_ext, CPU, m) {
  m.impl("dropout_rng_state", &flashattn::dropout_rng_state_cpu);
  m.impl("dropout_keep_mask", &flashattn::dropout_keep_mask_cpu);
}
