// Split-KV decoding (flash-decoding) for flashattn_ext::fwd_kvcache.
//
// Decoding has few query rows and long caches: one CTA per (query block,
// head) as in the forward kernel leaves most SMs idle and reads each key/value
// head once per query head of its GQA group. Here:
//
//   grid (num_splits, heads_kv * query tiles, batch)
//   - a CTA packs the query rows of one GQA group, (heads_q / heads_kv) heads
//     x seqlen_q queries, into its M dimension (packed row r is query
//     r / ratio of head h_kv * ratio + r % ratio), so the group's keys and
//     values are read once;
//   - a row's visible keys are cut into num_splits ranges of 64-key blocks;
//     a CTA sweeps its range with a kStages-deep cp.async pipeline of K and V
//     tiles (16-byte copies; with a page table, the entries are read on the
//     device one block ahead: one per block when page_size is a multiple of
//     the 64-key block, else one per key row);
//   - inside a CTA the four warps split each key block (16 keys each) rather
//     than the rows: every warp holds all the CTA's rows, so each key is read
//     from shared memory once, and the warps' online-softmax states are merged
//     through the log-sum-exp at the end;
//   - num_splits == 1 writes out and lse directly; otherwise each split
//     writes an fp32 partial output and its lse (log2 units) to a workspace
//     and flash_decode_combine_kernel merges them. On sm90 the combine kernel
//     is launched with programmatic dependent launch (pdl_launch.h; off with
//     FLASHATTN_DISABLE_PDL=1), so its launch overlaps the split grid's last
//     wave instead of following it.
//
// The integer arguments are read on the device and clamped into range (a bad
// value cannot make a read or write leave the tensors; the CPU kernel and the
// Python API check the values where they can without a host synchronisation).
//
// kScoreMod: the instance for calls with softcap / ALiBi (score_mod.cuh). The
// packed rows of a CTA belong to several heads, so each accumulator row gets
// its own ScoreModTile (its head's slope, its query index).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "../kvcache_params.h"
#include "decode_dispatch.h"
#include "nonfinite_fixup.cuh"
#include "pdl_launch.h"
#include "ptx.cuh"
#include "score_mod.cuh"
#include "smem_limit.h"
#include "softmax.cuh"
#include "tile.cuh"

namespace flashattn {

template <typename T_, int kHeadDim_, int kMT_>
struct DecodeTraits {
  using Element = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kMT = kMT_;  // 16-row m-tiles; every warp holds all kBlockM rows
  static constexpr int kBlockM = 16 * kMT;
  static constexpr int kBlockN = kDecodeBlockN;
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kKeysPerWarp = kBlockN / kNWarps;
  static_assert(kKeysPerWarp == 16, "a warp's key slice is one 16-key k-step of P V");
  // Stages of K/V in flight: ~64-96 KiB of tiles per CTA, so that two or more
  // CTAs per SM keep enough bytes in flight to saturate HBM.
  static constexpr int kStages = kHeadDim <= 64 ? 4 : (kHeadDim <= 128 ? 3 : 2);
  using TileQ = SmemTile<kBlockM, kHeadDim>;
  using TileKV = SmemTile<kBlockN, kHeadDim>;
  static constexpr int kQBytes = TileQ::kElems * 2;
  static constexpr int kTileKVBytes = TileKV::kElems * 2;
  static constexpr int kStageMemBytes = 2 * kStages * kTileKVBytes;  // K and V stages
  // The epilogue stages each warp's fp32 partial output over the K/V stages.
  static constexpr int kAccBytes = kNWarps * kBlockM * kHeadDim * 4;
  static_assert(kAccBytes <= kStageMemBytes, "epilogue buffer must fit in the K/V stages");
  static constexpr int kLseBytes = kNWarps * kBlockM * 4;
  static constexpr int kSmemBytes = kQBytes + kStageMemBytes + kLseBytes;
};

// Copies 16-byte chunks of rows with per-row source addresses into a swizzled
// tile (the layout of copy_tile_async in tile.cuh): a thread keeps one chunk
// column of a panel and the rows row0 + i * kRowStep, so it looks up kIters
// row addresses per tile. A null row, and columns past valid_cols, are
// zero-filled.
template <typename Tile, int kNThreads>
struct RowCopy {
  static constexpr int kChunks = Tile::kPanel / 8;  // chunks per panel row
  static constexpr int kRowStep = kNThreads / kChunks;
  static constexpr int kIters = (Tile::kRows + kRowStep - 1) / kRowStep;
  static constexpr int kPanels = Tile::kCols / Tile::kPanel;
  static_assert(kNThreads % kChunks == 0, "copy layout");

