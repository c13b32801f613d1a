// Torch-free description of one attention call.
//
// The binding layer (csrc/attention_api.cpp) is the only code that knows about
// at::Tensor: it validates the inputs, fills these structs and hands them to a
// backend (csrc/cpu/, csrc/cuda/). Kernels see raw pointers, int64 strides in
// elements and precomputed scalars, so they can be compiled by nvcc without
// torch headers and reused by any future front end.
//
// Tensor layouts, as the kernels see them (strides may be anything with a unit
// stride on the head dimension):
//   q, o, dq, do : (batch, seqlen_q, heads_q,  head_dim)
//   k, v, dk, dv : (batch, seqlen_k, heads_kv, head_dim)
//   lse, dsum    : (batch, heads_q, seqlen_q)  float32 (float64 for float64 inputs), contiguous
// Variable-length batches (is_varlen(), flash_attn_varlen_func) pack the
// sequences along the rows instead, FA2's layout:
//   q, o, dq, do : (total_q, heads_q,  head_dim)   sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1])
//   k, v, dk, dv : (total_k, heads_kv, head_dim)   likewise with cu_seqlens_k
//   lse, dsum    : (heads_q, total_q)
// Kernels find a sequence's rows, lengths and diagonal through SeqInfo below.
#pragma once

#include <cstdint>

#include "philox.h"

#if defined(__CUDACC__)
#define FLASHATTN_HOST_DEVICE __host__ __device__
#else
#define FLASHATTN_HOST_DEVICE
#endif

namespace flashattn {

enum class ScalarKind : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

// Which keys a query may see. Key j is visible from query i iff
//   j <  seqlen_k
//   j <= i + diag_offset + window_right   (when window_right >= 0)
//   j >= i + diag_offset - window_left    (when window_left  >= 0)
// Causal attention is window_right = 0. diag_offset = 0 aligns the diagonal
// top-left (torch's SDPA convention); diag_offset = seqlen_k - seqlen_q aligns
// it bottom-right (FlashAttention's convention). A query row that sees no key
// gets a zero output, log-sum-exp -inf and zero gradients.
struct MaskParams {
  int window_left = -1;   // -1: unbounded
  int window_right = -1;  // -1: unbounded; 0: causal
  int diag_offset = 0;
  // Varlen batches have one diagonal per sequence: seqlen_k_b - seqlen_q_b
  // when bottom_right, else 0 (SeqInfo computes it; diag_offset is unused).
  bool bottom_right = false;
};

// What is done to the scaled scores before the softmax, flash-attn's two
// score modifications (both optional; with neither the kernels run their
// plain instances, which hold no code for them):
//   softcap > 0 : s -> softcap * tanh(s / softcap)   (s = softmax_scale * q.k)
//   alibi_slopes: s -> s - slope(b, h) * |i + seqlen_k - seqlen_q - j|, query
//                 i and key j of the sequence (its own lengths in a varlen
//                 batch; the KV cache's row length in fwd_kvcache), whatever
//                 the mask's alignment, as flash-attn defines it.
// softcap applies first, then the ALiBi bias. The log-sum-exp the forward
// returns is that of the modified scores; the gradients are those of the
// modified attention (the slopes get none, as in flash-attn).
//
// A third modification is torch SDPA's attn_mask (AttnBias, dense batches
// only; never together with softcap or ALiBi, which come from flash-attn's
// API, where there is no attn_mask):
//   bool mask : s -> s where attn_mask[b, h, i, j], else -inf (True = attend)
//   float mask: s -> s + attn_mask[b, h, i, j]   (on the scaled scores)
// read in its own dtype through its strides over (batch, heads_q, seqlen_q,
// seqlen_k), 0 on a broadcast dimension (no copy, no expanded tensor). A row
// a mask hides entirely gets zeros and lse -inf, as a window does (torch's
// SDPA gives zeros too). The mask gets no gradient.
enum class BiasKind : int8_t { kNone = 0, kBool, kFloat16, kBFloat16, kFloat32, kFloat64 };

FLASHATTN_HOST_DEVICE constexpr int bias_element_bytes(BiasKind k) {
  return k == BiasKind::kBool ? 1 : (k == BiasKind::kFloat32 ? 4 : (k == BiasKind::kFloat64 ? 8 : 2));
}

// The CUDA kernels also get a summary of the mask (csrc/cuda/mask_summary.cu,
// computed on the device per call): one byte per block of 64 queries x 16 keys
// of every (batch, head) plane the mask has (broadcast dimensions have one
// entry), kMaskMixed, kMaskIdentity (all True, or all 0.0) or kMaskHidden (all
// False, or all -inf), so that a warp whose tile the mask leaves alone or hides
// entirely reads no element of it.
enum : uint8_t { kMaskMixed = 0, kMaskIdentity = 1, kMaskHidden = 2 };
constexpr int kMaskSummaryRows = 64, kMaskSummaryCols = 16;

struct AttnBias {
  const void* ptr = nullptr;  // nullptr: no attn_mask
  BiasKind kind = BiasKind::kNone;
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;  // elements; 0: broadcast
  FLASHATTN_HOST_DEVICE int64_t offset(int b, int h) const { return b * batch_stride + h * head_stride; }
  // The mask's (b, h) plane.
  FLASHATTN_HOST_DEVICE const char* plane(int b, int h) const {
    return static_cast<const char*>(ptr) + offset(b, h) * bias_element_bytes(kind);
  }
  // Whether the Hopper forward copies the mask's tiles into shared memory
  // (cuda/hopper/fwd_sm90_bias_stage.cuh): a 16-bit float mask, keys
  // contiguous, rows and planes 16-byte aligned (strides multiples of 8
  // elements, 0 included).
  FLASHATTN_HOST_DEVICE bool tiles_copyable() const {
    const bool sixteen_bit = kind == BiasKind::kBFloat16 || kind == BiasKind::kFloat16;
    return sixteen_bit && col_stride == 1 && row_stride % 8 == 0 && batch_stride % 8 == 0 && head_stride % 8 == 0 &&
           reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  }
  // The summary (nullptr: none, e.g. on the CPU): entry (b, h, band, c) at
  // b * summary_batch_stride + h * summary_head_stride + band * summary_band_stride + c * summary_col_step.
  const uint8_t* summary = nullptr;
  int64_t summary_batch_stride = 0, summary_head_stride = 0;
  int summary_band_stride = 0, summary_col_step = 0;  // 0: the mask broadcasts over queries / keys

