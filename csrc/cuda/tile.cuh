// Shared-memory tiles and the warp-level matrix products built on them.
//
// A tile is kRows x kCols 16-bit elements (kCols a multiple of 32), stored as
// column panels of 64 (or 32) elements; inside a panel each row is 128 (64)
// bytes and its 16-byte chunks are XOR-swizzled with the row index, so the 8
// row addresses of one ldmatrix hit 8 different bank groups.
//
// Fragment conventions (mma.sync m16n8k16, lane = 4 * g + t):
//   A 16x16: a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 8+2t..), a[3] = (g+8, 8+2t..)
//   B 16x8 : b[0] = (k 2t..2t+1, n g), b[1] = (k 8+2t.., n g)
//   C 16x8 : c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
#pragma once

#include "ptx.cuh"

namespace flashattn {

template <int kRows_, int kCols_, int kPanel_ = (kCols_ % 64 == 0) ? 64 : 32>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 elements");
  static constexpr int kPanel = kPanel_;
  static_assert((kPanel == 64 || kPanel == 32) && kCols % kPanel == 0, "panel width");
  static constexpr int kElems = kRows * kCols;

  // Offset in elements of (row, col); col must be a multiple of 8.
  __device__ __forceinline__ static int offset(int row, int col) {
    const int panel = col / kPanel;
    const int chunk = (col % kPanel) / 8;
    const int swz = kPanel == 64 ? (chunk ^ (row & 7)) : (chunk ^ ((row >> 1) & 3));
    return panel * (kRows * kPanel) + row * kPanel + swz * 8;
  }
};

// Asynchronously copies rows [0, valid_rows) and columns [0, valid_cols) of a
// global matrix into a tile; the rest of the tile is zero-filled. valid_cols
// is a multiple of 8 and every row start is 16-byte aligned (the binding layer
// guarantees both).
//
// Chunks are dealt panel by panel: a lane keeps one 16-byte column of a panel
// and steps down the rows by kNThreads / chunks-per-panel (a multiple of 8),
// so its shared-memory swizzle is fixed and every address is a base plus a
// compile-time step: little to keep live across the main loop.
template <typename Tile, int kNThreads, typename T>
__device__ __forceinline__ void copy_tile_async(T* smem, const T* gmem, int64_t row_stride, int valid_rows,
                                                int valid_cols, int tid) {
  constexpr int kChunksPerPanelRow = Tile::kPanel / 8;
  constexpr int kRowStep = kNThreads / kChunksPerPanelRow;
  constexpr int kItersPerPanel = Tile::kRows / kRowStep;
  constexpr int kPanels = Tile::kCols / Tile::kPanel;
  static_assert(kNThreads % kChunksPerPanelRow == 0 && kRowStep % 8 == 0 && Tile::kRows % kRowStep == 0, "copy layout");
  const int row0 = tid / kChunksPerPanelRow;
  const int col0 = (tid % kChunksPerPanelRow) * 8;
  const T* src0 = gmem + row0 * row_stride + col0;
  const uint32_t dst0 = smem_u32(smem + Tile::offset(row0, col0));
  const int64_t src_step = kRowStep * row_stride;
#pragma unroll
  for (int pi = 0; pi < kPanels; ++pi) {
#pragma unroll
    for (int i = 0; i < kItersPerPanel; ++i) {
      const bool pred = row0 + i * kRowStep < valid_rows && pi * Tile::kPanel + col0 < valid_cols;
      const T* src = src0 + i * src_step + pi * Tile::kPanel;
      const uint32_t dst = dst0 + 2 * (pi * Tile::kRows * Tile::kPanel + i * kRowStep * Tile::kPanel);
      cp_async_16(dst, pred ? src : gmem, pred);
    }
  }
}