  __device__ __forceinline__ static int row(int tid, int i) { return tid / kChunks + i * kRowStep; }

  template <typename T>
  __device__ __forceinline__ static void copy(T* smem, const T* const (&src)[kIters], int valid_cols, const T* dummy,
                                              int tid) {
    const int col0 = (tid % kChunks) * 8;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int r = row(tid, i);
      if (Tile::kRows % kRowStep != 0 && r >= Tile::kRows) continue;
#pragma unroll
      for (int pi = 0; pi < kPanels; ++pi) {
        const int col = pi * Tile::kPanel + col0;
        const bool pred = src[i] != nullptr && col < valid_cols;
        cp_async_16(smem_u32(smem + Tile::offset(r, col)), pred ? src[i] + col : dummy, pred);
      }
    }
  }
};

__device__ __forceinline__ int clamp_int(int64_t x, int lo, int hi) {
  return static_cast<int>(x < lo ? lo : (x > hi ? hi : x));
}

// log2 of sum_i 2^x[i * stride] (n terms): -inf when every term is -inf, NaN
// when one is NaN (a NaN score the row sees must reach the output).
__device__ __forceinline__ float merge_lse2(const float* x, int n, int stride) {
  float mx = -INFINITY;
  bool nan = false;
  for (int i = 0; i < n; ++i) {
    const float v = x[i * stride];
    nan |= v != v;
    mx = fmaxf(mx, v);
  }
  if (nan) return NAN;
  if (mx == -INFINITY) return -INFINITY;
  float sum = 0.f;
  for (int i = 0; i < n; ++i) sum += exp2f(x[i * stride] - mx);
  return mx + __log2f(sum);
}

