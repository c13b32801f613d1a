// Forward pass of the CPU kernels (FlashAttention-2 style).
//
// One work item is one block of block_q queries of one (batch, q-head). It
// keeps the query block and streams the key/value tiles it can see past it.
// Tiles are key-major (row = key, column = query; see tile_ops.h), so per
// key tile of `cols` keys:
//
//   S^T = K (scale Q)^T                  cols x rows   GEMM, Q^T loaded once per item
//   m_new = max(m, colmax(S^T))
//   P^T = exp(S^T - m_new),  l = l exp(m - m_new) + colsum(P^T)
//   O^T = O^T exp(m - m_new) + V^T P^T   d x rows      GEMM, V tile loaded transposed
//
// and at the end writes O = (O^T)^T / l and lse = m + log(l). Nothing larger
// than a tile is ever stored: the per-thread scratch holds one tile of each
// operand. The one transposition per tile (V) is a d-wide tile, not a block of
// scores; K is used in place when it is float32 with a row stride >= d.
//
// Key tiles lie on a fixed grid of kBlockK keys (so the GEMM shapes repeat
// and their JIT-compiled kernels are reused; the low-precision products take
// spans of up to kWideTiles plain tiles at once); the loop visits only the tiles
// the mask leaves visible to some query of the block, and applies the element
// mask only on tiles that are not fully visible.
//
// Calls with at most kFewQueries queries (decoding) take a direct path
// instead, fwd_few_queries, which reads the k and v rows in place.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "attn_mask.h"
#include "cpu_knobs.h"
#include "dropout.h"
#include "flash_cpu.h"
#include "scalar_dispatch.h"
#include "score_mod.h"
#include "tile_gemm.h"
#include "tile_ops.h"
#include "work_queue.h"

namespace flashattn {
namespace cpu {
namespace {

// Block sizes. Timed on an AVX-512 core (2 threads; n 512..2048, d 64/128,
// causal or not, float32/bfloat16), query x key blocks from 32 to 256 were
// within ~15% of each other, 128 x 64 the fastest: bigger query blocks spread
// the V transposition and the per-block bookkeeping over more rows, and 64
// keys keep a block's tiles in L1/L2. Small problems get smaller query
// blocks so that every thread has work (query_block_size).
constexpr int kBlockK = 64;
constexpr int kMaxBlockQ = 128;
constexpr int kMinBlockQ = 32;
// The low-precision products take up to kWideTiles neighbouring full tiles
// that neither the element mask nor dropout touches (nor an attn_mask hides)
// as one span of keys: one S^T
// product over the span, one online-softmax step (one O^T rescale per span
// instead of per tile: at 64 keys a tile the softmax step took more time than
// the matrix units' products, perf on an AMX Xeon core), one P V product over
// the span (its value tiles transposed side by side, kSpanKeys apart, so that
// the product's K is the span: brgemm keeps O^T's tiles in the matrix units'
// registers over the whole span instead of loading and storing them once a
// tile). Spans stay within one group of kWideTiles tiles on the grid, which
// is where the value tiles are laid out side by side. Measured on a 2-core
// AMX Xeon, 1 thread, b1 h16 n1024 d128 bfloat16 forward: 35.9 ms at one tile
// (torch's CPU flash kernel, 256 x 512 blocks: 20.2 ms), 25.8 ms at spans of
// 256 keys (torch 22.9 ms in that run); benchmarks/cpu_perf_log.md.
constexpr int kWideTiles = 4;
constexpr int kSpanKeys = kWideTiles * kBlockK;  // the leading dimension of the 16-bit V^T tiles

// What multiplies O / l at the end: 1 / (1 - p) with dropout (0 when p = 1), else 1.
template <typename acc_t>
acc_t output_scale(const AttnFwdParams& p) {
  return p.dropout.enabled() ? static_cast<acc_t>(p.dropout.scale) : acc_t(1);
}

template <typename scalar_t>
constexpr bool kIsLowp = std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>;

// Whether a call's full tiles take the low-precision products: the dtype on
// brgemm (tile_gemm.h), and a head dim that is a whole number of AMX's
// 32-element steps (no K tail inside a product; torch's own kernel asks 64).
inline bool use_lowp_products(const AttnFwdParams& p) { return p.head_dim % 32 == 0 && lowp_gemm_enabled(p.dtype); }

// lowp: also the 16-bit tiles of the low-precision products (tile_gemm.h).
template <typename scalar_t, typename acc_t>
struct FwdScratch {
  FwdScratch(int d, int block_q_, bool lowp_)
      : block_q(block_q_),
        lowp(lowp_),
        q_t(d * block_q_),
        k(kSpanKeys * d),
        v_t(d * kSpanKeys),
        s_t(kSpanKeys * block_q_),
        o_t(d * block_q_),
        row_max(block_q_),
        row_sum(block_q_),
        row_scale(block_q_),
        softmax_work(3 * block_q_),
        probe(kBlockK),
        keep(kBlockK * block_q_),
        query_lo(kBlockK),
        query_hi(kBlockK),
        bad_keys(kBlockK),
        q_pairs(lowp_ ? d * block_q_ : 0),
        k_lowp(lowp_ ? kWideTiles * kBlockK * d : 0),
        v_t_lowp(lowp_ ? d * kSpanKeys : 0),
        p_pairs(lowp_ ? kWideTiles * kBlockK * block_q_ : 0) {}

