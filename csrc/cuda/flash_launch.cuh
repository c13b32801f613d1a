// Grid shapes and launches of the forward and backward kernels.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <type_traits>

#include "dispatch.h"
#include "flash_bwd_kernel.cuh"
#include "flash_fwd_kernel.cuh"
#include "hopper/bwd_sm90_dq_convert.cuh"
#include "hopper/flash_bwd_sm90_kernel.cuh"
#include "hopper/flash_bwd_sm90_ws_kernel.cuh"
#include "hopper/flash_bwd_sm90_ws_split_kernel.cuh"
#include "hopper/flash_fwd_sm90_kernel.cuh"
#include "hopper/flash_fwd_sm90_ws_kernel.cuh"
#include "hopper/tma_host.h"
#include "kernel_configs.h"
#include "smem_limit.h"

namespace flashattn {

// Multiprocessors of the current device (persistent grids), read once per device.
inline int sm_count() {
  static int counts[64] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 0;
  if (counts[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    counts[dev] = n > 0 ? n : 1;
  }
  return counts[dev];
}

// The kernels that run varlen batches are compiled twice (kVarlen, picked by
// p.is_varlen() below; p.per_sequence() for the warp-specialized TMA forward,
// which also runs dense batches with seqused_k): the dense instance keeps no
// varlen state in its registers (SeqInfo's fields are the params' constants
// there). With one instance for both, ptxas spilled in kernels that had not
// spilled before.

// Dropout (p.dropout.enabled()) runs in the score-mod instances of the
// mma.sync kernels and of the warp-specialized TMA ones (a runtime branch
// there, so the plain instances hold no dropout code and there are no
// instances more to compile). The cp.async wgmma kernels have no score-mod
// instances, so no dropout: the rule below keeps such calls off them (one use
// at each of their dispatch points in run_fwd / run_bwd).
inline bool sm90_declines_dropout(const AttnFwdParams& p) { return p.dropout.enabled(); }
// The instance a call runs: the score-mod one for a score mod or dropout.
inline bool runs_score_mod_instance(const AttnFwdParams& p) { return p.score_mod.any() || p.dropout.enabled(); }

// Tuning builds: FLASHATTN_FWD_MASK_STEPS=any keeps the forward's plain
// dense calls on the kAny instance (the mask tested at every key block), the
// A/B of tune.py --fwd-switches against the default MaskSteps::kFirst.
#ifdef FLASHATTN_TUNING
inline bool fwd_mask_at_every_step_requested() {
  const char* v = std::getenv("FLASHATTN_FWD_MASK_STEPS");
  return v && std::strcmp(v, "any") == 0;
}
#else
constexpr bool fwd_mask_at_every_step_requested() { return false; }
#endif

// Tuning builds only, until a GPU run has checked them (written in session 28,
// when no GPU could be started; benchmarks/NOTES.md, "The next GPU visit"):
// FLASHATTN_FWD_BIAS_STAGE=1 sends a 16-bit float attn_mask whose tiles can be
// copied through shared memory (ScoreModSet::kAttnBiasStaged,
// hopper/fwd_sm90_bias_stage.cuh); FLASHATTN_FWD_BATCH_MINOR=1 lets a mask
// shared by the batch entries take the batch-minor tile order
// (hopper/tile_scheduler.cuh). Production builds run neither.
// FLASHATTN_DROPOUT_ONLY=1 (session 29) sends a dense call with dropout and
// no score mod to the dropout-only instances of the Hopper forward and
// backward (ScoreModSet::kDropout: no softcap / ALiBi code; the forward draws
// its keep bits under the S GEMM) instead of the flash-attn score-mod ones.
#ifdef FLASHATTN_TUNING
inline bool fwd_env_on(const char* name) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, "1") == 0;
}
inline bool fwd_bias_stage_requested() { return fwd_env_on("FLASHATTN_FWD_BIAS_STAGE"); }
inline bool fwd_batch_minor_requested() { return fwd_env_on("FLASHATTN_FWD_BATCH_MINOR"); }
inline bool dropout_only_requested() { return fwd_env_on("FLASHATTN_DROPOUT_ONLY"); }
#else
constexpr bool fwd_bias_stage_requested() { return false; }
constexpr bool fwd_batch_minor_requested() { return false; }
constexpr bool dropout_only_requested() { return false; }
#endif

