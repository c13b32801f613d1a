// The bfloat16 forward's softmax step on a span of plain key tiles, fused with
// the rounding of P^T into the pairs operands of the P V products
// (online_softmax_to_pairs, tile_ops.h), in AVX-512 with AVX512-BF16.
//
// Why a version of its own: on the machines whose bfloat16 products run on
// brgemm (AMX, AVX512-BF16), the two steps it replaces, online_softmax_step
// and pack_pairs, took as long as the products themselves (perf, one thread,
// b1 h16 n1024 d128: ~30% of the kernel's samples against brgemm's ~47%).
// They make three passes over the span's S^T (keys x 128 queries, 128 KB for
// 256 keys, in L2), keep the per-query max and sums in memory between key
// rows, and GCC compiles exp_approx's clamps into compares and blends. Here
// 16 queries at a time go through all the span's keys with their max, sum and
// shift in registers; the probabilities never return to s_t (they go to the
// pairs panels as bfloat16, two keys a store); exp is fast_exp.h's reduction
// in 11 instructions (exp16 below).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <limits>

#include "cpu_knobs.h"
#include "fast_exp.h"
#include "simd_clones.h"
#include "tile_gemm.h"
#include "tile_ops.h"

#if FLASHATTN_HAVE_SIMD_CLONES
#include <immintrin.h>
#endif

namespace flashattn {
namespace cpu {

#if FLASHATTN_HAVE_SIMD_CLONES
namespace {

#define FLASHATTN_AVX512_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))

// exp(x) for the softmax's arguments x = scale s - shift <= 0 (or NaN):
// fast_exp.h's reduction with its degree-5 polynomial (the probabilities are
// rounded to bfloat16 next), 11 instructions. The scaling by 2^n is vscalefps
// (no integer steps), so the only clamp is the lower one, where the result
// underflows to exactly 0 (x = -105: p 2^n < 2^-150); no argument here is
// large (the shift is the max), and a NaN passes max_ps, which returns its
// second operand when either is NaN.
FLASHATTN_AVX512_BF16 FLASHATTN_INLINE __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-105.f), x);
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(kExpLog2e), _mm512_set1_ps(kExpRound));
  const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(kExpRound));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly5[5]);
  for (int k = 4; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly5[k]));
  return _mm512_scalef_ps(p, n);
}

#pragma GCC diagnostic push
// GCC 12.1 / 12.2's avx512fintrin.h trips -Wuninitialized on its own
// _mm512_undefined placeholders once inlined (GCC bug 105593), and
// -Wmaybe-uninitialized on _mm512_set_epi16's.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
FLASHATTN_AVX512_BF16 void softmax_to_pairs_avx512(const float* s_t, int64_t ld, int keys, int tile_keys, int queries,
                                                   float* row_max, float* row_sum, float* o_t, int64_t o_ld,
                                                   int head_dim, float scale, c10::BFloat16* pairs) {
  const int w = lowp_panel_width(queries);
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // cvtne2ps_pbh(b, a) holds a's 16 values in lanes 0-15 and b's in 16-31;
  // a pairs row wants a0 b0 a1 b1 ...
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int i0 = 0; i0 < queries; i0 += 16) {
    // The span's max of the scaled scores, four chains. max_ps(x, m) keeps m
    // for a NaN x, as std::max(m, x) does in online_softmax_step: a NaN score
    // does not move the max (its P below is NaN all the same).
    __m512 m0 = neg_inf, m1 = neg_inf, m2 = neg_inf, m3 = neg_inf;
    const float* s = s_t + i0;
    for (int j = 0; j < keys; j += 4, s += 4 * ld) {  // keys is even: a multiple of 4 or 2 more
      m0 = _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(s), vscale), m0);
      m1 = _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(s + ld), vscale), m1);
      if (j + 2 == keys) break;
      m2 = _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(s + 2 * ld), vscale), m2);
      m3 = _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(s + 3 * ld), vscale), m3);
    }
    const __m512 m_tile = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
    const __m512 m_old = _mm512_loadu_ps(row_max + i0);
    const __m512 m_new = _mm512_max_ps(m_tile, m_old);  // neither is NaN
    // As online_softmax_step: a query with no finite max yet shifts by 0.
    const __m512 shift = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
    _mm512_storeu_ps(row_max + i0, m_new);

    // P^T = exp(scale s - shift), summed in key order as online_softmax_step
    // does, rounded to bfloat16 (round to nearest even, NaN kept) two keys a
    // store: pairs row p / 2 of the tile's panel holding queries i0.
    __m512 sum = _mm512_setzero_ps();
    c10::BFloat16* panel = pairs + static_cast<int64_t>(i0 / w) * tile_keys * w + (i0 % w) * 2;
    s = s_t + i0;
    for (int t0 = 0; t0 < keys; t0 += tile_keys, panel += static_cast<int64_t>(tile_keys) * queries) {
      c10::BFloat16* out = panel;
      for (int p = 0; p < tile_keys; p += 2, s += 2 * ld, out += 2 * w) {
        const __m512 e0 = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s), vscale, shift));
        const __m512 e1 = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + ld), vscale, shift));
        sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
        const __m512i both = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        _mm512_storeu_si512(out, both);
      }
    }
    const __m512 alpha = exp16(_mm512_sub_ps(m_old, shift));
    _mm512_storeu_ps(row_sum + i0, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + i0), alpha, sum));
    // O^T *= alpha on these queries, unless every alpha is 1 (x * 1 = x).
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) == 0) continue;
    float* o = o_t + i0;
    for (int c = 0; c < head_dim; ++c, o += o_ld) _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
  }
}
#pragma GCC diagnostic pop

bool have_avx512_bf16() {
  static const bool have = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512bf16");
  return have;
}

}  // namespace
#endif

template <>
bool online_softmax_to_pairs(const float* s_t, int64_t ld, int keys, int tile_keys, int queries, float* row_max,
                             float* row_sum, float* o_t, int64_t o_ld, int head_dim, float scale,
                             c10::BFloat16* pairs) {
#if FLASHATTN_HAVE_SIMD_CLONES
  if (test_knob_value(TestKnob::kNoFusedSoftmax) == 0 && have_avx512_bf16() && queries % 16 == 0 &&
      tile_keys % 2 == 0 && keys % tile_keys == 0) {
    softmax_to_pairs_avx512(s_t, ld, keys, tile_keys, queries, row_max, row_sum, o_t, o_ld, head_dim, scale, pairs);
    return true;
  }
#endif
  return false;
}

template <>
bool online_softmax_to_pairs(const float*, int64_t, int, int, int, float*, float*, float*, int64_t, int, float,
                             c10::Half*) {
  return false;  // float16 keeps the two steps (its rounding has no AVX-512 instruction of two vectors)
}

}  // namespace cpu
}  // namespace flashattn