  const int block_q;  // queries per block (kBlockK keys per tile)
  const bool lowp;
  ScratchArray<acc_t> q_t;           // d x block_q        scale * Q^T
  ScratchArray<acc_t> k;             // kSpanKeys x d      key rows, when k cannot be a GEMM operand in place
  ScratchArray<acc_t> v_t;           // d x kSpanKeys      value tiles, transposed
  ScratchArray<acc_t> s_t;           // kSpanKeys x block_q  S^T, then P^T (a tile or a span)
  ScratchArray<acc_t> o_t;           // d x block_q        unnormalized O^T
  ScratchArray<acc_t> row_max;       // block_q            m
  ScratchArray<acc_t> row_sum;       // block_q            l
  ScratchArray<acc_t> row_scale;     // block_q            1 / l at the end
  ScratchArray<acc_t> softmax_work;  // 3 x block_q
  ScratchArray<acc_t> probe;         // kBlockK            non-finite search
  ScratchArray<uint8_t> keep;        // kBlockK x block_q  dropout's keep mask of the tile
  ScratchArray<int> query_lo;        // kBlockK            queries that see each key, in block coordinates
  ScratchArray<int> query_hi;        // kBlockK
  ScratchArray<int> bad_keys;        // kBlockK            keys whose value row is not finite (masked tiles)
  // Low-precision products:
  ScratchArray<scalar_t> q_pairs;   // d x block_q        Q^T in pairs panels (unscaled)
  ScratchArray<scalar_t> k_lowp;    // kBlockK x d        key tiles of a span, when k cannot be a GEMM operand in place
  ScratchArray<scalar_t> v_t_lowp;  // d x kSpanKeys      value tiles of a span, transposed
  ScratchArray<scalar_t> p_pairs;   // kSpanKeys x block_q  P^T rounded, in pairs panels
};

// The results of one key part of a split call (see key_parts below), per
// (part, batch, head, query): the online softmax's m and l and the
// unnormalized O (d wide), in the accumulation type.
template <typename acc_t>
struct PartialOutputs {
  acc_t* o;
  acc_t* m;
  acc_t* l;
  int batch, heads, seqlen_q, d;
  int64_t row(int part, int b, int h, int64_t i) const {
    return ((static_cast<int64_t>(part) * batch + b) * heads + h) * seqlen_q + i;
  }
};

// O^T += V^T P^T for the keys `keys` of a masked tile, each over the queries
// that see it only (their value rows were taken out of the GEMM: tile_ops.h).
template <typename scalar_t, typename acc_t>
void add_keys_over_visible_queries(const int* keys, int num_keys, const scalar_t* v, int64_t v_ld, int d,
                                   const acc_t* p_t, int64_t p_ld, const int* query_lo, const int* query_hi,
                                   int queries, acc_t* o_t, int64_t o_ld) {
  for (int n = 0; n < num_keys; ++n) {
    const int j = keys[n];
    const int lo = std::min(query_lo[j], queries), hi = std::max(query_hi[j], lo);
    for (int c = 0; c < d; ++c) {
      const acc_t vc = static_cast<acc_t>(v[j * v_ld + c]);
      for (int i = lo; i < hi; ++i) o_t[c * o_ld + i] += p_t[j * p_ld + i] * vc;
    }
  }
}

// The full key and value tiles of one (batch, kv head), laid out once for
// every query block (FwdPlan): the value tiles transposed, in the input dtype
// for the low-precision products or in acc_t for the float32 path, in groups
// of kWideTiles side by side (d x kSpanKeys a group, so that a span's V^T is
// one operand); and, for the low-precision products, the key rows copied one
// after the other (ld d) where the input's rows are further apart. nullptr members
// where there are none (the input is then read, or a tile transposed, where
// it is used).
//
// Why the key copy: AMX reads an operand's rows at the operand's stride, and
// k's rows in the (batch, seqlen, heads, d) layout are heads * d elements
// apart, 4 KB for 16 heads of 128: every row of a tile falls into the same L1
// set. A microbenchmark of the span's S^T product (brgemm, one thread, 16
// heads of 1024 keys, d 128) ran 14.3 ms on the strided rows and 8.6 ms on
// contiguous ones; the copy is one pass over k.
template <typename scalar_t, typename acc_t>
struct KvTiles {
  const scalar_t* v_lowp = nullptr;
  const acc_t* v_acc = nullptr;
  const scalar_t* k = nullptr;
  int d = 0;
  // V^T's columns from key k0 on, leading dimension kSpanKeys.
  const scalar_t* v_lowp_keys(int64_t k0) const { return v_lowp ? v_lowp + group_offset(k0) : nullptr; }
  const acc_t* v_acc_keys(int64_t k0) const { return v_acc ? v_acc + group_offset(k0) : nullptr; }
  // The key rows from k0 on, leading dimension d.
  const scalar_t* k_rows(int64_t k0) const { return k ? k + k0 * d : nullptr; }
  int64_t group_offset(int64_t k0) const { return (k0 / kSpanKeys) * d * kSpanKeys + k0 % kSpanKeys; }
};

// Query block q_block of head h of sequence b (seq: its rows and lengths;
// the caller skips blocks past the sequence's end), against the keys of
// [part_begin, part_end) it can see (a multiple of kBlockK, so that the key
// tiles keep their grid); the result goes to o and lse, or, when `partial`,
// unnormalized to the part's slot there (merged by merge_key_parts).
//
// Low precision (scratch.lowp: bfloat16 / float16 on brgemm, tile_gemm.h):
// in a block of block_q queries, the full key tiles run both products on the
// 16-bit inputs with float32 accumulation, as torch's CPU flash kernel and
// FlashAttention on GPUs do: S^T = K Q^T from k in place (unscaled, the
// scale applied in the softmax step), then P^T rounded to the input dtype
// for O^T += V^T P^T. The ragged tiles and blocks take the float32 path
// below, on the same online-softmax state.
template <typename scalar_t, typename acc_t>
void fwd_query_block(const AttnFwdParams& p, const SeqInfo& seq, const AttnMask& mask, int b, int h, int64_t q_block,
                     int64_t part_begin, int64_t part_end, const PartialOutputs<acc_t>* partial, int part,
                     const KvTiles<scalar_t, acc_t>& kv_tiles, FwdScratch<scalar_t, acc_t>& scratch) {
  const int d = p.head_dim;
  const int block_q = scratch.block_q;
  const int64_t q0 = q_block * block_q;
  const int rows = static_cast<int>(std::min<int64_t>(block_q, seq.seqlen_q - q0));
  const int64_t h_kv = h / p.heads_ratio();  // GQA: q-heads share k/v heads in groups, read in place

  const scalar_t* q = static_cast<const scalar_t*>(p.q_ptr) + seq.q_offset(p.q_batch_stride, p.q_row_stride, b) +
                      q0 * p.q_row_stride + h * p.q_head_stride;
  const scalar_t* k = static_cast<const scalar_t*>(p.k_ptr) + seq.k_offset(p.k_batch_stride, p.k_row_stride, b) +
                      h_kv * p.k_head_stride;
  const scalar_t* v = static_cast<const scalar_t*>(p.v_ptr) + seq.k_offset(p.v_batch_stride, p.v_row_stride, b) +
                      h_kv * p.v_head_stride;
  scalar_t* o = static_cast<scalar_t*>(p.o_ptr) + seq.q_offset(p.o_batch_stride, p.o_row_stride, b) +
                q0 * p.o_row_stride + h * p.o_head_stride;
  acc_t* lse = static_cast<acc_t*>(p.lse_ptr) + seq.rowvec_offset(p, b, h) + q0;

  acc_t* row_max = scratch.row_max.get();
  acc_t* row_sum = scratch.row_sum.get();
  acc_t* o_t = scratch.o_t.get();
  acc_t* s_t = scratch.s_t.get();
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  std::fill(row_max, row_max + rows, kNegInf);
  std::fill(row_sum, row_sum + rows, acc_t(0));
  for (int i = 0; i < d; ++i) std::fill(o_t + i * block_q, o_t + i * block_q + rows, acc_t(0));

  const int64_t key_begin = std::max(mask.tile_key_begin(q0), part_begin);
  const int64_t key_end = std::min(mask.tile_key_end(q0 + rows), part_end);
  // softcap / ALiBi (score_mod.h): asked once per tile, the plain path untouched.
  const TileScoreMod<acc_t> mod(p.score_mod, b, h, seq.seqlen_q, seq.seqlen_k);
  const bool has_mod = mod.any();
  // Dropout: P^T's dropped entries zeroed after the softmax step (l sums
  // the undropped P, so lse is the plain softmax's), 1 / (1 - p) applied with
  // 1 / l at the end.
  const bool dropout = p.dropout.enabled();
  const uint64_t plane = dropout_plane(p.dropout.offset, b, p.heads_q, h);
  auto drop = [&](int cols, int64_t k0) {
    dropout_keep_tile(p.dropout, plane, k0, cols, q0, rows, scratch.keep.get(), block_q);
    apply_keep_tile(scratch.keep.get(), block_q, cols, rows, acc_t(1), s_t, block_q);
  };
  if (key_begin < key_end) {
    const bool lowp_block = scratch.lowp && rows == block_q;
    bool have_q_t = false;  // the float32 path's scale * Q^T, loaded on first use
    if constexpr (kIsLowp<scalar_t>) {
      if (lowp_block) pack_pairs_transposed(q, p.q_row_stride, d, block_q, scratch.q_pairs.get());
    }
    for (int64_t k0 = key_begin / kBlockK * kBlockK, step = kBlockK; k0 < key_end; k0 += step) {
      step = kBlockK;
      const int cols = static_cast<int>(std::min<int64_t>(kBlockK, seq.seqlen_k - k0));
      if (has_mod && mod.hides(cols, rows, k0, q0)) continue;     // an attn_mask hides the block outright
      const bool full_tile = rows == block_q && cols == kBlockK;  // see tile_gemm.h
      // Element mask, only where some entry of the block is hidden.
      const bool masked = mask.block_query_ranges(q0, rows, k0, cols, scratch.query_lo.get(), scratch.query_hi.get());
      const int* query_lo = masked ? scratch.query_lo.get() : nullptr;
      const int* query_hi = masked ? scratch.query_hi.get() : nullptr;

      // A full tile the element mask leaves alone takes such neighbours in
      // its group of kWideTiles into one span (with a score mod: those its
      // attn_mask does not hide, which the loop would skip; the mod is
      // applied over the span).
      int span = kBlockK;
      if (full_tile && !masked && !dropout) {
        while ((k0 + span) % kSpanKeys != 0 && k0 + span + kBlockK <= std::min<int64_t>(key_end, seq.seqlen_k) &&
               !mask.block_query_ranges(q0, rows, k0 + span, kBlockK, scratch.query_lo.get(), scratch.query_hi.get()) &&
               !(has_mod && mod.hides(kBlockK, rows, k0 + span, q0)))
          span += kBlockK;
      }
      step = span;

      if constexpr (kIsLowp<scalar_t>) {
        if (lowp_block && full_tile) {
          // S^T = K Q^T                                                    span x rows
          const scalar_t* k_tile = kv_tiles.k_rows(k0);
          int64_t k_ld = d;
          if (!k_tile) k_tile = k + k0 * p.k_row_stride, k_ld = p.k_row_stride;
          if (!(k_ld >= d && ld_admitted_in_place(k_ld))) {
            for (int j = 0; j < span; ++j)
              std::copy(k_tile + j * k_ld, k_tile + j * k_ld + d, scratch.k_lowp.get() + j * d);
            k_tile = scratch.k_lowp.get(), k_ld = d;
          }
          if (span > kBlockK) {
            gemm_nn_lowp(span, rows, d, k_tile, k_ld, scratch.q_pairs.get(), s_t, block_q, /*accumulate=*/false);
            // S^T -> P^T rounded, one pairs operand; update m and l, rescale O^T.
            acc_t scale = static_cast<acc_t>(p.softmax_scale);
            if (has_mod) mod.apply(s_t, block_q, span, rows, scale, k0, q0, nullptr), scale = acc_t(1);
            if (!online_softmax_span_to_pairs(s_t, block_q, span, rows, row_max, row_sum, o_t, block_q, d, scale,
                                              scratch.p_pairs.get())) {
              online_softmax_step(s_t, block_q, span, rows, nullptr, nullptr, row_max, row_sum, o_t, block_q, d,
                                  scratch.softmax_work.get(), scale);
              pack_pairs(s_t, block_q, span, rows, scratch.p_pairs.get());
            }
            // O^T += V^T P^T over the span                                  d x rows
            const scalar_t* v_t = kv_tiles.v_lowp_keys(k0);
            if (!v_t) {
              transpose_lowp(v + k0 * p.v_row_stride, p.v_row_stride, span, d, scratch.v_t_lowp.get(), kSpanKeys);
              v_t = scratch.v_t_lowp.get();
            }
            gemm_nn_lowp(d, rows, span, v_t, kSpanKeys, scratch.p_pairs.get(), o_t, block_q, /*accumulate=*/true);
            continue;
          }
          gemm_nn_lowp(cols, rows, d, k_tile, k_ld, scratch.q_pairs.get(), s_t, block_q, /*accumulate=*/false);
          // S^T -> P^T (scaled here, or by the score mod), update m and l, rescale O^T.
          acc_t step_scale = static_cast<acc_t>(p.softmax_scale);
          if (has_mod) mod.apply(s_t, block_q, cols, rows, step_scale, k0, q0, nullptr), step_scale = acc_t(1);
          online_softmax_step(s_t, block_q, cols, rows, query_lo, query_hi, row_max, row_sum, o_t, block_q, d,
                              scratch.softmax_work.get(), step_scale);
          if (dropout) drop(cols, k0);
          // O^T += V^T P^T                                                 d x rows
          const scalar_t* v_tile = v + k0 * p.v_row_stride;
          const int bad =
              masked ? nonfinite_rows<scalar_t, acc_t>(v_tile, p.v_row_stride, cols, d, scratch.bad_keys.get()) : 0;
          const scalar_t* v_t = bad > 0 ? nullptr : kv_tiles.v_lowp_keys(k0);
          if (!v_t) {  // transposed here (the non-finite rule zeroes the bad keys' columns)
            transpose_lowp(v_tile, p.v_row_stride, cols, d, scratch.v_t_lowp.get(), kSpanKeys);
            if (bad > 0) zero_columns(scratch.v_t_lowp.get(), kSpanKeys, d, scratch.bad_keys.get(), bad);
            v_t = scratch.v_t_lowp.get();
          }
          pack_pairs(s_t, block_q, cols, rows, scratch.p_pairs.get());
          gemm_nn_lowp(d, rows, cols, v_t, kSpanKeys, scratch.p_pairs.get(), o_t, block_q, /*accumulate=*/true);
          if (bad > 0)
            add_keys_over_visible_queries(scratch.bad_keys.get(), bad, v_tile, p.v_row_stride, d, s_t, block_q,
                                          query_lo, query_hi, rows, o_t, block_q);
          continue;
        }
      }

      // The float32 path. The softmax scale goes into Q once, so that S^T
      // comes out scaled.
      if (!have_q_t) {
        load_tile_transposed(q, p.q_row_stride, rows, d, static_cast<acc_t>(p.softmax_scale), scratch.q_t.get(),
                             block_q);
        have_q_t = true;
      }
      // S^T = K (scale Q)^T                                          span (cols) x rows
      const Operand<acc_t> k_op =
          as_operand(k + k0 * p.k_row_stride, p.k_row_stride, std::max(span, cols), d, scratch.k.get(), d);
      if (span > kBlockK) {  // the span's keys: one softmax step, one P V product (as the low-precision path's)
        gemm_nn(span, rows, d, k_op.ptr, k_op.ld, scratch.q_t.get(), block_q, s_t, block_q, /*accumulate=*/false,
                /*full_tile=*/true);
        if (has_mod) mod.apply(s_t, block_q, span, rows, acc_t(1), k0, q0, nullptr);
        bool fused = false;
        if constexpr (std::is_same_v<acc_t, float>)
          fused = online_softmax_span(s_t, block_q, span, rows, row_max, row_sum, o_t, block_q, d, 1.f);
        if (!fused)
          online_softmax_step(s_t, block_q, span, rows, nullptr, nullptr, row_max, row_sum, o_t, block_q, d,
                              scratch.softmax_work.get(), acc_t(1));
        const acc_t* v_t = kv_tiles.v_acc_keys(k0);
        if (!v_t) {
          load_tile_transposed(v + k0 * p.v_row_stride, p.v_row_stride, span, d, acc_t(1), scratch.v_t.get(),
                               kSpanKeys);
          v_t = scratch.v_t.get();
        }
        gemm_nn(d, rows, span, v_t, kSpanKeys, s_t, block_q, o_t, block_q, /*accumulate=*/true, /*full_tile=*/true);
        continue;
      }
      gemm_nn(cols, rows, d, k_op.ptr, k_op.ld, scratch.q_t.get(), block_q, s_t, block_q, /*accumulate=*/false,
              full_tile);
      // S^T -> P^T, update m and l, rescale O^T.
      if (has_mod) mod.apply(s_t, block_q, cols, rows, acc_t(1), k0, q0, nullptr);
      online_softmax_step(s_t, block_q, cols, rows, query_lo, query_hi, row_max, row_sum, o_t, block_q, d,
                          scratch.softmax_work.get(), acc_t(1));
      if (dropout) drop(cols, k0);

      // O^T += V^T P^T                                                     d x rows
      const acc_t* v_t = masked || cols < kBlockK ? nullptr : kv_tiles.v_acc_keys(k0);
      if (!v_t) {  // transposed here (masked tiles: the non-finite rule may zero columns)
        load_tile_transposed(v + k0 * p.v_row_stride, p.v_row_stride, cols, d, acc_t(1), scratch.v_t.get(), kSpanKeys);
        v_t = scratch.v_t.get();
      }
      const int bad = masked ? take_nonfinite_columns(scratch.v_t.get(), kSpanKeys, d, cols, scratch.probe.get(),
                                                      scratch.bad_keys.get())
                             : 0;
      gemm_nn(d, rows, cols, v_t, kSpanKeys, s_t, block_q, o_t, block_q, /*accumulate=*/true, full_tile);
      if (bad > 0)
        add_keys_over_visible_queries(scratch.bad_keys.get(), bad, v + k0 * p.v_row_stride, p.v_row_stride, d, s_t,
                                      block_q, query_lo, query_hi, rows, o_t, block_q);
    }
  }

  if (partial) {  // m, l and O^T as they are, for the merge
    const int64_t row0 = partial->row(part, b, h, q0);
    std::copy(row_max, row_max + rows, partial->m + row0);
    std::copy(row_sum, row_sum + rows, partial->l + row0);
    store_tile_transposed(o_t, block_q, rows, d, acc_t(1), static_cast<const acc_t*>(nullptr), partial->o + row0 * d,
                          int64_t(d));
    return;
  }
  // O = (O^T)^T / l (times 1 / (1 - p) with dropout) and lse = m + log(l); a
  // query that saw no key has l = 0: zeros and -inf.
  acc_t* inv_sum = scratch.row_scale.get();
  const acc_t kept_scale = output_scale<acc_t>(p);
  for (int r = 0; r < rows; ++r) {
    const bool empty = row_sum[r] == acc_t(0);
    inv_sum[r] = empty ? acc_t(0) : kept_scale / row_sum[r];
    lse[r] = empty ? kNegInf : row_max[r] + std::log(row_sum[r]);
  }
  store_tile_transposed(o_t, block_q, rows, d, acc_t(1), inv_sum, o, p.o_row_stride);
}

// Decode-shaped problems: up to kFewQueries query rows per (batch, head)
// are too few for GEMM tiles (their products would be padded to a vector's
// width and every value tile transposed for one query): attend_few_queries
// works row-major on the k and v rows in place, kFewBlockK keys at a time.
// The query heads of a GQA group that share a kv head are one work item, up
// to kFewRows rows (heads x queries) together, so that each k and v row is
// read (and, for 16-bit inputs, converted) once for all of them: decoding
// reads the cache once per kv head instead of once per query head (4x less
// memory traffic with 32 query heads on 8 kv heads). Each row's arithmetic is
// the same whatever it is grouped with, so the grouping (which may follow
// the thread count) never changes a result.
constexpr int kFewQueries = 8;
constexpr int kFewRows = 16;
constexpr int kFewBlockK = 256;

template <typename scalar_t, typename acc_t>
struct FewQueriesScratch {
  explicit FewQueriesScratch(int d)
      : q(kFewRows * d),
        o(kFewRows * d),
        scores(kFewRows * kFewBlockK),
        kv_row(kFewKvRows * d),
        row_max(kFewRows),
        row_sum(kFewRows),
        key_lo(kFewRows),
        key_hi(kFewRows),
        k_rows(kFewBlockK),
        v_rows(kFewBlockK),
        slope(kFewRows),
        dist0(kFewRows),
        bias_rows(kFewRows) {}