template <typename Kt, bool kScoreMod = false>
__global__ void __launch_bounds__(Kt::kNThreads) flash_decode_kernel(const KvcacheParams p) {
  using T = typename Kt::Element;
  using TileQ = typename Kt::TileQ;
  using TileKV = typename Kt::TileKV;
  using CopyQ = RowCopy<TileQ, Kt::kNThreads>;
  using CopyKV = RowCopy<TileKV, Kt::kNThreads>;
  constexpr int kMT = Kt::kMT, kBlockM = Kt::kBlockM, kBlockN = Kt::kBlockN, kHeadDim = Kt::kHeadDim;
  constexpr int kDT = kHeadDim / 8;  // 8-column n-tiles of O
  constexpr int kStages = Kt::kStages, kNThreads = Kt::kNThreads, kNWarps = Kt::kNWarps;

  extern __shared__ __align__(128) char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = reinterpret_cast<T*>(smem_raw + Kt::kQBytes);  // [kStages] K tiles
  T* sV = sK + kStages * TileKV::kElems;                 // [kStages] V tiles
  float* sAcc = reinterpret_cast<float*>(sK);            // epilogue: [warp][row][col], over the stages
  float* sLse = reinterpret_cast<float*>(smem_raw + Kt::kQBytes + Kt::kStageMemBytes);  // [warp][row]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int ratio = p.heads_q / p.heads_kv;
  const int m_tiles = gridDim.y / p.heads_kv;  // query tiles per GQA group
  const int split = blockIdx.x, h_kv = blockIdx.y / m_tiles, b = blockIdx.z;
  const int m0 = (blockIdx.y % m_tiles) * kBlockM;  // first packed row of this CTA
  const int rows = min(kBlockM, ratio * p.seqlen_q - m0);
  const bool paged = p.block_table != nullptr;

  // The row's integer arguments, clamped into range (see the file comment).
  const int seqlen_k = row_seqlen_k(p.seqlens_k, b, p.capacity);
  const int key_begin = p.leftpad ? clamp_int(p.leftpad[b], 0, seqlen_k) : 0;
  const int cache_row = paged ? 0 : (p.batch_idx ? clamp_int(p.batch_idx[b], 0, p.cache_rows - 1) : b);
  const int32_t* table = paged ? p.block_table + b * p.block_table_batch_stride : nullptr;

  // Query i sits at key diag + i; it sees [key_lo(i), key_hi(i)). Both bounds
  // grow with i, so the CTA's rows (queries i_first..i_last) see the union
  // [key_lo(i_first), key_hi(i_last)) and every key of [key_lo(i_last),
  // key_hi(i_first)) is visible to all of them (no mask needed there).
  const int64_t diag = int64_t(seqlen_k) - p.seqlen_q;
  auto key_lo = [&](int i) {
    return p.window_left < 0 ? key_begin : clamp_int(diag + i - p.window_left, key_begin, seqlen_k);
  };
  auto key_hi = [&](int i) {
    return p.window_right < 0 ? seqlen_k : clamp_int(diag + i + p.window_right + 1, key_begin, seqlen_k);
  };
  const int i_first = m0 / ratio, i_last = (m0 + rows - 1) / ratio;
  const int lo_cta = key_lo(i_first), hi_cta = key_hi(i_last);
  const int free_lo = key_lo(i_last), free_hi = key_hi(i_first);

  // This split's key blocks.
  const int nb_lo = lo_cta / kBlockN;
  const int nb_hi = hi_cta > lo_cta ? ceil_div(hi_cta, kBlockN) : nb_lo;
  const int per_split = ceil_div(nb_hi - nb_lo, p.num_splits);
  const int n_begin = nb_lo + split * per_split;
  const int n_count = max(0, min(nb_hi, n_begin + per_split) - n_begin);

  const T* q_base = static_cast<const T*>(p.q_ptr) + b * p.q_batch_stride;
  const T* k_base = static_cast<const T*>(p.k_ptr) + h_kv * p.k_head_stride + cache_row * p.k_batch_stride;
  const T* v_base = static_cast<const T*>(p.v_ptr) + h_kv * p.v_head_stride + cache_row * p.v_batch_stride;
  const T* dummy = static_cast<const T*>(p.k_ptr);  // the source of zero-filled chunks (never read)

  // Q: the CTA's packed rows (rows past the group are zero-filled).
  {
    const T* src[CopyQ::kIters];
#pragma unroll
    for (int i = 0; i < CopyQ::kIters; ++i) {
      const int r = CopyQ::row(tid, i);
      const int packed = m0 + r, qi = packed / ratio, head = h_kv * ratio + packed % ratio;
      src[i] = r < rows ? q_base + qi * p.q_row_stride + head * p.q_head_stride : nullptr;
    }
    CopyQ::copy(sQ, src, p.head_dim, dummy, tid);
  }

  // Where page_size is a multiple of kBlockN (the usual case), a key block lies
  // within one page: one table entry serves the whole block, the same for every
  // thread (one broadcast load a block). Other page sizes (multiples of 16)
  // look up the page of each key row.
  const bool page_per_row = paged && p.page_size % kBlockN != 0;
  // The page-table entries of the next block to load, fetched one block ahead
  // so that their latency hides under a block's work: pages[0] the block's page
  // or, per row, pages[i] the page of this thread's i-th row.
  int pages[CopyKV::kIters] = {};
  auto fetch_pages = [&](int n_block) {
    if (!paged || n_block >= n_begin + n_count) return;  // (a block never loaded: its entries are not read)
    if (!page_per_row) {
      // The split's blocks hold a key of [lo_cta, hi_cta), so the entry is within the row's table.
      pages[0] = table[n_block * kBlockN / p.page_size];
      return;
    }
#pragma unroll
    for (int i = 0; i < CopyKV::kIters; ++i) {
      const int key = n_block * kBlockN + CopyKV::row(tid, i);
      pages[i] = (key >= lo_cta && key < hi_cta) ? table[key / p.page_size] : 0;
    }
  };
  // K and V rows of key block n_block into `stage`; keys no row of the CTA
  // sees (outside [lo_cta, hi_cta)) are zero-filled, not read.
  auto load_kv = [&](int n_block, int stage) {
    const int key0 = n_block * kBlockN;
    // A block within one page: its rows follow its first row's offset.
    int64_t k_block = 0, v_block = 0;
    if (paged && !page_per_row) {
      const int64_t page = clamp_int(pages[0], 0, p.cache_rows - 1), slot0 = key0 % p.page_size;
      k_block = page * p.k_batch_stride + slot0 * p.k_row_stride;
      v_block = page * p.v_batch_stride + slot0 * p.v_row_stride;
    }
    const T* src_k[CopyKV::kIters];
    const T* src_v[CopyKV::kIters];
#pragma unroll
    for (int i = 0; i < CopyKV::kIters; ++i) {
      const int r = CopyKV::row(tid, i);
      const int key = key0 + r;
      const bool ok = r < kBlockN && key >= lo_cta && key < hi_cta;
      int64_t k_off = int64_t(key) * p.k_row_stride, v_off = int64_t(key) * p.v_row_stride;  // contiguous
      if (paged && !page_per_row) {
        k_off = k_block + r * p.k_row_stride;
        v_off = v_block + r * p.v_row_stride;
      } else if (page_per_row) {
        const int64_t page = clamp_int(pages[i], 0, p.cache_rows - 1), slot = key % p.page_size;
        k_off = page * p.k_batch_stride + slot * p.k_row_stride;
        v_off = page * p.v_batch_stride + slot * p.v_row_stride;
      }
      src_k[i] = ok ? k_base + k_off : nullptr;
      src_v[i] = ok ? v_base + v_off : nullptr;
    }
    CopyKV::copy(sK + stage * TileKV::kElems, src_k, p.head_dim, dummy, tid);
    CopyKV::copy(sV + stage * TileKV::kElems, src_v, p.head_dim, dummy, tid);
  };

  // Prologue: Q (in the first group) and kStages - 1 blocks in flight; one
  // commit group per stage, empty ones included, keeps the wait counts fixed.
  fetch_pages(n_begin);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_count) load_kv(n_begin + s, s);
    cp_async_commit();
    fetch_pages(n_begin + s + 1);
  }

  // Lets the combine kernel (launched with PDL, p.pdl) be scheduled early. It
  // launches only once every CTA of this grid has executed this or exited, so
  // no CTA of this grid is still waiting for a slot then: its CTAs (waiting in
  // pdl_wait, no shared memory) take only the registers and warps this grid's
  // last wave leaves free, and its launch latency hides under that whole wave
  // (after the main loop, it would hide only under the epilogue). Its wait
  // still covers this whole grid, so where this stands affects only timing.
  pdl_launch_dependents();

  // The visible key range of each of this lane's accumulator rows (rows past
  // the group see nothing: they are computed and never stored).
  int row_lo[kMT][2], row_hi[kMT][2];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mi * 16 + g + 8 * h;
      const int qi = (m0 + r) / ratio;
      row_lo[mi][h] = r < rows ? key_lo(qi) : 0;
      row_hi[mi][h] = r < rows ? key_hi(qi) : 0;
    }

  const LdsmA<TileQ> ldsm_q(sQ, 0, 0, lane);
  const LdsmB<TileKV> ldsm_k(sK, warp * Kt::kKeysPerWarp, 0, lane);  // this warp's 16 keys
  const LdsmA<TileKV> ldsm_v(sV, warp * Kt::kKeysPerWarp, 0, lane);
  // With a score mod the scores reach the softmax scaled, in log2 units.
  const bool positive_scale = kScoreMod || p.softmax_scale > 0.f;

  float acc_o[kMT][kDT][4];
  clear(acc_o);
  OnlineSoftmax<kMT> softmax;

  int stage = 0;
  for (int j = 0; j < n_count; ++j) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // block j has landed; every warp is done with block j - 1's stage
    {
      int load_stage = stage + kStages - 1;
      load_stage = load_stage >= kStages ? load_stage - kStages : load_stage;
      if (j + kStages - 1 < n_count) load_kv(n_begin + j + kStages - 1, load_stage);
      cp_async_commit();
      fetch_pages(n_begin + j + kStages);
    }
    const int n0 = (n_begin + j) * kBlockN;
    const uint32_t stage_offset = stage * Kt::kTileKVBytes;

    // S = Q K^T on this warp's 16 keys: rows kBlockM x 16 columns.
    float acc_s[kMT][2][4];
    clear(acc_s);
    gemm_ss_nk<kMT, 2, kHeadDim, T>(acc_s, ldsm_q, ldsm_k, stage_offset);
    if constexpr (kScoreMod) {
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = mi * 16 + g + 8 * h;
          const int packed = m0 + (r < rows ? r : 0);
          const ScoreModTile mod(p.score_mod, static_cast<float>(p.softmax_scale), b, h_kv * ratio + packed % ratio,
                                 p.seqlen_q, seqlen_k);
#pragma unroll
          for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key = n0 + warp * Kt::kKeysPerWarp + ni * 8 + 2 * t + e;
              acc_s[mi][ni][2 * h + e] = mod.apply(acc_s[mi][ni][2 * h + e], packed / ratio, key);
            }
        }
    }
    if (!(n0 >= free_lo && n0 + kBlockN <= free_hi)) {
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key = n0 + warp * Kt::kKeysPerWarp + ni * 8 + 2 * t + e;
              if (key < row_lo[mi][h] || key >= row_hi[mi][h]) acc_s[mi][ni][2 * h + e] = -INFINITY;
            }
    }
    if (positive_scale) {
      softmax.template update<true>(acc_s, acc_o, kScoreMod ? 1.f : p.softmax_scale_log2);
    } else {
      softmax.template update<false>(acc_s, acc_o, kScoreMod ? 1.f : p.softmax_scale_log2);
    }
    // O += P V on the same 16 keys.
    gemm_rc_kn<kMT, kDT, Kt::kKeysPerWarp, T>(acc_o, acc_s, ldsm_v, stage_offset);
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }

  // Epilogue. Each warp's rows carry (max m_w, sum l_w, unnormalized O_w) over
  // its key slices; in log2 units lse_w = m_w + log2(l_w). The CTA's lse is
  // L = log2(sum_w 2^lse_w) and its output sum_w 2^(m_w - L) O_w.
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: sAcc may overwrite them
  float m_w[kMT][2], l_w[kMT][2];
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_w[mi][h] = quad_sum(softmax.row_sum[mi][h]);
      m_w[mi][h] =
          positive_scale ? softmax.row_max[mi][h] * (kScoreMod ? 1.f : p.softmax_scale_log2) : softmax.row_max[mi][h];
      const float lse_w = l_w[mi][h] == 0.f ? -INFINITY : m_w[mi][h] + __log2f(l_w[mi][h]);
      if (t == 0) sLse[warp * kBlockM + mi * 16 + g + 8 * h] = lse_w;
    }
  __syncthreads();
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mi * 16 + g + 8 * h;
      const float lse = merge_lse2(sLse + r, kNWarps, kBlockM);
      // A warp that saw no key of the row holds O_w = 0 (and m_w may be -inf).
      const float factor = (l_w[mi][h] == 0.f || lse == -INFINITY) ? 0.f : exp2f(m_w[mi][h] - lse);
      float* dst = sAcc + (warp * kBlockM + r) * kHeadDim + 2 * t;
