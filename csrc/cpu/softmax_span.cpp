// The forward's online-softmax step on a span of plain key tiles (no mask,
// score mod or dropout), fused, in AVX-512 with AVX512-BF16 (tile_ops.h:
// online_softmax_span, online_softmax_span_to_pairs).
//
// Why a version of its own: the generic step (online_softmax_step, then for
// 16-bit products pack_pairs) makes three or four passes over the span's S^T
// (keys x 128 queries, 128 KB for 256 keys: in L2), keeps the per-query max
// and sums in memory between key rows, and GCC compiles exp_approx's clamps
// into compares and blends. On an AMX Xeon core the two bfloat16 steps took
// as long as the matrix units' products (perf, one thread, b1 h16 n1024 d128:
// ~30% of the kernel's samples against brgemm's ~47%). Here 16 queries at a
// time go through all the span's keys with their max, sum and shift in
// registers, and exp is fast_exp.h's reduction written one instruction a step
// (exp16 below). The bfloat16 version writes the probabilities to the P V
// product's pairs operand only, two keys a store, rounded by vcvtne2ps2bf16
// (round to nearest even, NaN kept); the float32 version back into s_t.
//
// AVX512-BF16 for both (one target for the one loop): the CPUs this project
// measures (Sapphire Rapids-class Xeons, AMD Zen 4) have it. Elsewhere, with
// AVX2 and FMA (AVX-512 CPUs without AVX512-BF16 included), the float32
// version runs the same loop on 8 queries at a time (span_step_avx2: the
// same operations lane by lane, so the same values); the bfloat16 one keeps
// the two generic steps there (its products are not on brgemm without
// AVX512-BF16 anyway).
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

// exp(x) for the softmax's arguments x = scale s - shift <= 0 (or NaN; no
// argument here is large, the shift is the max, so there is no upper clamp).
// A NaN passes max_ps, which returns its second operand when either is NaN.
//  - float32 (kToPairs false): fast_exp.h's exp_approx_lanes, the same steps
//    and constants (the same values), 14 instructions;
//  - bfloat16 (kToPairs): its degree-5 polynomial (the probabilities are
//    rounded to bfloat16 next) and 2^n by vscalefps, 11 instructions; the
//    clamp at -105 makes the results there exactly 0 (p 2^n < 2^-150), and
//    those between -105 and -87.3, below float's normal range, are 0 once
//    rounded (vcvtne2ps2bf16 flushes denormals).
template <bool kToPairs>
FLASHATTN_AVX512_BF16 FLASHATTN_INLINE __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(kToPairs ? -105.f : kExpMinArg), x);
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(kExpLog2e), _mm512_set1_ps(kExpRound));
  const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(kExpRound));
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), r);
  if constexpr (kToPairs) {
    __m512 p = _mm512_set1_ps(kExpPoly5[5]);
    for (int k = 4; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly5[k]));
    return _mm512_scalef_ps(p, n);
  } else {
    __m512 p = _mm512_set1_ps(kExpPoly[6]);
    for (int k = 5; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[k]));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(static_cast<int>(kExpBiasBits))), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  }
}

#pragma GCC diagnostic push
// GCC 12.1 / 12.2's avx512fintrin.h trips -Wuninitialized on its own
// _mm512_undefined placeholders once inlined (GCC bug 105593), and
// -Wmaybe-uninitialized on _mm512_set_epi16's.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// s_t: keys x queries (ld), keys even, queries a multiple of 16; pairs: the
// keys x queries pairs operand (kToPairs), else P^T goes back to s_t.
template <bool kToPairs>
FLASHATTN_AVX512_BF16 void span_step(float* s_t, int64_t ld, int keys, int queries, float* row_max, float* row_sum,
                                     float* o_t, int64_t o_ld, int head_dim, float scale, c10::BFloat16* pairs) {
  const int w = kToPairs ? lowp_panel_width(queries) : 16;
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
    float* s = s_t + i0;
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
    // does; for pairs, two keys a store into row p / 2 of the panel holding
    // queries i0.
    __m512 sum = _mm512_setzero_ps();
    c10::BFloat16* out = kToPairs ? pairs + static_cast<int64_t>(i0 / w) * keys * w + (i0 % w) * 2 : nullptr;
    s = s_t + i0;
    for (int p = 0; p < keys; p += 2, s += 2 * ld) {
      const __m512 e0 = exp16<kToPairs>(_mm512_fmsub_ps(_mm512_loadu_ps(s), vscale, shift));
      const __m512 e1 = exp16<kToPairs>(_mm512_fmsub_ps(_mm512_loadu_ps(s + ld), vscale, shift));
      sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
      if constexpr (kToPairs) {
        const __m512i both = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        _mm512_storeu_si512(out, both);
        out += 2 * w;
      } else {
        _mm512_storeu_ps(s, e0);
        _mm512_storeu_ps(s + ld, e1);
      }
    }
    const __m512 alpha = exp16<kToPairs>(_mm512_sub_ps(m_old, shift));
    _mm512_storeu_ps(row_sum + i0, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + i0), alpha, sum));
    // O^T *= alpha on these queries, unless every alpha is 1 (x * 1 = x).
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) == 0) continue;
    float* o = o_t + i0;
    for (int c = 0; c < head_dim; ++c, o += o_ld) _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha));
  }
}
#pragma GCC diagnostic pop

#define FLASHATTN_AVX2_FMA __attribute__((target("avx2,fma")))