  // The gradient of a float mask that requires grad (nullptr: not asked for,
  // nothing computed): dS, the gradient of the scaled scores, summed over the
  // dimensions the mask broadcasts. In the accumulation type (float32, float64
  // for float64 q); element (b, h, i, j) of (batch, heads_q, seqlen_q, seqlen_k)
  // adds to b * grad_batch_stride + ... + j * grad_col_stride, a stride 0
  // where the gradient sums over that dimension. The CPU kernels store each
  // element once (a deterministic sum); the CUDA kernels add into a zeroed
  // buffer with atomics.
  void* grad = nullptr;
  int64_t grad_batch_stride = 0, grad_head_stride = 0, grad_row_stride = 0, grad_col_stride = 0;
  FLASHATTN_HOST_DEVICE int64_t grad_offset(int b, int h) const { return b * grad_batch_stride + h * grad_head_stride; }
};

struct ScoreMod {
  double softcap = 0.0;                 // 0: none (double: the float64 CPU path uses it exactly)
  const float* alibi_slopes = nullptr;  // float32 (heads_q,) or (batch, heads_q); nullptr: none
  int64_t alibi_batch_stride = 0;       // 0 for (heads_q,) slopes
  FLASHATTN_HOST_DEVICE bool has_softcap() const { return softcap > 0.0; }
  FLASHATTN_HOST_DEVICE bool has_alibi() const { return alibi_slopes != nullptr; }
  AttnBias bias;  // torch SDPA's attn_mask
  FLASHATTN_HOST_DEVICE bool has_bias() const { return bias.ptr != nullptr; }
  FLASHATTN_HOST_DEVICE bool any() const { return has_softcap() || has_alibi() || has_bias(); }
  FLASHATTN_HOST_DEVICE float slope(int b, int h) const { return alibi_slopes[b * alibi_batch_stride + h]; }
};

// Where q, k, v, the output and lse are: base pointers and the strides of
// (batch, seqlen, heads, head_dim) tensors (the head_dim stride is 1). The
// first part of AttnFwdParams and of KvcacheParams (kvcache_params.h).
struct QkvoParams {
  using index_t = int64_t;

