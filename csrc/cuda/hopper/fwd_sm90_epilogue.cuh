// The epilogue role of the warp-specialized Hopper forward
// (flash_fwd_sm90_ws_kernel.cuh): a consumer's rows of a finished query tile,
// normalized (acc_o) with their log-sum-exp (row_lse), staged in shared
// memory (sO: its own tile, or Q's), the non-finite rule applied to them
// there, then stored by TMA (or, for a varlen sequence that ends inside the
// consumer's rows, by 16-byte stores of its threads); Q's stage released when
// O was staged in it.
#pragma once

#include "../../flash_params.h"
#include "../nonfinite_fixup.cuh"
#include "../tile.cuh"
#include "fwd_sm90_common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flashattn {

// et: the tile (decoded again when varlen), m0 its first row; cwg the
// consumer, warp_row0 this warp's first row of the tile; elected: the thread
// that issues the consumer's stores and releases. Named barrier
// fwd_consumer_bar(cwg): this consumer's 128 threads.
template <typename Kt, bool kVarlen, bool kScoreMod>
__device__ __forceinline__ void fwd_sm90_epilogue(const AttnFwdParams& p, const FwdTmaMaps& maps,
                                                  const FwdSm90Smem<Kt>& sm, const FwdTile<Kt::kBlockM, kVarlen>& et,
                                                  int m0, float (&acc_o)[1][Kt::kHeadDim / 8][4],
                                                  const float (&row_lse)[1][2], bool bad, int cwg, int warp_row0,
                                                  int lane, int tid, bool elected) {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using C = FwdSm90Coords<Kt, kVarlen>;
  constexpr int kHeadDim = Kt::kHeadDim;
  const int g = lane >> 2, t = lane & 3;
  T* const sO = sm.sO;
  uint64_t* const empty_q = sm.empty_q;
  if (Kt::kSeparateO) {
    // This consumer's previous O store must have finished reading its rows of sO.
    if (elected) tma_store_wait_read();
    named_barrier_sync(fwd_consumer_bar<Kt>(cwg), 128);
  }
  // (Staged in sQ: this consumer's rows are free, its last S GEMM has
  // completed and no other warpgroup reads them.)
  store_acc<TileQ>(sO, acc_o, warp_row0, 0, lane);
  if (t == 0) {
    float* gLse = static_cast<float*>(p.lse_ptr) + et.seq.rowvec_offset(p, et.b, et.h) + m0;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = warp_row0 + g + 8 * hh;
      if (r < et.rows) gLse[r] = row_lse[0][hh];
    }
  }
  // The non-finite rule (../nonfinite_fixup.cuh): this warp's 16 rows of the
  // staged O, exactly, if one holds a NaN / inf (before the TMA store reads them).
  if (__any_sync(0xffffffffu, bad))
    nonfinite::fix_fwd_rows<TileQ, (kHeadDim + 31) / 32>(nonfinite::fixup_args(p, et.seq, et.b), et.h, m0, warp_row0,
                                                         16, et.rows, sO, lane,
                                                         nonfinite::score_policy<kScoreMod>(p, et.b));
  fence_proxy_async_smem();  // the TMA store (async proxy) reads what st.shared wrote
  named_barrier_sync(fwd_consumer_bar<Kt>(cwg), 128);
  // Varlen: this consumer's rows of the sequence (its box is rows 64 cwg .. 64 cwg + 63 of the tile).
  // seqused_k: dense tensor maps, which clip the box at seqlen_q as in a dense batch.
  const int o_rows = kVarlen && p.is_varlen() ? et.rows - cwg * 64 : 64;
  if (o_rows >= 64) {
    if (elected) {
#pragma unroll
      for (int pn = 0; pn < Kt::kPanels; ++pn)
        tma_store_4d(&maps.o, sO + pn * TileQ::kRows * 64 + cwg * 64 * 64, pn * 64, et.h, C::q_row_of(et) + cwg * 64,
                     C::batch_of(p, et));
      tma_store_commit();
      if (!Kt::kSeparateO) {
        tma_store_wait_read();
        mbar_arrive(empty_q);
      }
    }
  } else {
    // Varlen, the sequence ends inside this consumer's rows (or before
    // them): its 128 threads store the o_rows rows (none when <= 0) with
    // 16-byte stores, 8 columns a thread, consecutive threads along a row.
    // Columns past head_dim are left out as the TMA store clips them.
    T* gO = static_cast<T*>(p.o_ptr) + et.seq.q_offset(p.o_batch_stride, p.o_row_stride, et.b) +
            et.h * p.o_head_stride + int64_t(m0 + cwg * 64) * p.o_row_stride;
    constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of a row
    for (int i = tid & 127; i < o_rows * kChunks; i += 128) {
      const int r = i / kChunks, c = (i % kChunks) * 8;
      if (c < p.head_dim)
        *reinterpret_cast<uint4*>(gO + int64_t(r) * p.o_row_stride + c) =
            *reinterpret_cast<const uint4*>(sO + TileQ::offset(cwg * 64 + r, c));
    }
    if (!Kt::kSeparateO) {
      // O is staged in sQ: every thread of this consumer has read its rows
      // before the producer may load the next Q there (async proxy after
      // generic reads: the fence orders them, as after the writes above).
      fence_proxy_async_smem();
      named_barrier_sync(fwd_consumer_bar<Kt>(cwg), 128);
      if (elected) mbar_arrive(empty_q);
    }
    // (With a separate O tile, the next tile's epilogue syncs this
    // consumer's threads before any of them writes sO again.)
  }
}

}  // namespace flashattn