// exp16<false> on 8 lanes: the same instructions' AVX2 forms (max_ps keeps a
// NaN second operand here too).
FLASHATTN_AVX2_FMA FLASHATTN_INLINE __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(kExpMinArg), x);
  const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(kExpLog2e), _mm256_set1_ps(kExpRound));
  const __m256 n = _mm256_sub_ps(t, _mm256_set1_ps(kExpRound));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[6]);
  for (int k = 5; k >= 0; --k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[k]));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(static_cast<int>(kExpBiasBits))), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// span_step<false> on 8 queries at a time: the same chains, shift, sums in
// key order and rescale, lane by lane. queries: a multiple of 8.
FLASHATTN_AVX2_FMA void span_step_avx2(float* s_t, int64_t ld, int keys, int queries, float* row_max, float* row_sum,
                                       float* o_t, int64_t o_ld, int head_dim, float scale) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i0 = 0; i0 < queries; i0 += 8) {
    __m256 m0 = neg_inf, m1 = neg_inf, m2 = neg_inf, m3 = neg_inf;
    float* s = s_t + i0;
    for (int j = 0; j < keys; j += 4, s += 4 * ld) {  // keys is even: a multiple of 4 or 2 more
      m0 = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s), vscale), m0);
      m1 = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s + ld), vscale), m1);
      if (j + 2 == keys) break;
      m2 = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s + 2 * ld), vscale), m2);
      m3 = _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(s + 3 * ld), vscale), m3);
    }
    const __m256 m_tile = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    const __m256 m_old = _mm256_loadu_ps(row_max + i0);
    const __m256 m_new = _mm256_max_ps(m_tile, m_old);  // neither is NaN
    const __m256 shift = _mm256_blendv_ps(m_new, _mm256_setzero_ps(), _mm256_cmp_ps(m_new, neg_inf, _CMP_EQ_OQ));
    _mm256_storeu_ps(row_max + i0, m_new);
    __m256 sum = _mm256_setzero_ps();
    s = s_t + i0;
    for (int p = 0; p < keys; p += 2, s += 2 * ld) {
      const __m256 e0 = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s), vscale, shift));
      const __m256 e1 = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + ld), vscale, shift));
      sum = _mm256_add_ps(_mm256_add_ps(sum, e0), e1);
      _mm256_storeu_ps(s, e0);
      _mm256_storeu_ps(s + ld, e1);
    }
    const __m256 alpha = exp8(_mm256_sub_ps(m_old, shift));
    _mm256_storeu_ps(row_sum + i0, _mm256_fmadd_ps(_mm256_loadu_ps(row_sum + i0), alpha, sum));
    if (_mm256_movemask_ps(_mm256_cmp_ps(alpha, _mm256_set1_ps(1.f), _CMP_NEQ_UQ)) == 0) continue;
    float* o = o_t + i0;
    for (int c = 0; c < head_dim; ++c, o += o_ld) _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), alpha));
  }
}

// Which fused step this CPU runs (the test knob no_fused_softmax: none).
FusedSoftmax fused_softmax_of_cpu() {
  static const FusedSoftmax isa = [] {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16"))
      return FusedSoftmax::kAvx512Bf16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return FusedSoftmax::kAvx2;
    return FusedSoftmax::kNone;
  }();
  return test_knob_value(TestKnob::kNoFusedSoftmax) == 0 ? isa : FusedSoftmax::kNone;
}

}  // namespace
#endif

FusedSoftmax fused_softmax_step() {
#if FLASHATTN_HAVE_SIMD_CLONES
  return fused_softmax_of_cpu();
#else
  return FusedSoftmax::kNone;
#endif
}

bool online_softmax_span(float* s_t, int64_t ld, int keys, int queries, float* row_max, float* row_sum, float* o_t,
                         int64_t o_ld, int head_dim, float scale) {
#if FLASHATTN_HAVE_SIMD_CLONES
  if (keys % 2 != 0) return false;
  const FusedSoftmax isa = fused_softmax_of_cpu();
  if (isa == FusedSoftmax::kAvx512Bf16 && queries % 16 == 0) {
    span_step<false>(s_t, ld, keys, queries, row_max, row_sum, o_t, o_ld, head_dim, scale, nullptr);
    return true;
  }
  if (isa != FusedSoftmax::kNone && queries % 8 == 0) {
    span_step_avx2(s_t, ld, keys, queries, row_max, row_sum, o_t, o_ld, head_dim, scale);
    return true;
  }
#endif
  return false;
}

template <>
bool online_softmax_span_to_pairs(const float* s_t, int64_t ld, int keys, int queries, float* row_max, float* row_sum,
                                  float* o_t, int64_t o_ld, int head_dim, float scale, c10::BFloat16* pairs) {
#if FLASHATTN_HAVE_SIMD_CLONES
  if (fused_softmax_of_cpu() == FusedSoftmax::kAvx512Bf16 && queries % 16 == 0 && keys % 2 == 0) {
    // s_t is only read on this path.
    span_step<true>(const_cast<float*>(s_t), ld, keys, queries, row_max, row_sum, o_t, o_ld, head_dim, scale, pairs);
    return true;
  }
#endif
  return false;
}

template <>
bool online_softmax_span_to_pairs(const float*, int64_t, int, int, float*, float*, float*, int64_t, int, float,
                                  c10::Half*) {
  return false;  // float16 keeps the two steps (its rounding has no AVX-512 instruction of two vectors)
}

}  // namespace cpu
}  // namespace flashattn