  // Inputs.
  const void* q_ptr = nullptr;
  const void* k_ptr = nullptr;
  const void* v_ptr = nullptr;
  index_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  index_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  index_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;

  // Outputs.
  void* o_ptr = nullptr;
  index_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  void* lse_ptr = nullptr;  // contiguous (batch, heads_q, seqlen_q), accumulation type
};

// Where a sequence's keys are when they are not the rows of k's batch entry
// (or packed rows) the layout at the top describes: the KV caches of
// flash-attn's serving calls, forward only, with per_sequence() (each
// sequence's key count from cu_seqlens_k or seqused_k). SeqInfo applies it
// (k_batch, k_start, key_offset) for every kernel that reads it: the
// warp-specialized TMA forward, the mma.sync forward and their non-finite
// slow paths; run_fwd keeps such calls off the other kernels.
//   paged (block_table != nullptr; flash-attn's paged KV): k, v are
//     (num_blocks, page_size, heads_kv, head_dim), their batch strides the
//     stride between blocks; key position pos of sequence b is row
//     pos % page_size of block block_table[b * table_batch_stride + pos / page_size];
//   contiguous (seqused_k only: the KV-cache prefill): batch entry b reads
//     cache row batch_idx[b] (nullptr: b) from key position leftpad[b]
//     (nullptr: 0) on; never together with block_table.
// Indices out of range (the CUDA path cannot check them without a host
// synchronisation) are clamped into the cache: wrong keys, never an access
// outside the tensors.
struct KvCacheView {
  const int32_t* block_table = nullptr;  // (batch, max_blocks) int32; nullptr: not paged
  int64_t table_batch_stride = 0;
  int max_blocks = 0;                  // block_table's columns: a sequence holds at most max_blocks * page_size keys
  int page_size = 0;                   // a multiple of 16
  int cache_rows = 0;                  // k's dimension 0: num_blocks (paged) or batch_cache; 0: no cache view
  const int32_t* batch_idx = nullptr;  // (batch,) int32 or nullptr
  const int32_t* leftpad = nullptr;    // (batch,) int32 or nullptr
  FLASHATTN_HOST_DEVICE bool paged() const { return block_table != nullptr; }
  FLASHATTN_HOST_DEVICE int capacity() const { return max_blocks * page_size; }
  // Element offset of key position pos of a sequence whose page-table row is
  // `table_row` (paged; pos < capacity()).
  FLASHATTN_HOST_DEVICE int64_t page_offset(const int32_t* table_row, int pos, int64_t block_stride,
                                            int64_t row_stride) const {
    int slot = pos / page_size;
    slot = slot < max_blocks ? slot : max_blocks - 1;
    int block = table_row[slot];
    block = block < 0 ? 0 : (block < cache_rows ? block : cache_rows - 1);
    const int row = pos - slot * page_size;
    return int64_t(block) * block_stride + int64_t(row < page_size ? row : page_size - 1) * row_stride;
  }
};

struct AttnFwdParams : QkvoParams {
  // Sizes.
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;  // divides heads_q; head h of q reads kv head h / (heads_q / heads_kv)
  int seqlen_q = 0;
  int seqlen_k = 0;
  int head_dim = 0;

  ScalarKind dtype = ScalarKind::kFloat32;

  // Scores are softmax_scale * q.k (kept in double for the float64 CPU path);
  // scale_log2 = softmax_scale * log2(e) lets the CUDA kernels use exp2 with
  // the scale folded in.
  double softmax_scale = 1.0;
  float softmax_scale_log2 = 1.f;