  ScratchArray<acc_t> q;       // rows x d           scale * Q
  ScratchArray<acc_t> o;       // rows x d           unnormalized O
  ScratchArray<acc_t> scores;  // rows x kFewBlockK  S, then P
  ScratchArray<acc_t> kv_row;  // kFewKvRows x d     k or v rows in acc_t
  ScratchArray<acc_t> row_max, row_sum;
  ScratchArray<int> key_lo, key_hi;
  ScratchArray<const scalar_t*> k_rows, v_rows;  // kFewBlockK: the block's key and value rows
  ScratchArray<acc_t> slope;                     // per row: ALiBi's slope (FewQueriesMods)
  ScratchArray<int64_t> dist0;                   // per row: ALiBi's distance at the block's key 0
  ScratchArray<const void*> bias_rows;           // per row: the attn_mask's row at the block's key 0
};

// Where key j of (batch b, kv head h_kv) of a few-queries call is, for k (or
// v: the same rule with its own pointer and strides): j rows past the
// sequence's first key, or, for a paged cache (p.kv.paged(): a KV-cache
// row's call, fwd_kvcache_cpu), row j + leftpad of the row's page table, read
// in place (KvCacheView::page_offset) instead of gathered first.
template <typename scalar_t>
struct KeyRows {
  const scalar_t* first;  // key 0 (not paged) or the cache at kv head h_kv (paged)
  int64_t batch_stride, row_stride;
  const int32_t* table_row = nullptr;  // paged: the row's page table
  int first_pos = 0;                   // paged: key 0's position in it
  const KvCacheView& kv;

