// The attn_mask's tiles through shared memory, for the attn_mask instance of
// the warp-specialized Hopper forward (flash_fwd_sm90_ws_kernel.cuh).
//
// A float mask that the summary cannot skip (a bias: every tile mixed) was
// read element by element from global memory in the score step
// (../score_mod.cuh, apply_bias_tile): 64 dependent 2-byte loads a thread a
// key block at d128, issued after the S GEMM's wait, so each step paid an L2
// (or HBM) round trip in the consumer's critical path, and the loads of a
// warp touched 8 rows x 8 bytes per instruction (session 13: the bias
// forward at 0.27 of the unmasked one). Here each consumer warpgroup copies
// its 64 rows x kBlockN keys of the next visible key block into its own tile
// of shared memory with cp.async (16-byte chunks, coalesced, no registers)
// as soon as it has read the current one, so the copy runs under the rest of
// the step, the next GEMMs and the other consumer's turn; the score step
// then reads its pairs from shared memory.
//
// Which masks: 16-bit float (bf16 / fp16, the usual bias dtype: q's), keys
// contiguous (col_stride 1), rows and planes 16-byte aligned (row stride,
// batch / head strides multiples of 8 elements, 0 included: a mask that
// broadcasts over queries repeats its row); a plane need not have a multiple
// of 8 keys (the last chunk reads what the row has and zero-fills the rest).
// float32 would need twice the tile, which d128 has no room for; bool masks
// are mostly skipped or left alone whole by the summary. Those keep the
// element loads of the attn_mask instance; the masks AttnBias::tiles_copyable
// admits run an instance of their own (ScoreModSet::kAttnBiasStaged, where the
// traits have room: Kt::kBiasStageFits, every forward shape today).
//
// Protocol (per consumer, its own named barrier, the epilogue's): a tile's
// first visible block is requested before the consumer waits for Q; at each
// step, every thread waits for its copies and the warpgroup syncs (the tile
// is complete), reads, syncs again (everyone has read it), then requests the
// next visible block into the same tile. One tile a consumer: d128 has room
// for one (32 KB beside 192 KB of Q, O and the K/V rings).
//
// Layout: row r of a consumer's tile is kBlockN * 2 bytes; its 16-byte chunk
// c sits at chunk c ^ (r & 7), so that the 8 rows x 4 pairs a warp reads in
// one instruction (the accumulator layout: row g, keys 2t, 2t + 1) fall into
// 32 distinct banks.
#pragma once

#include "../../flash_params.h"
#include "../ptx.cuh"
#include "../score_mod.cuh"
#include "tma.cuh"

namespace flashattn {

template <typename Kt>
struct FwdBiasStage {
  static constexpr int kBlockN = Kt::kBlockN;
  static constexpr int kChunks = kBlockN / 8;  // 16-byte chunks of a row
  static constexpr int kRowBytes = kBlockN * 2;
  static constexpr int kBytes = 64 * kRowBytes;       // one consumer's tile
  static constexpr int kCopies = 64 * kChunks / 128;  // chunks a thread copies
  static_assert(kChunks >= 8, "the swizzle spreads 8 rows over 8 chunks");

  uint32_t tile;  // (shared address) this consumer's tile
  int bar;        // this consumer's named barrier (128 threads)
  int wtid;       // the thread's index in its warpgroup

  // Requests the mask of rows row0 .. row0 + 63 (clamped to last_row: the
  // rows past the sequence are never stored) and keys n0 .. n0 + kBlockN - 1
  // (zeros past seqlen_k: those keys are masked) of the plane at `plane`.
  __device__ __forceinline__ void request(const char* plane, int64_t row_stride, int row0, int last_row, int n0,
                                          int seqlen_k) const {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int k = wtid + 128 * i, r = k / kChunks, c = k % kChunks;
      const int col = n0 + 8 * c;
      const int bytes = min(max(seqlen_k - col, 0), 8) * 2;
      const char* src = plane + (int64_t(min(row0 + r, last_row)) * row_stride + (bytes > 0 ? col : 0)) * 2;
      cp_async_16_zfill(tile + r * kRowBytes + ((c ^ (r & 7)) << 4), src, bytes);
    }
    cp_async_commit();
  }
  // The requested tile is complete (every thread's copies).
  __device__ __forceinline__ void wait() const {
    cp_async_wait<0>();
    named_barrier_sync(bar, 128);
  }
  // Every thread has read the tile: it may be requested again.
  __device__ __forceinline__ void release() const { named_barrier_sync(bar, 128); }

  // x = in_scale * s + mask (log2 units) for a warp's 16 rows of S (rows
  // wrow .. wrow + 15 of the consumer's tile, queries row0 .. + 15, keys
  // col0 ..), as apply_bias_tile does it from global memory.
  template <int kNT>
  __device__ __forceinline__ void apply(float (&s)[1][kNT][4], const ScoreModTile& m, int wrow, int row0, int col0,
                                        int lane) const {
    if (score_mod_detail::scaled_or_hidden_whole<false>(s, m, row0, col0)) return;
    const int g = lane >> 2, t = lane & 3;
    const bool bf16 = m.bias_kind == BiasKind::kBFloat16;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wrow + g + 8 * h;  // r & 7 == g
      const uint32_t row = tile + r * kRowBytes + 4 * t;
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni) {
        const uint32_t u = static_cast<uint32_t>(ld_shared(row + ((ni ^ g) << 4)));
        float& x0 = s[0][ni][2 * h];
        float& x1 = s[0][ni][2 * h + 1];
        x0 = fmaf(x0, m.in_scale, bias_to_log2(bias16_to_float(static_cast<unsigned short>(u & 0xffff), bf16)));
        x1 = fmaf(x1, m.in_scale, bias_to_log2(bias16_to_float(static_cast<unsigned short>(u >> 16), bf16)));
      }
    }
  }
};

}  // namespace flashattn