// copy_tile_async for rows that are not one stride apart (a paged KV cache):
// row_of(r) gives row r's start in global memory, asked once per row a lane
// copies (the lane's rows are the same in every panel); `any` is a global
// address the zero-filled chunks name (nothing is read there).
template <typename Tile, int kNThreads, typename T, typename RowOf>
__device__ __forceinline__ void copy_tile_rows_async(T* smem, const RowOf& row_of, const T* any, int valid_rows,
                                                     int valid_cols, int tid) {
  constexpr int kChunksPerPanelRow = Tile::kPanel / 8;
  constexpr int kRowStep = kNThreads / kChunksPerPanelRow;
  constexpr int kItersPerPanel = Tile::kRows / kRowStep;
  constexpr int kPanels = Tile::kCols / Tile::kPanel;
  static_assert(kNThreads % kChunksPerPanelRow == 0 && kRowStep % 8 == 0 && Tile::kRows % kRowStep == 0, "copy layout");
  const int row0 = tid / kChunksPerPanelRow;
  const int col0 = (tid % kChunksPerPanelRow) * 8;
  const uint32_t dst0 = smem_u32(smem + Tile::offset(row0, col0));
#pragma unroll
  for (int i = 0; i < kItersPerPanel; ++i) {
    const bool row_ok = row0 + i * kRowStep < valid_rows;
    const T* src_row = row_ok ? row_of(row0 + i * kRowStep) + col0 : nullptr;
#pragma unroll
    for (int pi = 0; pi < kPanels; ++pi) {
      const bool pred = row_ok && pi * Tile::kPanel + col0 < valid_cols;
      const uint32_t dst = dst0 + 2 * (pi * Tile::kRows * Tile::kPanel + i * kRowStep * Tile::kPanel);
      cp_async_16(dst, pred ? src_row + pi * Tile::kPanel : any, pred);
    }
  }
}

// Copies rows [0, valid_rows) and columns [col0, min(col0 + kColsOut, valid_cols))
// of a tile to global memory (gmem points at column 0), 16 bytes at a time.
template <typename Tile, int kNThreads, int kColsOut = Tile::kCols, typename T>
__device__ __forceinline__ void store_tile(T* gmem, int64_t row_stride, const T* smem, int valid_rows, int valid_cols,
                                           int tid, int col0 = 0) {
  constexpr int kChunksPerRow = kColsOut / 8;
  constexpr int kChunks = Tile::kRows * kChunksPerRow;
  constexpr int kIters = (kChunks + kNThreads - 1) / kNThreads;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = tid + i * kNThreads;
    if (kChunks % kNThreads == 0 || idx < kChunks) {
      const int row = idx / kChunksPerRow;
      const int col = col0 + (idx % kChunksPerRow) * 8;
      if (row < valid_rows && col < valid_cols) {
        *reinterpret_cast<uint4*>(gmem + row * row_stride + col) =
            *reinterpret_cast<const uint4*>(smem + Tile::offset(row, col));
      }
    }
  }
}

// ---- fragment loads -------------------------------------------------------
//
// An ldmatrix.x4 reads four 8x8 blocks; each lane supplies one row address.
// Two lane -> (row, column half) assignments cover every operand:
//   kPairedRows = false: row lane & 15, column half lane >> 4
//       A of a [m][k] tile (ldmatrix), B of a [k][n] tile (ldmatrix.trans)
//   kPairedRows = true : row (lane & 7) + 8 * (lane >> 4), column half (lane >> 3) & 1
//       B of an [n][k] tile (ldmatrix), A of a [k][m] tile (ldmatrix.trans)
// For a lane, the swizzled address of block (r0, c0) with r0 % 8 == 0 and
// c0 % 16 == 0 is one of kPanel / 16 per-lane registers plus a compile-time
// immediate, so the unrolled products carry no address arithmetic.
template <typename Tile, bool kPairedRows>
struct LdsmAddr {
  static constexpr int kVariants = Tile::kPanel / 16;
  static constexpr int kPanelBytes = 2 * Tile::kRows * Tile::kPanel;
  uint32_t addr[kVariants];  // addr[j]: the block at (0, 16 j)

