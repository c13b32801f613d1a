// The pieces the two Hopper backward kernels (flash_bwd_sm90_kernel.cuh,
// cp.async; flash_bwd_sm90_ws_kernel.cuh, warp-specialized) share: a
// warpgroup's S^T and dP^T products over its 64 keys and the elementwise
// steps between them, on accumulators in the transposed layout (rows: keys,
// columns: the kBlockM queries of the step; thread column q = 8 qi + 2 t + e).
#pragma once

#include "../dropout_keep_bits.cuh"
#include "../tile.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flashattn {

// acc = A B^T over the head dim with both operands K-major in 64-column
// panels (TileA's rows are M, TileB's N): S^T = K Q^T and dP^T = V dO^T. The
// caller fences before and commits after.
template <typename TileA, typename TileB, typename T, int kNT>
__device__ __forceinline__ void issue_kmajor_product(float (&acc)[kNT][4], uint64_t desc_a, uint64_t desc_b) {
  static_assert(TileA::kCols == TileB::kCols, "one contraction length");
#pragma unroll
  for (int ks = 0; ks < TileA::kCols / 16; ++ks)
    Wgmma<kNT * 8, T>::template ss<0, 0>(acc, desc_add(desc_a, kmajor_step(ks, TileA::kRows * 128)),
                                         desc_add(desc_b, kmajor_step(ks, TileB::kRows * 128)), ks > 0);
}

// S^T = K_w Q^T and dP^T = V_w dO^T, both operands K-major, issued back to back
// as two commit groups (the exponentials of S^T then overlap dP^T).
template <typename Kt, typename T = typename Kt::Element>
__device__ __forceinline__ void issue_scores_and_dp_t(float (&acc_s)[Kt::kBlockM / 8][4],
                                                      float (&acc_dp)[Kt::kBlockM / 8][4], uint64_t desc_k,
                                                      uint64_t desc_v, uint64_t desc_q, uint64_t desc_do) {
  using TileKV = typename Kt::TileKV;
  using TileQ = typename Kt::TileQ;
  wgmma_fence();
  issue_kmajor_product<TileKV, TileQ, T>(acc_s, desc_k, desc_q);
  wgmma_commit();
  issue_kmajor_product<TileKV, TileQ, T>(acc_dp, desc_v, desc_do);
  wgmma_commit();
}

// P^T = exp2(S^T * scale_log2 - lse_log2(q)) in place; lse_log2(q) is the
// log-sum-exp of query column q in log2 units (+inf: P = 0).
template <int kQT, typename LseLog2>
__device__ __forceinline__ void probs_t(float (&acc_s)[kQT][4], float scale_log2, int t, LseLog2&& lse_log2) {
#pragma unroll
  for (int qi = 0; qi < kQT; ++qi)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float l = lse_log2(qi * 8 + 2 * t + e);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& x = acc_s[qi][2 * h + e];
        x = fast_exp2(x * scale_log2 - l);
      }
    }
}

// dS^T = P^T (dP^T - D[q]) in place of dP^T (D = rowsum(dO * O), per query).
template <int kQT>
__device__ __forceinline__ void ds_t(float (&acc_dp)[kQT][4], const float (&acc_p)[kQT][4], const float* dsum, int t) {
#pragma unroll
  for (int qi = 0; qi < kQT; ++qi)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float d = dsum[qi * 8 + 2 * t + e];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& x = acc_dp[qi][2 * h + e];
        x = acc_p[qi][2 * h + e] * (x - d);
      }
    }
}

// acc_to_a (../tile.cuh) of n-tiles 2 kk, 2 kk + 1 with dropout's dropped
// entries 0: dV's operand Z * P (its 1 / (1 - p) applied to dV at the end),
// while the undropped P stays in the accumulator for dS.
template <typename T, int kQT>
__device__ __forceinline__ void acc_to_a_kept(uint32_t (&a)[4], const float (&c)[kQT][4], int kk,
                                              const FragmentKeepBits<1, kQT>& keep) {
  float kept[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) kept[n][e] = keep.kept(0, 2 * kk + n, e) ? c[2 * kk + n][e] : 0.f;
  acc_to_a<T>(a, kept, 0);
}

// Packed A fragments of a warp's 16 rows (keys) x kQSteps * 16 columns
// (queries), as acc_to_a made them from a transposed accumulator, into a
// [key][query] tile: P^T or dS^T for a shared-memory operand. a[kk] holds rows
// g / g + 8 of n-tiles 2kk and 2kk + 1.
template <typename Tile, int kQSteps, typename T>
__device__ __forceinline__ void store_a_frags(T* tile, const uint32_t (&a)[kQSteps][4], int warp_row0, int g, int t) {
#pragma unroll
  for (int kk = 0; kk < kQSteps; ++kk)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<uint32_t*>(tile + Tile::offset(warp_row0 + g + 8 * h, (2 * kk + hh) * 8) + 2 * t) =
            a[kk][2 * hh + h];
}

// Varlen: zeroes rows [row_lo, Tile::kRows) of a swizzled shared-memory tile
// (all of each row's 16-byte chunks, so the swizzle does not matter), with
// kNThreads threads numbered tid. The caller fences (fence_proxy_async_smem:
// wgmma reads the tile next) and syncs its threads.
template <typename Tile, int kNThreads, typename T>
__device__ __forceinline__ void zero_tile_rows(T* tile, int row_lo, int tid) {
  constexpr int kChunks = Tile::kCols / 8;
  for (int i = row_lo * kChunks + tid; i < Tile::kRows * kChunks; i += kNThreads)
    *reinterpret_cast<uint4*>(tile + Tile::offset(i / kChunks, (i % kChunks) * 8)) = make_uint4(0, 0, 0, 0);
}

// Varlen, the last key block of a sequence: rows [keys, kBlockN) of sK are the
// next sequence's keys and dQ = dS K reads every row (see the top of the
// file): the kNThreads consumer threads zero them once, before any product,
// and meet at zero_bar.
template <typename TileKV, int kNThreads, typename T>
__device__ __forceinline__ void zero_key_tail(T* sK, int keys, int tid, int zero_bar) {
  zero_tile_rows<TileKV, kNThreads>(sK, keys, tid);
  fence_proxy_async_smem();  // wgmma (async proxy) reads what st.shared wrote
  named_barrier_sync(zero_bar, kNThreads);
}

}  // namespace flashattn