  MaskParams mask;
  ScoreMod score_mod;
  // Dropout on the probabilities (philox.h: the keep mask, its layout and the
  // seed / offset); p = 0: none. The log-sum-exp stays that of the softmax
  // without dropout; the output and the gradients are those of the dropped,
  // 1 / (1 - p)-scaled probabilities. CUDA: the score-mod instances of the
  // Hopper TMA and mma.sync kernels (cuda/flash_launch.cuh), which read seed /
  // offset on the device (rng_state).
  DropoutParams dropout;

  // Compute capability x 10 of the device the CUDA kernels run on (90 for
  // H100/H200): picks architecture-specific kernels. 0 on the CPU.
  int device_arch = 0;
  // Hopper: the warp-specialized TMA kernels may run (FLASHATTN_DISABLE_TMA=1
  // clears it, to time the cp.async Hopper kernels beside them).
  bool allow_tma = true;
  // Variable-length batches (FA2's varlen layout, see the top of this file):
  // int32 arrays of batch + 1 cumulative lengths, on the device of the
  // tensors (host memory for the CPU kernels), read by the kernels
  // themselves; nullptr for a dense batch. seqlen_q / seqlen_k then hold
  // max_seqlen_q / max_seqlen_k, the bounds the grids are sized by (CTAs past
  // the end of their sequence exit), and every batch stride is 0.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int total_q = 0, total_k = 0;  // rows of the packed tensors

  // A dense batch whose batch entries hold different numbers of keys
  // (flash_attn_with_kvcache's prefill route, csrc/cuda/kvcache_cuda.cpp):
  // int32 (batch,) on the device, entry b sees its keys [0, seqused_k[b])
  // (clamped to [0, seqlen_k]; seqlen_k is then the capacity of an entry, the
  // rows its tensors hold), with the diagonal per entry when
  // mask.bottom_right. The tensors keep the dense layout (batch strides, lse
  // (batch, heads_q, seqlen_q)); only with cu_seqlens_q == nullptr, forward
  // only. nullptr otherwise.
  const int* seqused_k = nullptr;
  // The KV caches of flash-attn's serving calls (KvCacheView above): paged k / v
  // (with cu_seqlens or seqused_k), cache_batch_idx and cache_leftpad (with seqused_k).
  KvCacheView kv;
  // Hopper's persistent forward (cuda/hopper/tile_scheduler.cuh): a zeroed
  // int32 on the device with which its CTAs take tiles in the dynamic order,
  // for calls whose tiles differ in weight (tiles_differ()); the binding's
  // (cuda/binding_util.h), nullptr: the static order.
  int* tile_counter = nullptr;

  FLASHATTN_HOST_DEVICE int heads_ratio() const { return heads_q / heads_kv; }
  // Whether the query tiles of a call see different numbers of key blocks: a
  // mask (causal, a window), sequences of their own lengths, or an attn_mask
  // (whose hidden blocks are skipped).
  FLASHATTN_HOST_DEVICE bool tiles_differ() const {
    return mask.window_left >= 0 || mask.window_right >= 0 || per_sequence() || score_mod.has_bias();
  }
  // The one test the dispatch asks before it picks a kernel: a kernel that
  // does not go through SeqInfo (every kernel does now; a new one might not)
  // must not run a varlen batch. It also says which layout the tensors have
  // (packed rows, see the top).
  FLASHATTN_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }
  // Sequences of their own lengths (varlen, or dense with seqused_k): the
  // warp-specialized TMA forward runs its kVarlen instance then. The other
  // kernels do not read seqused_k (run_fwd hands such a batch to the TMA
  // kernel or to nothing).
  FLASHATTN_HOST_DEVICE bool per_sequence() const { return cu_seqlens_q != nullptr || seqused_k != nullptr; }
};

struct AttnBwdParams : AttnFwdParams {
  // Inputs of the backward pass (q, k, v, o, lse come from AttnFwdParams).
  const void* do_ptr = nullptr;
  index_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;

  // Gradients.
  void* dq_ptr = nullptr;
  void* dk_ptr = nullptr;
  void* dv_ptr = nullptr;
  index_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  index_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  index_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;