// All grids are one-dimensional: blockIdx.x goes to 2^31 - 1, where y and z
// stop at 65535 (batch x heads can exceed that). The binding layer checks the
// block count fits. A varlen batch sizes them by max_seqlen_q / max_seqlen_k,
// which may be 0 (every sequence empty): an empty grid is no launch (CUDA
// rejects a launch of zero blocks).
template <typename Kt>
cudaError_t launch_fwd(const AttnFwdParams& p, cudaStream_t stream) {
  const bool mod = runs_score_mod_instance(p);
  auto kernel = p.is_varlen() ? (mod ? &flash_fwd_kernel<Kt, true, true> : &flash_fwd_kernel<Kt, true, false>)
                              : (mod ? &flash_fwd_kernel<Kt, false, true> : &flash_fwd_kernel<Kt, false, false>);
  if (cudaError_t err = allow_smem(kernel, Kt::kSmemBytes); err != cudaSuccess) return err;
  const int64_t blocks = int64_t(ceil_div(p.seqlen_q, Kt::kBlockM)) * p.batch * p.heads_q;
  if (blocks == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(blocks), Kt::kNThreads, Kt::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Hopper: the wgmma forward; same grid as launch_fwd.
template <typename Kt>
cudaError_t launch_fwd_sm90(const AttnFwdParams& p, cudaStream_t stream) {
  auto kernel = p.is_varlen() ? &flash_fwd_sm90_kernel<Kt, true> : &flash_fwd_sm90_kernel<Kt, false>;
  if (cudaError_t err = allow_smem(kernel, Kt::kSmemBytes); err != cudaSuccess) return err;
  const int64_t blocks = int64_t(ceil_div(p.seqlen_q, Kt::kBlockM)) * p.batch * p.heads_q;
  if (blocks == 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(blocks), Kt::kNThreads, Kt::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Hopper, warp-specialized with TMA: a persistent grid (one CTA an SM, at
// most one a tile). Sets *launched = false (and launches nothing) when TMA
// cannot describe one of the tensors.
//
// A varlen batch runs the kernel's kVarlen instance over tensor maps of the
// packed tensors as one batch entry of total_q / total_k rows (the kernel
// locates each sequence's rows through SeqInfo). A packed tensor without rows
// (total_q or total_k 0: every query, or every key, sequence empty) has no
// tensor map (TMA needs a non-zero extent): the kernels below run it.
//
// A dense batch with seqused_k (per-entry key lengths: the KV-cache prefill)
// keeps the dense tensor maps (batch entries of seqlen_q / seqlen_k rows, the
// cache's capacity) and runs the kVarlen instance, whose SeqInfo gives each
// entry its own key count and diagonal.
//
// kScoreModInstances = false: Kt gets no softcap / ALiBi instances (fewer to
// compile; a call with a score mod is then declined, *launched = false).
template <typename Kt, bool kScoreModInstances = true>
cudaError_t launch_fwd_sm90_ws(const AttnFwdParams& p, cudaStream_t stream, bool* launched) {
  *launched = false;
  const bool mod = runs_score_mod_instance(p), bias = p.score_mod.has_bias();
  if (!kScoreModInstances && mod) return cudaSuccess;
  constexpr bool kBf16 = std::is_same_v<typename Kt::Element, __nv_bfloat16>;
  const bool varlen = p.is_varlen();
  if (varlen && (p.total_q == 0 || p.total_k == 0)) return cudaSuccess;
  const int batch = varlen ? 1 : p.batch;
  int rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k, batch_k = batch;
  FwdTmaMaps maps;
  int box_k = Kt::kBlockN;
  if (p.kv.paged()) {  // (num_blocks, page_size) in boxes that never cross a page (fwd_sm90_producer.cuh)
    rows_k = p.kv.page_size, batch_k = p.kv.cache_rows;
    box_k = std::gcd(p.kv.page_size, Kt::kBlockN);
    maps.kv_box_rows = box_k;
  } else if (p.kv.cache_rows > 0) {  // a KV cache's rows (cache_batch_idx): its own batch size
    batch_k = p.kv.cache_rows;
  }
  const bool described = make_tensor_map_bshd(&maps.q, p.q_ptr, kBf16, batch, rows_q, p.heads_q, p.head_dim,
                                              p.q_batch_stride, p.q_row_stride, p.q_head_stride, Kt::kBlockM) &&
                         make_tensor_map_bshd(&maps.k, p.k_ptr, kBf16, batch_k, rows_k, p.heads_kv, p.head_dim,
                                              p.k_batch_stride, p.k_row_stride, p.k_head_stride, box_k) &&
                         make_tensor_map_bshd(&maps.v, p.v_ptr, kBf16, batch_k, rows_k, p.heads_kv, p.head_dim,
                                              p.v_batch_stride, p.v_row_stride, p.v_head_stride, box_k) &&
                         make_tensor_map_bshd(&maps.o, p.o_ptr, kBf16, batch, rows_q, p.heads_q, p.head_dim,
                                              p.o_batch_stride, p.o_row_stride, p.o_head_stride, Kt::kOStoreRows);
  if (!described) return cudaSuccess;
  // The score-mod instances: flash-attn's softcap / ALiBi, and (dense batches
  // only: SDPA has no varlen form) torch SDPA's attn_mask.
  constexpr ScoreModSet kNone = ScoreModSet::kNone;
  constexpr ScoreModSet kFa = kScoreModInstances ? ScoreModSet::kFlashAttn : kNone;
  constexpr ScoreModSet kBias = kScoreModInstances ? ScoreModSet::kAttnBias : kNone;
  // A 16-bit float mask whose tiles can be copied goes through shared memory (hopper/fwd_sm90_bias_stage.cuh).
  constexpr ScoreModSet kBiasStaged = kScoreModInstances && Kt::kBiasStageFits ? ScoreModSet::kAttnBiasStaged : kBias;
  const bool staged = bias && !p.per_sequence() && kBiasStaged != kBias && p.score_mod.bias.tiles_copyable() &&
                      fwd_bias_stage_requested();
  // Dropout with no score mod: the dropout-only instance (tuning builds, until timed).
  constexpr ScoreModSet kDropoutOnly = kScoreModInstances ? ScoreModSet::kDropout : kNone;
  const bool dropout_only = !p.per_sequence() && p.dropout.enabled() && !p.score_mod.any() && kDropoutOnly != kNone &&
                            dropout_only_requested();
  auto kernel = p.per_sequence()
                    ? (mod ? &flash_fwd_sm90_ws_kernel<Kt, true, kFa> : &flash_fwd_sm90_ws_kernel<Kt, true, kNone>)
                : staged       ? &flash_fwd_sm90_ws_kernel<Kt, false, kBiasStaged>
                : bias         ? &flash_fwd_sm90_ws_kernel<Kt, false, kBias>
                : dropout_only ? &flash_fwd_sm90_ws_kernel<Kt, false, kDropoutOnly>
                : mod          ? &flash_fwd_sm90_ws_kernel<Kt, false, kFa>
                               : &flash_fwd_sm90_ws_kernel<Kt, false, kNone>;
  // The plain dense calls whose mask cuts only a tile's first key block
  // (BlockMask::masks_first_step_only) run the instance whose key-block loop
  // holds no mask code (MaskSteps::kFirst; bitwise equal to kAny, level with
  // it in time: benchmarks/NOTES.md, "The mask as a compile-time policy").
  if (!p.per_sequence() && !bias && !mod && !fwd_mask_at_every_step_requested() &&
      BlockMask(p.seqlen_q, p.seqlen_k, p.mask.window_left, p.mask.window_right, p.mask.diag_offset)
          .masks_first_step_only<Kt::kBlockM, Kt::kBlockN>())
    kernel = &flash_fwd_sm90_ws_kernel<Kt, false, kNone, MaskSteps::kFirst>;
  // The staged attn_mask instance also holds the consumers' mask tiles.
  const int smem_bytes = staged ? Kt::kSmemBytesBiasStage : Kt::kSmemBytes;
  if (cudaError_t err = allow_smem(kernel, smem_bytes); err != cudaSuccess) return err;
  // Pairs before the dynamic order above head dim 128 and from 64 query blocks (tile_scheduler.cuh; session
  // 17, tune.py, causal, dynamic / paired TFLOP/s in three runs: d256 4k 558/620, 571/623, 578/635, 8k
  // 604/665, 605/669, 572/668; d128 8k 589/624, 628/634, 616/641; d128 2k 563/540, 561/535, 567/541, 4k
  // 591/579, 622/600, 633/613; d64 4k 434/420, 437/421, 439/424, 8k 474/464, 477/451, 493/468;
  // benchmarks/NOTES.md).
  constexpr bool kPairsFirst = Kt::kHeadDim > 128;
  FwdSchedule sched = FwdSchedule::make(p, Kt::kBlockM, sm_count(), kPairsFirst);
  if (!fwd_batch_minor_requested()) sched.batch_minor = false;
  // The kVarlen instance has only the dynamic order (tile_scheduler.cuh),
  // which needs the binding's counter (every binding gives one).
  if (p.per_sequence() && !sched.dynamic()) return cudaSuccess;
  int ctas = sched.num_units() < sm_count() ? sched.num_units() : sm_count();  // persistent: one CTA an SM
#ifdef FLASHATTN_TUNING
  // Tuning builds time the tile schedule's alternatives beside the default
  // (FLASHATTN_FWD_GRID): `single` keeps the persistent grid without pairs;
  // `tiles` launches one CTA a tile in the global order (heaviest first in
  // each L2 group), so the hardware's CTA dispatch balances the SMs as a
  // longest-first list schedule would, at the price of the next tile's loads
  // under the current one's epilogue; `static` the static orders (pairs
  // where their rule says so, tile_scheduler.cuh), `unbalanced` those with
  // the L2 groups before they were made equal; `dynamic` the dynamic order
  // where the default pairs (a call with a counter). Varlen batches: the
  // dynamic order only.
  if (const char* grid = std::getenv("FLASHATTN_FWD_GRID")) {
    const bool tiles = std::strcmp(grid, "tiles") == 0;
    if (p.per_sequence()) {
      // (only the dynamic order)
    } else if (tiles || std::strcmp(grid, "single") == 0) {
      sched.paired = false;
      sched.tile_counter = nullptr;
      ctas = tiles ? sched.num_tiles : (sched.num_tiles < sm_count() ? sched.num_tiles : sm_count());
    } else if (std::strcmp(grid, "static") == 0) {  // pairs by the rule, else static striding
      sched = FwdSchedule::make(p, Kt::kBlockM, sm_count(), true);
      sched.tile_counter = nullptr;
      ctas = sched.num_units() < sm_count() ? sched.num_units() : sm_count();
    } else if (std::strcmp(grid, "unbalanced") == 0) {  // static, the L2 groups before they were made equal
      sched = FwdSchedule::make(p, Kt::kBlockM, sm_count(), true);
      sched.tile_counter = nullptr;
      ctas = sched.num_units() < sm_count() ? sched.num_units() : sm_count();
      const int64_t num_bh = int64_t(p.batch) * p.heads_q;
      const int64_t group =
          FwdSchedule::kL2GroupBytes / std::max<int64_t>(1, int64_t(p.seqlen_k) * p.head_dim * 4 / p.heads_ratio());
      sched.group_bh = static_cast<int>(std::clamp<int64_t>(group, 1, std::max<int64_t>(num_bh, 1)));
    } else if (std::strcmp(grid, "dynamic") == 0 && p.tile_counter != nullptr) {
      sched.paired = false;
      sched.tile_counter = p.tile_counter;
      ctas = sched.num_tiles < sm_count() ? sched.num_tiles : sm_count();
    }
  }
#endif
  *launched = true;
  if (ctas == 0) return cudaSuccess;  // no query rows (varlen: max_seqlen_q = 0): nothing to write
  sched.set_ctas(ctas);
  kernel<<<ctas, Kt::kNThreads, smem_bytes, stream>>>(p, maps, sched);
  return cudaGetLastError();
}

// D = rowsum(dO * O) (and dq_accum zeroed, see bwd_preprocess_kernel): head_dim / 8
// lanes a row, rounded up to a power of two.
template <typename T, bool kWholeBlocks = false>
cudaError_t launch_bwd_preprocess(const AttnBwdParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.heads_q * (kWholeBlocks ? ceil_div(p.seqlen_q, 64) * 64 : p.seqlen_q);
  if (rows == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  auto launch = [&](auto kernel, int lanes_per_row) {
    kernel<<<static_cast<unsigned>((rows * lanes_per_row + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  };
  const int chunks = p.head_dim / 8;
  if (chunks <= 4) return launch(&bwd_preprocess_kernel<T, 4, kWholeBlocks>, 4);
  if (chunks <= 8) return launch(&bwd_preprocess_kernel<T, 8, kWholeBlocks>, 8);
  if (chunks <= 16) return launch(&bwd_preprocess_kernel<T, 16, kWholeBlocks>, 16);
  return launch(&bwd_preprocess_kernel<T, 32, kWholeBlocks>, 32);
}

// dq = scale * dq_accum in the input dtype.
template <typename T>
cudaError_t launch_convert_dq(const AttnBwdParams& p, cudaStream_t stream) {
  const int64_t chunks = int64_t(p.batch) * p.heads_q * p.seqlen_q * (p.head_dim / 8);
  if (chunks == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  convert_dq_kernel<T><<<static_cast<unsigned>((chunks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename Kt, typename KtDq>
cudaError_t launch_bwd(const AttnBwdParams& p, cudaStream_t stream) {
  using T = typename Kt::Element;
  static_assert(Kt::kBlockM <= kBwdBlockM && kBwdBlockM % Kt::kBlockM == 0,
                "the dQ accumulator is padded to kBwdBlockM rows");
  if (cudaError_t err = launch_bwd_preprocess<T>(p, stream); err != cudaSuccess) return err;

  const int64_t dkdv_blocks = int64_t(ceil_div(p.seqlen_k, Kt::kBlockN)) * Kt::kDSplit * p.heads_kv * p.batch;
  // (Calls with softcap / ALiBi / attn_mask / dropout: the kScoreMod instances, flash_bwd_kernel.cuh.)
  const bool mod = runs_score_mod_instance(p);
  if (!p.deterministic) {
    auto kernel = p.is_varlen()
                      ? (mod ? &flash_bwd_dkdv_kernel<Kt, true, true, true> : &flash_bwd_dkdv_kernel<Kt, true, true>)
                      : (mod ? &flash_bwd_dkdv_kernel<Kt, true, false, true> : &flash_bwd_dkdv_kernel<Kt, true, false>);
    if (cudaError_t err = allow_smem(kernel, Kt::kSmemBytes); err != cudaSuccess) return err;
    if (dkdv_blocks > 0) kernel<<<static_cast<unsigned>(dkdv_blocks), Kt::kNThreads, Kt::kSmemBytes, stream>>>(p);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    return launch_convert_dq<T>(p, stream);
  }

  auto dkdv = p.is_varlen()
                  ? (mod ? &flash_bwd_dkdv_kernel<Kt, false, true, true> : &flash_bwd_dkdv_kernel<Kt, false, true>)
                  : (mod ? &flash_bwd_dkdv_kernel<Kt, false, false, true> : &flash_bwd_dkdv_kernel<Kt, false, false>);
  if (cudaError_t err = allow_smem(dkdv, Kt::kSmemBytes); err != cudaSuccess) return err;
  if (dkdv_blocks > 0) dkdv<<<static_cast<unsigned>(dkdv_blocks), Kt::kNThreads, Kt::kSmemBytes, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  auto dq = p.is_varlen() ? (mod ? &flash_bwd_dq_kernel<KtDq, true, true> : &flash_bwd_dq_kernel<KtDq, true>)
                          : (mod ? &flash_bwd_dq_kernel<KtDq, false, true> : &flash_bwd_dq_kernel<KtDq, false>);
  if (cudaError_t err = allow_smem(dq, KtDq::kSmemBytes); err != cudaSuccess) return err;
  const int64_t dq_blocks = int64_t(ceil_div(p.seqlen_q, KtDq::kBlockM)) * p.batch * p.heads_q;
  if (dq_blocks > 0) dq<<<static_cast<unsigned>(dq_blocks), KtDq::kNThreads, KtDq::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Hopper: the wgmma dK/dV/dQ kernel (non-deterministic dQ atomics).
template <typename Kt>
cudaError_t launch_bwd_sm90(const AttnBwdParams& p, cudaStream_t stream) {
  using T = typename Kt::Element;
  static_assert(kBwdBlockM % Kt::kBlockM == 0, "the dQ accumulator is padded to kBwdBlockM rows");
  if (cudaError_t err = launch_bwd_preprocess<T>(p, stream); err != cudaSuccess) return err;
  auto kernel = p.is_varlen() ? &flash_bwd_sm90_kernel<Kt, true> : &flash_bwd_sm90_kernel<Kt, false>;
  if (cudaError_t err = allow_smem(kernel, Kt::kSmemBytes); err != cudaSuccess) return err;
  const int64_t blocks = int64_t(ceil_div(p.seqlen_k, Kt::kBlockN)) * p.heads_kv * p.batch;
  if (blocks > 0) kernel<<<static_cast<unsigned>(blocks), Kt::kNThreads, Kt::kSmemBytes, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return launch_convert_dq<T>(p, stream);
}

// Hopper, warp-specialized with TMA (dQ by bulk reduce-adds; in a fixed order
// when p.deterministic). Sets *launched = false (and launches nothing) when TMA cannot
// describe one of the tensors.
//
// A varlen batch runs the kernels' kVarlen instances, as launch_fwd_sm90_ws
// does: tensor maps of the packed tensors as one batch entry of total_q /
// total_k rows, a grid of ceil(max_seqlen_k / kBlockN) key blocks per
// (sequence, kv head) (those past their sequence exit), the dQ accumulator in
// the varlen layout (flash_params.h; its columns whole 64-column blocks, as
// for dense batches, varlen_bwd_cuda) and convert_dq_frag_kernel's varlen
// instance. A packed tensor without rows (total_q or total_k 0) has no tensor
// map: the kernels after this one in run_bwd take the batch.
// kScoreModInstances as for launch_fwd_sm90_ws.
template <typename Kt, bool kScoreModInstances = true>
cudaError_t launch_bwd_sm90_ws(const AttnBwdParams& p, cudaStream_t stream, bool* launched) {
  using T = typename Kt::Element;
  static_assert(kBwdBlockM % Kt::kBlockM == 0, "the dQ accumulator is padded to kBwdBlockM rows");
  *launched = false;
  if (!kScoreModInstances && runs_score_mod_instance(p)) return cudaSuccess;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  const bool varlen = p.is_varlen();
  if (varlen && (p.total_q == 0 || p.total_k == 0)) return cudaSuccess;
  const int batch = varlen ? 1 : p.batch;
  const int rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  BwdTmaMaps maps;
  const bool described = make_tensor_map_bshd(&maps.q, p.q_ptr, kBf16, batch, rows_q, p.heads_q, p.head_dim,
                                              p.q_batch_stride, p.q_row_stride, p.q_head_stride, Kt::kBlockM) &&
                         make_tensor_map_bshd(&maps.dout, p.do_ptr, kBf16, batch, rows_q, p.heads_q, p.head_dim,
                                              p.do_batch_stride, p.do_row_stride, p.do_head_stride, Kt::kBlockM) &&
                         make_tensor_map_bshd(&maps.k, p.k_ptr, kBf16, batch, rows_k, p.heads_kv, p.head_dim,
                                              p.k_batch_stride, p.k_row_stride, p.k_head_stride, Kt::kBlockN) &&
                         make_tensor_map_bshd(&maps.v, p.v_ptr, kBf16, batch, rows_k, p.heads_kv, p.head_dim,
                                              p.v_batch_stride, p.v_row_stride, p.v_head_stride, Kt::kBlockN);
  if (!described) return cudaSuccess;
  // The score-mod instances as in launch_fwd_sm90_ws: flash-attn's softcap /
  // ALiBi, and (dense batches only) torch SDPA's attn_mask.
  constexpr ScoreModSet kNone = ScoreModSet::kNone;
  constexpr ScoreModSet kFa = kScoreModInstances ? ScoreModSet::kFlashAttn : kNone;
  constexpr ScoreModSet kBias = kScoreModInstances ? ScoreModSet::kAttnBias : kNone;
  constexpr ScoreModSet kBiasGrad = kScoreModInstances ? ScoreModSet::kAttnBiasGrad : kNone;
  // Dropout with no score mod: the dropout-only instance (tuning builds, until timed).
  constexpr ScoreModSet kDropoutOnly = kScoreModInstances ? ScoreModSet::kDropout : kNone;
  const bool dropout_only =
      !varlen && p.dropout.enabled() && !p.score_mod.any() && kDropoutOnly != kNone && dropout_only_requested();
  auto kernel = [varlen, mod = runs_score_mod_instance(p), bias = p.score_mod.has_bias(),
                 bias_grad = p.score_mod.bias.grad != nullptr, dropout_only] {
    if constexpr (Kt::kSplitHeadDim)
      return varlen         ? (mod ? &flash_bwd_sm90_ws_split_kernel<Kt, true, kFa>
                                   : &flash_bwd_sm90_ws_split_kernel<Kt, true, kNone>)
             : bias_grad    ? &flash_bwd_sm90_ws_split_kernel<Kt, false, kBiasGrad>
             : bias         ? &flash_bwd_sm90_ws_split_kernel<Kt, false, kBias>
             : dropout_only ? &flash_bwd_sm90_ws_split_kernel<Kt, false, kDropoutOnly>
             : mod          ? &flash_bwd_sm90_ws_split_kernel<Kt, false, kFa>
                            : &flash_bwd_sm90_ws_split_kernel<Kt, false, kNone>;
    else
      return varlen      ? (mod ? &flash_bwd_sm90_ws_kernel<Kt, true, kFa> : &flash_bwd_sm90_ws_kernel<Kt, true, kNone>)
             : bias_grad ? &flash_bwd_sm90_ws_kernel<Kt, false, kBiasGrad>
             : bias      ? &flash_bwd_sm90_ws_kernel<Kt, false, kBias>
             : dropout_only ? &flash_bwd_sm90_ws_kernel<Kt, false, kDropoutOnly>
             : mod          ? &flash_bwd_sm90_ws_kernel<Kt, false, kFa>
                            : &flash_bwd_sm90_ws_kernel<Kt, false, kNone>;
  }();
  if (cudaError_t err = allow_smem(kernel, Kt::kSmemBytes); err != cudaSuccess) return err;
  // The kernel adds whole tiles (padding rows and columns included) in its own
  // order (DqFragLayout): the preprocessing zeroes the accumulator in whole
  // 64-row blocks (no separate memset).
  if (cudaError_t err = launch_bwd_preprocess<T, true>(p, stream); err != cudaSuccess) return err;
  const int n_blocks = ceil_div(p.seqlen_k, Kt::kBlockN);
  const int64_t blocks = int64_t(n_blocks) * p.heads_kv * p.batch;
  AttnBwdParams pk = p;
  // Deterministic without a mask: rotated sweeps (dq_wait_for_turn), whose
  // waits form a cycle among a head's key blocks: only when they fit in half
  // the SMs (one CTA an SM), so that they are resident together, and when the
  // sweep has at least a step per key block. Varlen: never (plain order; the
  // sequences' sweeps differ in length, see the kernel's top comment).
  const int steps = ceil_div(p.seqlen_q, Kt::kBlockM) * p.heads_ratio();
  const bool unmasked = p.mask.window_left < 0 && p.mask.window_right < 0;
  pk.dq_sweep_stride = p.deterministic && p.dq_allow_rotation && !varlen && unmasked && n_blocks > 1 &&
                               2 * n_blocks <= sm_count() && steps >= n_blocks
                           ? steps / n_blocks
                           : 0;
  // (Varlen: max_seqlen_k may be 0, an empty grid, which is no launch; the
  // accumulator is zeroed and dQ still converted.)
  if (blocks > 0) kernel<<<static_cast<unsigned>(blocks), Kt::kNThreads, Kt::kSmemBytes, stream>>>(pk, maps);
  *launched = true;
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  const int64_t convert_blocks = int64_t(ceil_div(p.seqlen_q, Kt::kBlockM)) * Kt::kDqBlocks * p.heads_q * p.batch;
  if (convert_blocks == 0) return cudaSuccess;
  auto convert = varlen ? &convert_dq_frag_kernel<Kt, true> : &convert_dq_frag_kernel<Kt, false>;
  convert<<<static_cast<unsigned>(convert_blocks), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

#ifdef FLASHATTN_TUNING
// Tuning builds: FLASHATTN_FWD_VARIANT / FLASHATTN_BWD_VARIANT pick an entry of TuneVariants.
inline int tune_variant(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

// Calls launch(Kt{}) for the entry of `variants` that the environment variable names.
template <typename... Kts, typename Launch>
cudaError_t run_variant(Variants<Kts...>, const char* env, Launch&& launch) {
  const int want = tune_variant(env);
  int i = 0;
  cudaError_t err = cudaErrorInvalidValue;
  ((i++ == want ? (err = launch(Kts{}), 0) : 0), ...);
  return err;
}
#endif

// Dense batches with seqused_k (per-entry key lengths, the KV-cache prefill
// of kvcache_cuda.cpp) run on the warp-specialized TMA forward only: the
// other forward kernels do not read seqused_k (its code in SeqInfo would cost
// their varlen instances registers: ptxas, d128, the cp.async wgmma one went
// from 240 registers to 255 and 72 bytes of spills). When that kernel does not
// run (not sm90, TMA disabled or declined, a head dim without it), run_fwd
// launches nothing and returns cudaErrorNotSupported; the caller runs its own
// kernel (kvcache_cuda.cpp: the split-KV decoding kernel).
//
// Varlen batches (p.is_varlen()) run on the kernels that locate their rows
// through SeqInfo: the warp-specialized TMA forward and backward (tensor maps
// over the packed rows, launch_fwd_sm90_ws / launch_bwd_sm90_ws), the
// mma.sync forward and backward (deterministic dQ and the preprocessing /
// convert kernels included) and the cp.async wgmma forward and backward. A
// kernel added to the dispatch below runs varlen batches only once it reads
// SeqInfo; until then, test is_varlen().
template <typename T, int kHeadDim>
cudaError_t run_fwd(const AttnFwdParams& p, cudaStream_t stream) {
#ifdef FLASHATTN_SM90
  // Built for sm90a and running on an sm90 device: the wgmma kernel, for the
  // head dims KernelConfig gives one.
  if constexpr (HasFwdSm90Ws<KernelConfig<kHeadDim, T>>::value) {
    if (p.device_arch == 90 && p.allow_tma) {  // dense and varlen batches (launch_fwd_sm90_ws)
      bool launched = false;
#ifdef FLASHATTN_TUNING
      cudaError_t err = cudaSuccess;
      if constexpr (HasFwdSm90WsVariants<TuneVariants<kHeadDim, T>>::value) {
        err = run_variant(typename TuneVariants<kHeadDim, T>::FwdSm90Ws{}, "FLASHATTN_FWD_VARIANT",
                          [&](auto kt) { return launch_fwd_sm90_ws<decltype(kt)>(p, stream, &launched); });
      } else {
        err = launch_fwd_sm90_ws<typename KernelConfig<kHeadDim, T>::FwdSm90Ws>(p, stream, &launched);
      }
#else
      using Cfg = KernelConfig<kHeadDim, T>;
      cudaError_t err = cudaSuccess;
      if constexpr (HasFwdSm90WsTwoConsumers<Cfg>::value) {
        // Head dim 64: the two-consumer kernel for short causal / windowed
        // calls and for every call with a score mod or dropout (its instances
        // live there: in the three-consumer kernel's 160 registers a thread
        // they spilled, kernel_configs.h); the three-consumer one for the rest.
        if (runs_score_mod_instance(p) ||
            (p.mask.window_right >= 0 && p.seqlen_q <= Cfg::kTwoConsumersMaxSeqlen)) {  // (varlen: max_seqlen_q)
          err = launch_fwd_sm90_ws<typename Cfg::FwdSm90WsTwoConsumers>(p, stream, &launched);
          if (launched || err != cudaSuccess) return err;
        }
        err = launch_fwd_sm90_ws<typename Cfg::FwdSm90Ws, false>(p, stream, &launched);
      } else {
        err = launch_fwd_sm90_ws<typename Cfg::FwdSm90Ws>(p, stream, &launched);
      }
#endif
      if (launched || err != cudaSuccess) return err;
    }
  }
#endif
  if (p.seqused_k != nullptr) return cudaErrorNotSupported;  // the TMA kernel did not run it (above)
#ifdef FLASHATTN_SM90
  // (The cp.async wgmma kernels have no score-mod instance and read no paged
  // cache: such calls run the mma.sync kernels.)
  if constexpr (HasFwdSm90<KernelConfig<kHeadDim, T>>::value) {
    if (p.device_arch == 90 && !p.score_mod.any() && !sm90_declines_dropout(p) && !p.kv.paged()) {
#ifdef FLASHATTN_TUNING
      return run_variant(typename TuneVariants<kHeadDim, T>::FwdSm90{}, "FLASHATTN_FWD_VARIANT",
                         [&](auto kt) { return launch_fwd_sm90<decltype(kt)>(p, stream); });
#else
      return launch_fwd_sm90<typename KernelConfig<kHeadDim, T>::FwdSm90>(p, stream);
#endif
    }
  }
#endif
#ifdef FLASHATTN_TUNING
  return run_variant(typename TuneVariants<kHeadDim, T>::Fwd{}, "FLASHATTN_FWD_VARIANT",
                     [&](auto kt) { return launch_fwd<decltype(kt)>(p, stream); });
#else
  return launch_fwd<typename KernelConfig<kHeadDim, T>::Fwd>(p, stream);
#endif
}

// The one rule for when run_bwd tries the warp-specialized TMA backward:
// built for sm90a, an sm90 device, TMA allowed, and a head dim KernelConfig
// gives a BwdSm90Ws (dense and varlen batches). The binding layer allocates
// that kernel's deterministic workspace by it (dispatch.h). The kernel can still decline (launch_bwd_sm90_ws: a tensor
// TMA cannot describe); the ones below run then.
template <typename T, int kHeadDim>
bool bwd_tries_sm90_ws(const AttnBwdParams& p) {
#ifdef FLASHATTN_SM90
  if constexpr (HasBwdSm90Ws<KernelConfig<kHeadDim, T>>::value) {
    return p.device_arch == 90 && p.allow_tma;
  }
#endif
  return false;
}

template <typename T, int kHeadDim>
cudaError_t run_bwd(const AttnBwdParams& p, cudaStream_t stream) {
  using Cfg = KernelConfig<kHeadDim, T>;
#ifdef FLASHATTN_SM90
  // Built for sm90a and running on an sm90 device: the warp-specialized TMA
  // kernel (also deterministic: dQ added in a fixed order), else the cp.async
  // wgmma kernel (non-deterministic dQ atomics only), for the head dims
  // KernelConfig gives them.
  if constexpr (HasBwdSm90Ws<Cfg>::value) {
    if (bwd_tries_sm90_ws<T, kHeadDim>(p) && (!p.deterministic || p.dq_semaphore_ptr != nullptr)) {
      bool launched = false;
      cudaError_t err;
#ifdef FLASHATTN_TUNING
      // FLASHATTN_BWD_DQ_FIRST=0: the step's last products in the order before FlashAttention-3's
      // (BwdSm90WsTraits::kDqFirst false; no score mods).
      if constexpr (HasBwdSm90WsDqLast<TuneVariants<kHeadDim, T>>::value) {
        const char* dq_first = std::getenv("FLASHATTN_BWD_DQ_FIRST");
        if (dq_first != nullptr && dq_first[0] == '0' && !runs_score_mod_instance(p)) {
          err = launch_bwd_sm90_ws<typename TuneVariants<kHeadDim, T>::BwdSm90WsDqLast, false>(p, stream, &launched);
          if (launched || err != cudaSuccess) return err;
        }
      }
#endif
      if constexpr (HasBwdSm90WsShortSteps<Cfg>::value) {
        // (The short steps have no score-mod instances: calls with a score mod or dropout take the long ones.)
        err = p.bwd_long_steps || runs_score_mod_instance(p)
                  ? launch_bwd_sm90_ws<typename Cfg::BwdSm90Ws>(p, stream, &launched)
                  : launch_bwd_sm90_ws<typename Cfg::BwdSm90WsShortSteps, false>(p, stream, &launched);
      } else {
        err = launch_bwd_sm90_ws<typename Cfg::BwdSm90Ws>(p, stream, &launched);
      }
      if (launched || err != cudaSuccess) return err;
    }
  }
  if constexpr (HasBwdSm90<Cfg>::value) {
    if (p.device_arch == 90 && !p.deterministic && !p.score_mod.any() && !sm90_declines_dropout(p)) {
#ifdef FLASHATTN_TUNING
      return run_variant(typename TuneVariants<kHeadDim, T>::BwdSm90{}, "FLASHATTN_BWD_VARIANT",
                         [&](auto kt) { return launch_bwd_sm90<decltype(kt)>(p, stream); });
#else
      return launch_bwd_sm90<typename Cfg::BwdSm90>(p, stream);
#endif
    }
  }
#endif
#ifdef FLASHATTN_TUNING
  return run_variant(typename TuneVariants<kHeadDim, T>::Bwd{}, "FLASHATTN_BWD_VARIANT",
                     [&](auto kt) { return launch_bwd<decltype(kt), typename Cfg::BwdDq>(p, stream); });
#else
  return launch_bwd<typename Cfg::Bwd, typename Cfg::BwdDq>(p, stream);
#endif
}

}  // namespace flashattn
