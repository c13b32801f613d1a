// The epilogue role of the warp-specialized Hopper backward kernels
// (flash_bwd_sm90_ws_kernel.cuh, flash_bwd_sm90_ws_split_kernel.cuh): the key
// block's dK and dV, which the consumers have staged in sK / sV (scaled, the
// non-finite rule applied), stored to global memory.
#pragma once

#include "../../flash_params.h"
#include "../tile.cuh"

namespace flashattn {

// Rows [n0, n0 + keys) of (batch or sequence b, kv head h_kv) of dk and dv,
// by the kConsumerThreads consumer threads (ctid: the thread among them):
// store_tile's guarded 16-byte stores, rows < keys and columns < head_dim.
// seq: b's rows (SeqInfo; varlen: decoded again by the caller after its loop).
template <typename TileKV, int kConsumerThreads, typename T>
__device__ __forceinline__ void store_dk_dv(const AttnBwdParams& p, const SeqInfo& seq, int b, int h_kv, int n0,
                                            int keys, const T* sK, const T* sV, int ctid) {
  T* gdK = static_cast<T*>(p.dk_ptr) + seq.k_offset(p.dk_batch_stride, p.dk_row_stride, b) + h_kv * p.dk_head_stride +
           n0 * p.dk_row_stride;
  T* gdV = static_cast<T*>(p.dv_ptr) + seq.k_offset(p.dv_batch_stride, p.dv_row_stride, b) + h_kv * p.dv_head_stride +
           n0 * p.dv_row_stride;
  store_tile<TileKV, kConsumerThreads>(gdK, p.dk_row_stride, sK, keys, p.head_dim, ctid);
  store_tile<TileKV, kConsumerThreads>(gdV, p.dv_row_stride, sV, keys, p.head_dim, ctid);
}

}  // namespace flashattn