  // Origin (row0, col0) of the operand inside the tile: row0 % 8 == 0 and
  // col0 % 16 == 0 (both may be run-time values).
  template <typename T>
  __device__ __forceinline__ LdsmAddr(const T* tile, int row0, int col0, int lane) {
    const int row = row0 + (kPairedRows ? (lane & 7) + 8 * (lane >> 4) : (lane & 15));
    const int half = kPairedRows ? (lane >> 3) & 1 : (lane >> 4);
    const int swz = Tile::kPanel == 64 ? (row & 7) : ((row >> 1) & 3);
#pragma unroll
    for (int j = 0; j < kVariants; ++j) {
      const int col = col0 + 16 * j;
      const int chunk = (col % Tile::kPanel) / 8 + half;
      addr[j] =
          smem_u32(tile + (col / Tile::kPanel) * (Tile::kRows * Tile::kPanel) + row * Tile::kPanel + (chunk ^ swz) * 8);
    }
  }

  // Moving kPanel columns to the right lands on the same swizzle one panel over.
  __device__ __forceinline__ uint32_t operator()(int r0, int c0) const {
    return addr[(c0 / 16) % kVariants] + (c0 / 16 / kVariants) * kPanelBytes + 2 * r0 * Tile::kPanel;
  }
};

template <typename Tile>
using LdsmA = LdsmAddr<Tile, false>;  // A of [m][k]; B of [k][n] (trans)
template <typename Tile>
using LdsmB = LdsmAddr<Tile, true>;  // B of [n][k]; A of [k][m] (trans)

__device__ __forceinline__ void split_b(uint32_t (&b0)[2], uint32_t (&b1)[2], const uint32_t (&r)[4]) {
  b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
}

// ---- accumulator <-> A fragment -------------------------------------------

// The C fragments of n-tiles 2kk and 2kk+1 form the A fragment of k-step kk:
// this is how P = softmax(S) feeds P V without leaving registers.
template <typename T, int kNT>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[kNT][4], int kk) {
  a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// ---- warp-level products --------------------------------------------------
// acc[kMT][kNT][4] += A (kMT*16 rows) x B (kNT*8 columns), contracting kK.
//
// Every product shares one loop nest: per 16-wide k step, the A fragments of
// all m-tiles, then the B fragments of two n-tiles at a time (one ldmatrix.x4),
// each B fragment feeding every m-tile. The operands differ only in where the
// fragments come from: load_a(a, mi, ks) and load_b(r, np, ks).
template <int kMT, int kNT, int kK, typename T, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMT][kNT][4], LoadA&& load_a, LoadB&& load_b) {
  static_assert(kNT % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mi = 0; mi < kMT; ++mi) load_a(a[mi], mi, ks);
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t r[4], b0[2], b1[2];
      load_b(r, np, ks);
      split_b(b0, b1, r);
#pragma unroll
      for (int mi = 0; mi < kMT; ++mi) {
        mma_16816<T>(acc[mi][2 * np], a[mi], b0);
        mma_16816<T>(acc[mi][2 * np + 1], a[mi], b1);
      }
    }
  }
}

// A from a [m][k] tile, B from an [n][k] tile: S = Q K^T and its relatives.
// b_offset selects a buffer stage of B (bytes).
template <int kMT, int kNT, int kK, typename T, typename TileA, typename TileB>
__device__ __forceinline__ void gemm_ss_nk(float (&acc)[kMT][kNT][4], const LdsmA<TileA>& sA, const LdsmB<TileB>& sB,
                                           uint32_t b_offset = 0) {
  warp_gemm<kMT, kNT, kK, T>(
      acc, [&](uint32_t(&a)[4], int mi, int ks) { ldmatrix_x4(a, sA(mi * 16, ks * 16)); },
      [&](uint32_t(&r)[4], int np, int ks) { ldmatrix_x4(r, sB(np * 16, ks * 16) + b_offset); });
}