#pragma unroll
      for (int di = 0; di < kDT; ++di) {
        *reinterpret_cast<float2*>(dst + di * 8) =
            make_float2(acc_o[mi][di][2 * h] * factor, acc_o[mi][di][2 * h + 1] * factor);
      }
    }
  __syncthreads();

  // Sum the warps' outputs, 8 columns per item, and store: the final output
  // (num_splits == 1) or this split's fp32 partial.
  const int64_t rows_total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  constexpr int kChunksPerRow = kHeadDim / 8;
  bool bad = false;  // a non-finite value in a final output row (see the end)
  for (int idx = tid; idx < kBlockM * kChunksPerRow; idx += kNThreads) {
    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
    if (r >= rows || c >= p.head_dim) continue;
    float o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = 0.f;
#pragma unroll
    for (int w = 0; w < kNWarps; ++w) {
      const float4* src = reinterpret_cast<const float4*>(sAcc + (w * kBlockM + r) * kHeadDim + c);
      const float4 a = src[0], bb = src[1];
      o[0] += a.x, o[1] += a.y, o[2] += a.z, o[3] += a.w;
      o[4] += bb.x, o[5] += bb.y, o[6] += bb.z, o[7] += bb.w;
    }
    const int packed = m0 + r, qi = packed / ratio, head = h_kv * ratio + packed % ratio;
    if (p.num_splits == 1) {
      T* dst = static_cast<T*>(p.o_ptr) + b * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride + c;
      *reinterpret_cast<uint4*>(dst) =
          make_uint4(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]), pack2<T>(o[4], o[5]), pack2<T>(o[6], o[7]));
