// exp() that a compiler can vectorize. The softmax takes one exp per score,
// as many as there are multiply-adds in a 4-wide head_dim's worth of GEMM, so
// a scalar libm call per score would cost more than the matrix products.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace flashattn {
namespace cpu {

// exp(x) for float: exp(x) = 2^n exp(r) with n = round(x log2(e)) and
// |r| <= ln(2)/2, exp(r) by the Cephes expf polynomial (about 1 ulp). Plain
// arithmetic and bit casts only, so loops calling it vectorize.
// Arguments below -87.3 (-inf included) give exactly 0, the value a masked or
// vanishing probability must have; the results they would otherwise produce
// (< 1.2e-38) cannot change a softmax sum that includes exp(0) = 1.
inline float exp_approx(float x) {
  constexpr float kMinArg = -87.3f, kMaxArg = 88.3f;
  const float xc = x < kMinArg ? kMinArg : (x > kMaxArg ? kMaxArg : x);
  // Round to nearest by adding and subtracting 1.5 * 2^23.
  const float n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;
  // r = x - n ln2, with ln2 split in two so that n * ln2_hi is exact.
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float two_to_n;
  std::memcpy(&two_to_n, &bits, sizeof(float));
  const float y = p * two_to_n;
  return x < kMinArg ? 0.f : y;
}

// double: libm. The float64 path is for accuracy, not speed.
inline double exp_approx(double x) { return std::exp(x); }

}  // namespace cpu
}  // namespace flashattn