  KeyRows(const void* ptr, int64_t batch_stride_, int64_t row_stride_, int64_t head_stride, int64_t h_kv,
          const AttnFwdParams& p, const SeqInfo& seq, int b)
      : first(static_cast<const scalar_t*>(ptr) + h_kv * head_stride),
        batch_stride(batch_stride_),
        row_stride(row_stride_),
        kv(p.kv) {
    if (kv.paged()) {
      table_row = kv.block_table + b * kv.table_batch_stride;
      first_pos = kv.leftpad ? kv.leftpad[b] : 0;
    } else {
      first += seq.k_offset(batch_stride, row_stride, b);
    }
  }
  bool paged() const { return table_row != nullptr; }
  const scalar_t* row(int64_t j) const {
    if (!table_row) return first + j * row_stride;
    return first + kv.page_offset(table_row, static_cast<int>(first_pos + j), batch_stride, row_stride);
  }
};

// The few-queries path (attend_few_queries) applies the score mods (softcap,
// ALiBi, torch SDPA's attn_mask: FewQueriesMods) to its rows of scores; calls
// with dropout take the tiled path (key split included), which holds it.
bool runs_few_queries(const AttnFwdParams& p) { return p.seqlen_q <= kFewQueries && !p.dropout.enabled(); }

// Query heads [h0, h0 + heads) of batch entry b, all of kv head h0 / ratio:
// row r of the item is query r % seqlen_q of head h0 + r / seqlen_q.
// Keys [part_begin, part_end) only, the result to `partial` as in
// fwd_query_block when it is given.
template <typename scalar_t, typename acc_t>
void fwd_few_queries(const AttnFwdParams& p, const SeqInfo& seq, const AttnMask& mask, int b, int h0, int heads,
                     int64_t part_begin, int64_t part_end, const PartialOutputs<acc_t>* partial, int part,
                     FewQueriesScratch<scalar_t, acc_t>& scratch) {
  const int d = p.head_dim;
  const int seqlen_q = seq.seqlen_q;
  const int rows = heads * seqlen_q;
  const int64_t h_kv = h0 / p.heads_ratio();
  const scalar_t* q0 = static_cast<const scalar_t*>(p.q_ptr) + seq.q_offset(p.q_batch_stride, p.q_row_stride, b);
  const KeyRows<scalar_t> k(p.k_ptr, p.k_batch_stride, p.k_row_stride, p.k_head_stride, h_kv, p, seq, b);
  const KeyRows<scalar_t> v(p.v_ptr, p.v_batch_stride, p.v_row_stride, p.v_head_stride, h_kv, p, seq, b);
  const scalar_t** k_rows = scratch.k_rows.get();
  const scalar_t** v_rows = scratch.v_rows.get();
  scalar_t* o0 = static_cast<scalar_t*>(p.o_ptr) + seq.q_offset(p.o_batch_stride, p.o_row_stride, b);
  // Row r's query, head and place in q / out / lse.
  auto query_of = [&](int r) { return r % seqlen_q; };
  auto head_of = [&](int r) { return h0 + r / seqlen_q; };

  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  acc_t* row_max = scratch.row_max.get();
  acc_t* row_sum = scratch.row_sum.get();
  acc_t* o_acc = scratch.o.get();
  std::fill(row_max, row_max + rows, kNegInf);
  std::fill(row_sum, row_sum + rows, acc_t(0));
  std::fill(o_acc, o_acc + rows * d, acc_t(0));
  const acc_t scale = static_cast<acc_t>(p.softmax_scale);
  for (int r = 0; r < rows; ++r) {
    const scalar_t* q_row = q0 + query_of(r) * p.q_row_stride + head_of(r) * p.q_head_stride;
    for (int c = 0; c < d; ++c) scratch.q.get()[r * d + c] = scale * static_cast<acc_t>(q_row[c]);
  }

  // The score mods, per row: its head's ALiBi slope, its (query, head)'s
  // attn_mask row (moved to each block's first key below).
  const ScoreMod& sm = p.score_mod;
  FewQueriesMods<acc_t> mods;
  if (sm.has_softcap()) mods.softcap = static_cast<acc_t>(sm.softcap);
  if (sm.has_alibi()) {
    for (int r = 0; r < rows; ++r) scratch.slope.get()[r] = static_cast<acc_t>(sm.slope(b, head_of(r)));
    mods.slope = scratch.slope.get();
    mods.dist0 = scratch.dist0.get();
  }
  const int64_t bias_elem = bias_element_bytes(sm.bias.kind);
  if (sm.has_bias()) {
    mods.bias_rows = scratch.bias_rows.get();
    mods.bias_kind = sm.bias.kind;
    mods.bias_col_stride = sm.bias.col_stride;
  }
  const int64_t diag = static_cast<int64_t>(seq.seqlen_k) - seq.seqlen_q;  // ALiBi: query i sits at key i + diag

  // Every head of the item has the same queries, so the key range is theirs.
  const int64_t key_begin = std::max(mask.tile_key_begin(0), part_begin);
  const int64_t key_end = std::min(mask.tile_key_end(seqlen_q), part_end);
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kFewBlockK) {
    const int cols = static_cast<int>(std::min<int64_t>(kFewBlockK, key_end - k0));
    const int* key_lo = nullptr;
    const int* key_hi = nullptr;
    if (!mask.block_fully_visible(0, seqlen_q, k0, k0 + cols)) {
      for (int r = 0; r < rows; ++r) {
        const int i = query_of(r);
        scratch.key_lo.get()[r] = static_cast<int>(std::clamp<int64_t>(mask.key_begin(i) - k0, 0, cols));
        scratch.key_hi.get()[r] = static_cast<int>(std::clamp<int64_t>(mask.key_end(i) - k0, 0, cols));
      }
      key_lo = scratch.key_lo.get();
      key_hi = scratch.key_hi.get();
    }
    if (k.paged())  // (else the rows are one stride apart)
      for (int j = 0; j < cols; ++j) k_rows[j] = k.row(k0 + j), v_rows[j] = v.row(k0 + j);
    if (mods.slope)
      for (int r = 0; r < rows; ++r) scratch.dist0.get()[r] = query_of(r) + diag - k0;
    if (mods.bias_rows)
      for (int r = 0; r < rows; ++r)
        scratch.bias_rows.get()[r] = static_cast<const char*>(sm.bias.plane(b, head_of(r))) +
                                     (query_of(r) * sm.bias.row_stride + k0 * sm.bias.col_stride) * bias_elem;
    const bool any_mod = mods.softcap > 0 || mods.slope || mods.bias_rows;
    attend_few_queries(scratch.q.get(), rows, d, k.row(k0), p.k_row_stride, v.row(k0), p.v_row_stride,
                       k.paged() ? k_rows : nullptr, k.paged() ? v_rows : nullptr, cols, key_lo, key_hi, row_max,
                       row_sum, o_acc, scratch.scores.get(), scratch.kv_row.get(), any_mod ? &mods : nullptr);
  }