  // Workspace owned by the binding layer (CUDA only; nullptr on the CPU):
  //   dsum     : rowsum(dO * O), (batch, heads_q, seqlen_q) float32; varlen (heads_q, total_q)
  //   dq_accum : float32 accumulator for dq, (batch, heads_q, seqlen_q_rounded, head_dim_rounded);
  //              varlen (heads_q, total_q + batch * kBwdBlockM, head_dim_rounded), sequence b
  //              from row cu_seqlens_q[b] + b * kBwdBlockM, so that the atomics of its last,
  //              partial query block land on padding rows of its own, not on the next sequence
  void* dsum_ptr = nullptr;
  void* dq_accum_ptr = nullptr;
  index_t dq_accum_batch_stride = 0, dq_accum_row_stride = 0, dq_accum_head_stride = 0;

  // Gradients bitwise reproducible from run to run (no float atomics).
  bool deterministic = false;
  // The deterministic Hopper backward: one int32 counter per (batch, head,
  // 64-query block), zeroed, counting the key blocks whose dQ is added
  // (the adds go in a fixed order). nullptr otherwise.
  int* dq_semaphore_ptr = nullptr;
  // The deterministic Hopper backward without a mask: key block n of a head
  // starts its sweep dq_sweep_stride * n steps into the common order (the
  // launcher sets it; 0: every key block starts at step 0), and the dQ add
  // order of a query block follows the order the key blocks reach it
  // (dq_wait_for_turn in hopper/flash_bwd_sm90_ws_kernel.cuh).
  // FLASHATTN_DQ_PLAIN_ORDER=1 clears dq_allow_rotation, for timing.
  bool dq_allow_rotation = true;
  // Head dim 64 on Hopper: 128-query steps of the warp-specialized backward
  // (KernelConfig<64>::BwdSm90Ws); FLASHATTN_BWD_D64_SHORT_STEPS=1 clears it,
  // to time the 64-query steps it replaced (BwdSm90WsShortSteps) beside them.
  bool bwd_long_steps = true;
  int dq_sweep_stride = 0;
};

// One sequence b of a batch as the kernels see it (FA2's BlockInfo): where
// its rows start, its lengths and its diagonal. Dense batches: every sequence
// is seqlen_q x seqlen_k and starts at row 0 of batch entry b. Varlen: read
// from cu_seqlens, then clamped to the packed tensors and to the max_seqlen
// bounds, so that any values (the CUDA path cannot check them without a host
// synchronisation) keep every access inside the tensors. Dense with
// seqused_k (read only by the kernels that ask for it, `seqused` below):
// batch entry b, seqlen_q queries, seqused_k[b] keys (clamped to
// [0, seqlen_k] for the same reason), the tensors' dense layout.
struct SeqInfo {
  int q_start = 0, k_start = 0;  // first row of the sequence in the packed tensors (int: fewer registers)
  int k_batch = 0;               // the batch coordinate of its keys: b, 0 when packed, the cache row (KvCacheView)
  int seqlen_q = 0, seqlen_k = 0;
  int diag_offset = 0;
  bool varlen = false;  // lengths of its own (varlen, or seqused_k where the kernel reads it)
  bool packed = false;  // rows located by cu_seqlens (the packed layout); else batch entry b

  FLASHATTN_HOST_DEVICE SeqInfo(const AttnFwdParams& p, int b) : SeqInfo(p, b, p.is_varlen()) {}