// A already in registers (a[mi][ks]), B from an [n][k] tile.
template <int kMT, int kNT, int kK, typename T, typename TileB>
__device__ __forceinline__ void gemm_rs_nk(float (&acc)[kMT][kNT][4], const uint32_t (&a_regs)[kMT][kK / 16][4],
                                           const LdsmB<TileB>& sB, uint32_t b_offset = 0) {
  warp_gemm<kMT, kNT, kK, T>(
      acc,
      [&](uint32_t(&a)[4], int mi, int ks) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = a_regs[mi][ks][i];
      },
      [&](uint32_t(&r)[4], int np, int ks) { ldmatrix_x4(r, sB(np * 16, ks * 16) + b_offset); });
}

// A from the accumulators of a previous product (kK/8 n-tiles), B from a
// [k][n] tile: O += P V and its relatives.
template <int kMT, int kNT, int kK, typename T, typename TileB>
__device__ __forceinline__ void gemm_rc_kn(float (&acc)[kMT][kNT][4], const float (&c)[kMT][kK / 8][4],
                                           const LdsmA<TileB>& sB, uint32_t b_offset = 0) {
  warp_gemm<kMT, kNT, kK, T>(
      acc, [&](uint32_t(&a)[4], int mi, int kk) { acc_to_a<T>(a, c[mi], kk); },
      [&](uint32_t(&r)[4], int np, int kk) { ldmatrix_x4_trans(r, sB(kk * 16, np * 16) + b_offset); });
}

// A from a [m][k] tile, B from a [k][n] tile: dV += P^T dO with P^T in shared memory.
template <int kMT, int kNT, int kK, typename T, typename TileA, typename TileB>
__device__ __forceinline__ void gemm_ss_kn(float (&acc)[kMT][kNT][4], const LdsmA<TileA>& sA, const LdsmA<TileB>& sB) {
  warp_gemm<kMT, kNT, kK, T>(
      acc, [&](uint32_t(&a)[4], int mi, int kk) { ldmatrix_x4(a, sA(mi * 16, kk * 16)); },
      [&](uint32_t(&r)[4], int np, int kk) { ldmatrix_x4_trans(r, sB(kk * 16, np * 16)); });
}

// A from a [k][m] tile (transposed), B from a [k][n] tile: dQ += dS K with dS^T in shared memory.
template <int kMT, int kNT, int kK, typename T, typename TileA, typename TileB>
__device__ __forceinline__ void gemm_tt_kn(float (&acc)[kMT][kNT][4], const LdsmB<TileA>& sA, const LdsmA<TileB>& sB) {
  warp_gemm<kMT, kNT, kK, T>(
      acc, [&](uint32_t(&a)[4], int mi, int kk) { ldmatrix_x4_trans(a, sA(kk * 16, mi * 16)); },
      [&](uint32_t(&r)[4], int np, int kk) { ldmatrix_x4_trans(r, sB(kk * 16, np * 16)); });
}

template <int kMT, int kNT>
__device__ __forceinline__ void clear(float (&acc)[kMT][kNT][4]) {
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
}

// Writes accumulators (rows r0 + mi*16 + g (+8), columns c0 + ni*8 + 2t) into a tile as T.
template <typename Tile, typename T, int kMT, int kNT>
__device__ __forceinline__ void store_acc(T* tile, const float (&acc)[kMT][kNT][4], int r0, int c0, int lane,
                                          float scale = 1.f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMT; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = r0 + mi * 16 + g + 8 * h;
        const int col = c0 + ni * 8;
        *reinterpret_cast<uint32_t*>(tile + Tile::offset(row, col) + 2 * t) =
            pack2<T>(acc[mi][ni][2 * h] * scale, acc[mi][ni][2 * h + 1] * scale);
      }
}

}  // namespace flashattn