  if (partial) {
    for (int r = 0; r < rows; ++r) {
      const int64_t row = partial->row(part, b, head_of(r), query_of(r));
      partial->m[row] = row_max[r];
      partial->l[row] = row_sum[r];
      std::copy(o_acc + r * d, o_acc + (r + 1) * d, partial->o + row * d);
    }
    return;
  }
  for (int r = 0; r < rows; ++r) {
    const int i = query_of(r), h = head_of(r);
    const bool empty = row_sum[r] == acc_t(0);
    const acc_t inv_sum = empty ? acc_t(0) : acc_t(1) / row_sum[r];
    static_cast<acc_t*>(p.lse_ptr)[seq.rowvec_offset(p, b, h) + i] =
        empty ? kNegInf : row_max[r] + std::log(row_sum[r]);
    store_tile(o_acc + r * d, d, 1, d, inv_sum, o0 + i * p.o_row_stride + h * p.o_head_stride, p.o_row_stride);
  }
}

// ---------------------------------------------------------------------------
// The work of a call, as items for the threads.
//
// Flash-decoding. A decoding call has few (batch, kv head) groups, 8 for one
// sequence of a model with 8 kv heads, and would leave most of a server's
// cores idle; a short query block against a long cache likewise. Such calls
// split each row's keys into parts, one item each: a part runs the same
// online softmax over its keys and leaves its m, l and unnormalized O in a
// float32 (float64) buffer, and the item that finishes a unit's last part
// combines them in a fixed order (merge_key_parts; no second parallel loop,
// whose start and end would cost more than the merge on a busy machine).
// The number of parts depends on the shapes only, never on the thread count,
// so that the results stay bitwise identical across thread counts: enough
// items for kWantedItems workers, parts of at least kMinPartKeys keys
// (shorter ones would cost more in setup and merge than they spread).
constexpr int64_t kWantedItems = 128;
constexpr int64_t kMinPartKeys = 256;

struct KeyParts {
  int parts = 1;
  int64_t part_len = std::numeric_limits<int64_t>::max();  // keys per part, a multiple of the granule
  int64_t begin(int part) const { return parts == 1 ? 0 : part * part_len; }
  int64_t end(int part) const { return parts == 1 ? part_len : (part + 1) * part_len; }
};

// units: the items of the call(s) without a split; granule: the part
// boundaries' alignment (the tiled path's key tile grid).
inline KeyParts key_parts(int64_t units, int64_t seqlen_k, int64_t granule) {
  KeyParts kp;
  if (units >= kWantedItems || seqlen_k < 2 * kMinPartKeys) return kp;
  const int64_t parts = std::min(ceil_div(kWantedItems, units), seqlen_k / kMinPartKeys);
  if (parts <= 1) return kp;
  kp.part_len = ceil_div(ceil_div(seqlen_k, parts), granule) * granule;
  kp.parts = static_cast<int>(ceil_div(seqlen_k, kp.part_len));
  return kp;
}

// How one call is cut into items: the path, its query blocks or GQA head
// groups, its key parts, and the parts' buffers.
template <typename scalar_t, typename acc_t>
struct FwdPlan {
  const AttnFwdParams* p = nullptr;
  bool few = false;           // the few-queries path (seqlen_q <= kFewQueries)
  int heads = 1, chunks = 1;  // few: query heads an item takes, items per (batch, kv head)
  int block_q = 0;            // tiled path: queries per block
  bool lowp = false;          //   its full tiles on the low-precision products
  int64_t q_blocks = 0;       //   blocks per (batch, head)
  int64_t units = 0;          // items of one key part
  KeyParts split;
  ScratchArray<acc_t> part_o, part_m, part_l;  // split.parts > 1: (parts, batch, heads_q, seqlen_q[, d])
  PartialOutputs<acc_t> partial{};
  std::unique_ptr<std::atomic<int>[]> parts_done;  // per unit, the parts finished
  // Several query blocks a head (a dense batch): the full tiles laid out
  // once for all of them (KvTiles): the value tiles transposed in the input
  // dtype (lowp) or acc_t, (batch, heads_kv, groups, d x kSpanKeys); the key
  // rows where k's rows are not contiguous, (batch, heads_kv, kv_tiles *
  // kBlockK, d).
  ScratchArray<scalar_t> v_t_lowp, k_rows;
  ScratchArray<acc_t> v_t_acc;
  int64_t kv_tiles = 0;
  int64_t keys_offset(int b, int64_t h_kv) const {  // k_rows
    return (static_cast<int64_t>(b) * p->heads_kv + h_kv) * kv_tiles * p->head_dim * kBlockK;
  }
  int64_t groups_offset(int b, int64_t h_kv) const {  // v_t_lowp, v_t_acc
    return (static_cast<int64_t>(b) * p->heads_kv + h_kv) * ceil_div(kv_tiles, kWideTiles) * p->head_dim * kSpanKeys;
  }
  KvTiles<scalar_t, acc_t> kv_tiles_of(int b, int64_t h_kv) const {
    KvTiles<scalar_t, acc_t> t;
    t.d = p->head_dim;
    if (kv_tiles == 0) return t;
    if (lowp)
      t.v_lowp = v_t_lowp.get() + groups_offset(b, h_kv);
    else
      t.v_acc = v_t_acc.get() + groups_offset(b, h_kv);
    if (k_rows.get()) t.k = k_rows.get() + keys_offset(b, h_kv);
    return t;
  }