  // `varlen` must equal p.is_varlen(), or p.per_sequence() when `seqused`
  // (a kernel that reads seqused_k: the warp-specialized TMA forward). The
  // hot CUDA kernels compile their body once for each value and pass both as
  // constants: the dense body then holds the params' constants here and no
  // varlen state in registers, and a kernel that does not read seqused_k has
  // packed == varlen, a constant (no code for the seqused_k layout).
  FLASHATTN_HOST_DEVICE SeqInfo(const AttnFwdParams& p, int b, bool varlen_, bool seqused = false)
      : varlen(varlen_), packed(varlen_ && (!seqused || p.is_varlen())) {
    k_batch = b;
    if (!varlen) {
      seqlen_q = p.seqlen_q;
      seqlen_k = p.seqlen_k;
      diag_offset = p.mask.diag_offset;
      return;
    }
    if (packed) {
      rows_of(p.cu_seqlens_q, b, p.total_q, p.seqlen_q, q_start, seqlen_q);
      rows_of(p.cu_seqlens_k, b, p.total_k, p.seqlen_k, k_start, seqlen_k);
      k_batch = 0;
      if (p.kv.paged()) {  // cu_seqlens_k gives the length only: positions from 0 in the page table
        k_start = 0;
        seqlen_k = seqlen_k < p.kv.capacity() ? seqlen_k : p.kv.capacity();
      }
    } else {  // dense with seqused_k: batch entry b's keys [leftpad, seqused_k) of its cache row
      const int used = p.seqused_k[b];
      seqlen_q = p.seqlen_q;
      seqlen_k = used < 0 ? 0 : (used > p.seqlen_k ? p.seqlen_k : used);
      if (p.kv.leftpad != nullptr) {
        const int lp = p.kv.leftpad[b];
        k_start = lp < 0 ? 0 : (lp > seqlen_k ? seqlen_k : lp);
        seqlen_k -= k_start;
      }
      if (p.kv.batch_idx != nullptr) {
        const int row = p.kv.batch_idx[b];
        k_batch = row < 0 ? 0 : (row < p.kv.cache_rows ? row : p.kv.cache_rows - 1);
      }
    }
    diag_offset = p.mask.bottom_right ? seqlen_k - seqlen_q : 0;
  }

  // Element offset of row 0 of sequence b in a q-like (k-like) tensor: the
  // batch stride is 0 in a packed batch and the start row 0 in a dense one
  // (a KV-cache row: its cache row and first visible key; not paged).
  FLASHATTN_HOST_DEVICE int64_t q_offset(int64_t batch_stride, int64_t row_stride, int b) const {
    return packed ? int64_t(q_start) * row_stride : b * batch_stride;
  }
  FLASHATTN_HOST_DEVICE int64_t k_offset(int64_t batch_stride, int64_t row_stride, int /*b*/) const {
    return int64_t(k_batch) * batch_stride + int64_t(k_start) * row_stride;
  }
  // Element offset of key j of the sequence (of kv head 0) in a k-like
  // tensor, through the page table when k is paged (p.kv.paged(), only in a
  // varlen instance); else k_offset plus j rows.
  FLASHATTN_HOST_DEVICE int64_t key_offset(const AttnFwdParams& p, int b, int64_t batch_stride, int64_t row_stride,
                                           int j) const {
    if (varlen && p.kv.paged())
      return p.kv.page_offset(p.kv.block_table + b * p.kv.table_batch_stride, k_start + j, batch_stride, row_stride);
    return k_offset(batch_stride, row_stride, b) + int64_t(j) * row_stride;
  }
  // Index of (b, h, row 0) in lse or dsum: (batch, heads_q, seqlen_q), or (heads_q, total_q) when packed.
  FLASHATTN_HOST_DEVICE int64_t rowvec_offset(const AttnFwdParams& p, int b, int h) const {
    return packed ? int64_t(h) * p.total_q + q_start : (int64_t(b) * p.heads_q + h) * p.seqlen_q;
  }
  // The distance between two heads' rows in lse or dsum.
  FLASHATTN_HOST_DEVICE int64_t rowvec_head_stride(const AttnFwdParams& p) const {
    return packed ? p.total_q : p.seqlen_q;
  }

 private:
  FLASHATTN_HOST_DEVICE static void rows_of(const int* cu, int b, int total, int max_len, int& start, int& len) {
    int begin = cu[b], end = cu[b + 1];
    begin = begin < 0 ? 0 : (begin > total ? total : begin);
    end = end < begin ? begin : (end > total ? total : end);
    start = begin;
    len = end - begin < max_len ? end - begin : max_len;
  }
};

}  // namespace flashattn