#pragma unroll
      for (int e = 0; e < 8; ++e) bad |= nonfinite::is_bad(o[e]);
    } else {
      const int64_t row = split * rows_total + (int64_t(b) * p.heads_q + head) * p.seqlen_q + qi;
      float4* dst = reinterpret_cast<float4*>(p.o_accum + row * p.head_dim + c);
      dst[0] = make_float4(o[0], o[1], o[2], o[3]);
      dst[1] = make_float4(o[4], o[5], o[6], o[7]);
    }
  }
  constexpr float kLn2 = 0.6931471805599453f;
  for (int r = tid; r < rows; r += kNThreads) {
    const float lse = merge_lse2(sLse + r, kNWarps, kBlockM);
    const int packed = m0 + r, qi = packed / ratio, head = h_kv * ratio + packed % ratio;
    const int64_t row = (int64_t(b) * p.heads_q + head) * p.seqlen_q + qi;
    if (p.num_splits == 1) {
      static_cast<float*>(p.lse_ptr)[row] = lse * kLn2;
    } else {
      p.lse_accum[split * rows_total + row] = lse;
    }
  }
  // The non-finite rule (nonfinite_fixup.cuh): a row of the CTA's rows
  // [lo_cta, hi_cta) does not see may still reach it as 0 * NaN in P V. With
  // one split the rows holding a NaN / inf are recomputed here, once every
  // thread's stores are done (the barrier); with several, in the combine kernel.
  if (p.num_splits == 1 && __syncthreads_or(bad)) {
    const nonfinite::DecodeFixupArgs args = nonfinite::decode_fixup_args(p);
    for (int r = warp; r < rows; r += kNWarps) {
      const int packed = m0 + r;
      if constexpr (kScoreMod) {
        nonfinite::fix_decode_row<(kHeadDim + 31) / 32, T>(args, b, h_kv * ratio + packed % ratio, packed / ratio, lane,
                                                           nonfinite::DecodeModScore{p.score_mod});
      } else {
        nonfinite::fix_decode_row<(kHeadDim + 31) / 32, T>(args, b, h_kv * ratio + packed % ratio, packed / ratio,
                                                           lane);
      }
    }
  }
}