  int64_t items() const { return units * split.parts; }
};

template <typename scalar_t, typename acc_t>
void plan_calls(const AttnFwdParams* calls, int64_t num_calls, std::vector<FwdPlan<scalar_t, acc_t>>& plans) {
  plans.resize(num_calls);
  // Items without a split, over every call: the calls run as one loop.
  int64_t base_units = 0;
  for (int64_t c = 0; c < num_calls; ++c) {
    const AttnFwdParams& p = calls[c];
    FwdPlan<scalar_t, acc_t>& plan = plans[c];
    plan.p = &p;
    plan.few = runs_few_queries(p);
    TORCH_INTERNAL_ASSERT(plan.few || !p.kv.paged(), "flashattn_ext: a paged cache reaches the tiled CPU forward");
    if (plan.few) {
      plan.units = static_cast<int64_t>(p.batch) * p.heads_kv;
    } else {
      const int64_t batch_heads = static_cast<int64_t>(p.batch) * p.heads_q;
      plan.block_q = query_block_size(batch_heads, p.seqlen_q, kMaxBlockQ, kMinBlockQ);
      plan.lowp = use_lowp_products(p);
      plan.q_blocks = ceil_div(p.seqlen_q, plan.block_q);
      plan.units = batch_heads * plan.q_blocks;
    }
    base_units += plan.units;
  }
  // Key parts: decoding, and short query blocks against long key ranges.
  const bool may_split = test_knob_value(TestKnob::kNoKeySplit) == 0;
  int64_t few_groups = 0;  // (batch, kv head, part) of the few-queries calls
  for (auto& plan : plans) {
    const AttnFwdParams& p = *plan.p;
    if (!may_split) {
      few_groups += plan.few ? plan.units : 0;
    } else if (plan.few) {
      plan.split = key_parts(base_units, p.seqlen_k, kFewBlockK);
      few_groups += plan.units * plan.split.parts;
    } else if (p.seqlen_k >= 4 * static_cast<int64_t>(p.seqlen_q)) {
      plan.split = key_parts(base_units, p.seqlen_k, kBlockK);
    }
  }
  // Query heads a few-queries item takes: as many of a GQA group as kFewRows
  // rows hold, fewer while that would leave some of the threads without an
  // item. (Each row's arithmetic is the same whatever it is grouped with:
  // this may follow the thread count.)
  for (auto& plan : plans) {
    const AttnFwdParams& p = *plan.p;
    if (!plan.few) continue;
    const int ratio = p.heads_ratio();
    int heads = std::max(1, std::min(ratio, kFewRows / std::max(1, p.seqlen_q)));
    while (heads > 1 && few_groups * ceil_div(ratio, heads) < 2 * at::get_num_threads()) heads = (heads + 1) / 2;
    plan.heads = heads;
    plan.chunks = static_cast<int>(ceil_div(ratio, heads));
    plan.units *= plan.chunks;
  }
  for (auto& plan : plans) {
    if (plan.split.parts == 1) continue;
    const AttnFwdParams& p = *plan.p;
    const int64_t rows = static_cast<int64_t>(plan.split.parts) * p.batch * p.heads_q * p.seqlen_q;
    plan.part_o = ScratchArray<acc_t>(rows * p.head_dim);
    plan.part_m = ScratchArray<acc_t>(rows);
    plan.part_l = ScratchArray<acc_t>(rows);
    plan.partial = {plan.part_o.get(), plan.part_m.get(), plan.part_l.get(), p.batch,
                    p.heads_q,         p.seqlen_q,        p.head_dim};
    plan.parts_done.reset(new std::atomic<int>[plan.units]());
  }
  for (auto& plan : plans) {
    const AttnFwdParams& p = *plan.p;
    if (plan.few || plan.q_blocks < 2 || p.seqlen_k < kBlockK || p.is_varlen()) continue;
    plan.kv_tiles = p.seqlen_k / kBlockK;
    if (plan.lowp)
      plan.v_t_lowp = ScratchArray<scalar_t>(plan.groups_offset(p.batch, 0));
    else
      plan.v_t_acc = ScratchArray<acc_t>(plan.groups_offset(p.batch, 0));
    if (plan.lowp && p.k_row_stride != p.head_dim) plan.k_rows = ScratchArray<scalar_t>(plan.keys_offset(p.batch, 0));
  }
}

// The tiles of plan's KvTiles: item = (batch, kv head, tile), each value
// tile transposed as the tile loop would (the same function: the same bits),
// each key tile's rows copied.
template <typename scalar_t, typename acc_t>
void lay_out_kv_tiles(FwdPlan<scalar_t, acc_t>& plan, int64_t item) {
  const AttnFwdParams& p = *plan.p;
  const int d = p.head_dim;
  const int64_t tile = item % plan.kv_tiles, bh = item / plan.kv_tiles;
  const int b = static_cast<int>(bh / p.heads_kv);
  const int64_t h_kv = bh % p.heads_kv;
  const scalar_t* v = static_cast<const scalar_t*>(p.v_ptr) + b * p.v_batch_stride + h_kv * p.v_head_stride +
                      tile * kBlockK * p.v_row_stride;
  const int64_t v_offset =
      plan.groups_offset(b, h_kv) + (tile / kWideTiles) * d * kSpanKeys + (tile % kWideTiles) * kBlockK;
  bool done = false;
  if constexpr (kIsLowp<scalar_t>) {
    if (plan.lowp)
      transpose_lowp(v, p.v_row_stride, kBlockK, d, plan.v_t_lowp.get() + v_offset, kSpanKeys), done = true;
  }
  if (!done) load_tile_transposed(v, p.v_row_stride, kBlockK, d, acc_t(1), plan.v_t_acc.get() + v_offset, kSpanKeys);
  if (plan.k_rows.get()) {
    const scalar_t* k = static_cast<const scalar_t*>(p.k_ptr) + b * p.k_batch_stride + h_kv * p.k_head_stride +
                        tile * kBlockK * p.k_row_stride;
    scalar_t* dst = plan.k_rows.get() + plan.keys_offset(b, h_kv) + tile * kBlockK * d;
    for (int j = 0; j < kBlockK; ++j) std::copy(k + j * p.k_row_stride, k + j * p.k_row_stride + d, dst + j * d);
  }
}

// Per-worker scratch of either path, made on first use.
template <typename scalar_t, typename acc_t>
struct FwdWorker {
  std::optional<FwdScratch<scalar_t, acc_t>> tiled;
  std::optional<FewQueriesScratch<scalar_t, acc_t>> few;
  int tiled_d = 0, few_d = 0;
  ScratchArray<acc_t> merge_row;  // d: one row of O in the merge
  int merge_d = 0;

  acc_t* merge_row_for(int d) {
    if (merge_d < d) merge_row = ScratchArray<acc_t>(d), merge_d = d;
    return merge_row.get();
  }

  bool used_lowp = false;  // ran low-precision products: release them at the end

  FwdScratch<scalar_t, acc_t>& tiled_for(int d, int block_q, bool lowp) {
    if (!tiled || tiled_d != d || tiled->block_q != block_q || tiled->lowp != lowp)
      tiled.emplace(d, block_q, lowp), tiled_d = d;
    used_lowp = used_lowp || lowp;
    return *tiled;
  }
  FewQueriesScratch<scalar_t, acc_t>& few_for(int d) {
    if (!few || few_d != d) few.emplace(d), few_d = d;
    return *few;
  }
};

// O and lse of the query rows [i0, i1) of (batch b, head h) from the key
// parts, in the order of the parts: M = max m_p, L = sum exp(m_p - M) l_p, O = sum
// exp(m_p - M) O_p / L, lse = M + log(L). Parts that saw no key have m = -inf
// and l = O = 0 and drop out; a row that saw none at all gets zeros and
// -inf, as the unsplit kernels give it. The shift is 0 when M = -inf, as in
// online_softmax_step, so that a NaN score (l = NaN with m = -inf) still
// reaches the output.
template <typename scalar_t, typename acc_t>
void merge_key_parts(const FwdPlan<scalar_t, acc_t>& plan, int b, int h, int64_t i0, int64_t i1, acc_t* o_acc) {
  const AttnFwdParams& p = *plan.p;
  const SeqInfo seq(p, b);
  const int d = p.head_dim;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const PartialOutputs<acc_t>& part = plan.partial;
  scalar_t* o =
      static_cast<scalar_t*>(p.o_ptr) + seq.q_offset(p.o_batch_stride, p.o_row_stride, b) + h * p.o_head_stride;
  acc_t* lse = static_cast<acc_t*>(p.lse_ptr) + seq.rowvec_offset(p, b, h);
  for (int64_t i = i0; i < i1; ++i) {
    acc_t m_max = kNegInf;
    for (int pt = 0; pt < plan.split.parts; ++pt) m_max = std::max(m_max, part.m[part.row(pt, b, h, i)]);
    const acc_t shift = m_max == kNegInf ? acc_t(0) : m_max;
    acc_t sum = 0;
    std::fill(o_acc, o_acc + d, acc_t(0));
    for (int pt = 0; pt < plan.split.parts; ++pt) {
      const int64_t row = part.row(pt, b, h, i);
      const acc_t f = std::exp(part.m[row] - shift);
      sum += f * part.l[row];
      const acc_t* o_p = part.o + row * d;
      for (int c = 0; c < d; ++c) o_acc[c] += f * o_p[c];
    }
    const bool empty = sum == acc_t(0);
    lse[i] = empty ? kNegInf : m_max + std::log(sum);
    store_tile(o_acc, d, 1, d, empty ? acc_t(0) : output_scale<acc_t>(p) / sum, o + i * p.o_row_stride, p.o_row_stride);
  }
}

// Whether the part just finished was the unit's last (its item merges the
// parts then). acq_rel: the other parts' results are visible to the merge.
template <typename scalar_t, typename acc_t>
bool last_part_of(const FwdPlan<scalar_t, acc_t>& plan, int64_t unit) {
  return plan.parts_done[unit].fetch_add(1, std::memory_order_acq_rel) + 1 == plan.split.parts;
}

// Item `item` of a plan. Items run over (unit, key part), the parts of a
// unit next to each other; a unit is (batch, kv head, head chunk) on the
// few-queries path and (batch, head, query block) on the tiled path, over
// seqlen_q: in a varlen batch the longest sequence's, and the items past a
// shorter sequence's end do nothing.
template <typename scalar_t, typename acc_t>
void run_item(const FwdPlan<scalar_t, acc_t>& plan, int64_t item, FwdWorker<scalar_t, acc_t>& worker) {
  const AttnFwdParams& p = *plan.p;
  const int part = static_cast<int>(item % plan.split.parts);
  const int64_t unit = item / plan.split.parts;
  const PartialOutputs<acc_t>* partial = plan.split.parts > 1 ? &plan.partial : nullptr;
  if (plan.few) {
    const int ratio = p.heads_ratio();
    const int64_t group = unit / plan.chunks;  // (batch, kv head)
    const int b = static_cast<int>(group / p.heads_kv);
    const int h0 = static_cast<int>(group % p.heads_kv) * ratio + static_cast<int>(unit % plan.chunks) * plan.heads;
    const int heads = std::min(plan.heads, (h0 / ratio + 1) * ratio - h0);
    const SeqInfo seq(p, b);
    if (seq.seqlen_q == 0) return;
    fwd_few_queries<scalar_t, acc_t>(p, seq, AttnMask(p.mask, seq), b, h0, heads, plan.split.begin(part),
                                     plan.split.end(part), partial, part, worker.few_for(p.head_dim));
    if (partial && last_part_of(plan, unit))
      for (int h = h0; h < h0 + heads; ++h)
        merge_key_parts<scalar_t>(plan, b, h, 0, seq.seqlen_q, worker.merge_row_for(p.head_dim));
    return;
  }
  // Last query block first: under a causal mask it is the most expensive,
  // and the dynamic schedule balances best when big items go first.
  const int64_t q_block = plan.q_blocks - 1 - unit % plan.q_blocks;
  const int64_t bh = unit / plan.q_blocks;
  const int b = static_cast<int>(bh / p.heads_q);
  const SeqInfo seq(p, b);
  if (q_block * plan.block_q >= seq.seqlen_q) return;
  const int h = static_cast<int>(bh % p.heads_q);
  fwd_query_block<scalar_t, acc_t>(p, seq, AttnMask(p.mask, seq), b, h, q_block, plan.split.begin(part),
                                   plan.split.end(part), partial, part, plan.kv_tiles_of(b, h / p.heads_ratio()),
                                   worker.tiled_for(p.head_dim, plan.block_q, plan.lowp));
  if (partial && last_part_of(plan, unit)) {
    const int64_t q0 = q_block * plan.block_q;
    merge_key_parts<scalar_t>(plan, b, h, q0, std::min<int64_t>(q0 + plan.block_q, seq.seqlen_q),
                              worker.merge_row_for(p.head_dim));
  }
}

// The calls run as one parallel loop, their items one after the other.
template <typename scalar_t>
void fwd(const AttnFwdParams* calls, int64_t num_calls) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  std::vector<FwdPlan<scalar_t, acc_t>> plans;
  plan_calls(calls, num_calls, plans);
  std::vector<int64_t> first_tile(num_calls + 1, 0);  // plans[c]'s key / value tiles to lay out first
  for (int64_t c = 0; c < num_calls; ++c)
    first_tile[c + 1] =
        first_tile[c] + (plans[c].kv_tiles ? int64_t(calls[c].batch) * calls[c].heads_kv * plans[c].kv_tiles : 0);
  if (first_tile.back() > 0) {
    for_each_item_in_parallel(
        first_tile.back(), [] { return 0; },
        [&](int64_t item, int&) {
          const int64_t c = std::upper_bound(first_tile.begin(), first_tile.end(), item) - first_tile.begin() - 1;
          lay_out_kv_tiles(plans[c], item - first_tile[c]);
        });
  }
  std::vector<int64_t> first_item(num_calls + 1, 0);  // plans[c]'s items: [first_item[c], first_item[c + 1])
  for (int64_t c = 0; c < num_calls; ++c) first_item[c + 1] = first_item[c] + plans[c].items();
  for_each_item_in_parallel(
      first_item.back(), [] { return FwdWorker<scalar_t, acc_t>(); },
      [&](int64_t item, FwdWorker<scalar_t, acc_t>& worker) {
        const int64_t c = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
        run_item<scalar_t, acc_t>(plans[c], item - first_item[c], worker);
      },
      [](FwdWorker<scalar_t, acc_t>& worker) {
        if (worker.used_lowp) lowp_gemm_release();
      });
}

}  // namespace
}  // namespace cpu

bool fwd_cpu_runs_few_queries(const AttnFwdParams& p) { return cpu::runs_few_queries(p); }

void run_fwd_cpu(const AttnFwdParams& params) { run_fwd_cpu(&params, 1); }

void run_fwd_cpu(const AttnFwdParams* calls, int64_t num_calls) {
  if (num_calls <= 0) return;
  cpu::with_scalar_type(calls[0].dtype, "forward", [&](auto elem) { cpu::fwd<decltype(elem)>(calls, num_calls); });
}

}  // namespace flashattn