// Merges the splits of every output row (batch, head, query): one warp per
// row. With lse_s the splits' log2-sum-exps and L = log2(sum_s 2^lse_s), the
// output is sum_s 2^(lse_s - L) O_s and lse = L ln 2; a row no split saw a key
// of gets zeros and -inf.
// (At most 64 registers: the slow path's call would otherwise set the register count.)
template <typename T>
__global__ void __launch_bounds__(128, 8) flash_decode_combine_kernel(const KvcacheParams p) {
  // Launched with PDL (p.pdl), this kernel may start while the split kernel
  // still runs: every thread waits for the split grid (and its workspace
  // writes) before anything else, the early exit below included, so that the
  // grid's completion also implies the split kernel's for what follows it.
  pdl_wait();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t rows_total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * 4 + warp;
  if (row >= rows_total) return;  // (whole warps: the vote at the end sees all 32 lanes)
  bool bad = false;
  const int splits = p.num_splits;
  const float* lse_s = p.lse_accum + row;  // split s at lse_s[s * rows_total]

  float mx = -INFINITY;
  bool nan = false;
  for (int s = lane; s < splits; s += 32) {
    const float v = lse_s[s * rows_total];
    nan |= v != v;
    mx = fmaxf(mx, v);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
  nan = __any_sync(0xffffffff, nan);
  float sum = 0.f;
  if (mx != -INFINITY) {
    for (int s = lane; s < splits; s += 32) sum += exp2f(lse_s[s * rows_total] - mx);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
  const float lse = nan ? NAN : (mx == -INFINITY ? -INFINITY : mx + __log2f(sum));

  const int qi = static_cast<int>(row % p.seqlen_q);
  const int64_t bh = row / p.seqlen_q;
  const int head = static_cast<int>(bh % p.heads_q), b = static_cast<int>(bh / p.heads_q);
  T* out = static_cast<T*>(p.o_ptr) + b * p.o_batch_stride + qi * p.o_row_stride + head * p.o_head_stride;
  for (int c = lane * 4; c < p.head_dim; c += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < splits; ++s) {
      const float w = lse == -INFINITY ? 0.f : exp2f(lse_s[s * rows_total] - lse);
      if (w == 0.f) continue;  // an empty split (its partial is 0): nothing to read
      const float4 o = *reinterpret_cast<const float4*>(p.o_accum + (s * rows_total + row) * p.head_dim + c);
      acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w;
    }
    *reinterpret_cast<uint2*>(out + c) = make_uint2(pack2<T>(acc.x, acc.y), pack2<T>(acc.z, acc.w));
    bad |= nonfinite::is_bad(acc.x) || nonfinite::is_bad(acc.y) || nonfinite::is_bad(acc.z) || nonfinite::is_bad(acc.w);
  }
  if (lane == 0) static_cast<float*>(p.lse_ptr)[row] = lse * 0.6931471805599453f;
  // The non-finite rule (nonfinite_fixup.cuh): a row with a NaN / inf is
  // recomputed exactly over its visible keys (after its stores above, same warp).
  // (Its score mod, if any, is a runtime property here: one combine kernel serves both instances.)
  if (__any_sync(0xffffffffu, bad)) {
    if (p.score_mod.any()) {
      nonfinite::fix_decode_row<8, T>(nonfinite::decode_fixup_args(p), b, head, qi, lane,
                                      nonfinite::DecodeModScore{p.score_mod});
    } else {
      nonfinite::fix_decode_row<8, T>(nonfinite::decode_fixup_args(p), b, head, qi, lane);
    }
  }
}

template <typename T, int kHeadDim, int kMT>
cudaError_t launch_decode(const KvcacheParams& p, cudaStream_t stream) {
  using Kt = DecodeTraits<T, kHeadDim, kMT>;
  auto kernel = p.score_mod.any() ? &flash_decode_kernel<Kt, true> : &flash_decode_kernel<Kt, false>;
  if (cudaError_t err = allow_smem(kernel, Kt::kSmemBytes); err != cudaSuccess) return err;
  const int m_tiles = ceil_div(p.heads_q / p.heads_kv * p.seqlen_q, Kt::kBlockM);
  const dim3 grid(p.num_splits, p.heads_kv * m_tiles, p.batch);
  kernel<<<grid, Kt::kNThreads, Kt::kSmemBytes, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  if (p.num_splits > 1) {
    const int64_t rows_total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
    return launch_kernel_pdl(p.pdl, &flash_decode_combine_kernel<T>, dim3(static_cast<unsigned>((rows_total + 3) / 4)),
                             dim3(128), 0, stream, p);
  }
  return cudaSuccess;
}

template <typename T, int kHeadDim, typename F>
cudaError_t with_decode_m_tiles(int m_tiles, F&& f) {
  if (m_tiles == 1) return f(std::integral_constant<int, 1>{});
  if constexpr (decode_max_m_tiles(kHeadDim) >= 2) {
    if (m_tiles == 2) return f(std::integral_constant<int, 2>{});
  }
  if constexpr (decode_max_m_tiles(kHeadDim) >= 4) {
    if (m_tiles == 4) return f(std::integral_constant<int, 4>{});
  }
  return cudaErrorInvalidValue;
}

template <typename T, int kHeadDim>
cudaError_t run_decode(const KvcacheParams& params, int m_tiles, cudaStream_t stream) {
  return with_decode_m_tiles<T, kHeadDim>(
      m_tiles, [&](auto mt) { return launch_decode<T, kHeadDim, decltype(mt)::value>(params, stream); });
}

// Queried once per (device, m_tiles) and kept: the answer depends only on the
// kernel and the device, and the call runs on every decode step.
template <typename T, int kHeadDim>
int decode_ctas_per_sm(int m_tiles) {
  static std::atomic<int> cached[64][3];  // [device][log2 m_tiles]; 0 (static zero-init): not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  const int slot = m_tiles == 4 ? 2 : m_tiles - 1;
  if (slot < 0 || slot > 2) return 0;
  if (const int known = cached[dev][slot].load(std::memory_order_relaxed); known > 0) return known;
  int ctas = 0;
  const cudaError_t err = with_decode_m_tiles<T, kHeadDim>(m_tiles, [&](auto mt) {
    using Kt = DecodeTraits<T, kHeadDim, decltype(mt)::value>;
    auto kernel = &flash_decode_kernel<Kt>;
    if (cudaError_t e = allow_smem(kernel, Kt::kSmemBytes); e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, Kt::kNThreads, Kt::kSmemBytes);
  });
  if (err != cudaSuccess) return 0;
  cached[dev][slot].store(ctas, std::memory_order_relaxed);
  return ctas;
}

}  // namespace flashattn
