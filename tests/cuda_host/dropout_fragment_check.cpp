// Host check of the CUDA kernels' dropout on their fragments
// (csrc/cuda/dropout.cuh, dropout_keep_bits.cuh): every element that
// apply_dropout_rows / apply_dropout_cols keep or drop, and every bit of the
// backward kernels' KeepBitsCols (the one-m-tile form's lane pairs with their
// shuffle stood in for) and of the dropout-only forward's KeepBitsRows, must be philox.h's decision (dropout_keep) for
// its (b, h, query, key), over all lanes, key offsets at 32-key groups (and the
// 16-key half group of a single m-tile), seeds, planes whose counter carries
// into the high half, and rng_state read through the device pointer or from
// the params. The __device__ code compiled as plain C++ (the shims below):
// built by tests/test_dropout.py with the host compiler; prints "N elements, M
// mismatches" and exits non-zero on a mismatch.
#define __device__
#define __forceinline__ inline
#define __ldg(p) (*(p))

#include <cstdint>
#include <cstdio>
#include <initializer_list>

#include "../../csrc/cuda/dropout_keep_bits.cuh"

using namespace flashattn;

namespace {

long n = 0, bad = 0;

void expect(bool kept, float x, float scale, const char* what, int lane, int row, int col) {
  ++n;
  const float want = kept ? scale : 0.f;  // fragments start at 1: kept -> 1 * scale, dropped -> 0
  if (x != want && ++bad <= 5) std::printf("mismatch (%s): lane %d row %d col %d\n", what, lane, row, col);
}

}  // namespace

int main() {
  const uint64_t seeds[] = {1, 0xFFFFFFFFFFFFFFFFull, 0x123456789ABCDEFull};
  const uint64_t offsets[] = {0, 0xFFFFFFFFull - 5, 1ull << 40};
  const double ps[] = {0.1, 0.5, 1.0 / 3};
  for (uint64_t seed : seeds)
    for (uint64_t offset : offsets)
      for (double p : ps)
        for (int via_pointer = 0; via_pointer < 2; ++via_pointer) {
          DropoutParams d;
          d.p = p;
          d.keep_threshold = dropout_keep_threshold(p);
          const int64_t state[2] = {static_cast<int64_t>(seed), static_cast<int64_t>(offset)};
          if (via_pointer) {
            d.rng_state = state;  // what the CUDA binding sets (the params' seed / offset then unused)
          } else {
            d.seed = seed, d.offset = offset;
          }
          DropoutParams host = d;  // dropout_keep reads seed / offset
          host.seed = seed, host.offset = offset;
          const int heads = 3;
          for (int b : {0, 2})
            for (int h : {0, 2}) {
              const DropoutPlane plane(d, b, heads, h);
              // The one-m-tile KeepBitsCols (the Hopper backward's warps): each lane's draw
              // (cols_pair_draw), the partner's halves handed over as the shuffle does
              // (lane ^ 4), then its bits (cols_pair_bits).
              for (int r0 : {0, 16, 1000})
                for (int key0 : {0, 16, 48, 4096}) {
                  constexpr int kNT = 8;
                  ColsPairDraw draws[32][kNT];
                  for (int lane = 0; lane < 32; ++lane)
                    for (int ni = 0; ni < kNT; ++ni) draws[lane][ni] = cols_pair_draw(plane, key0, r0, ni, lane);
                  for (int lane = 0; lane < 32; ++lane) {
                    const int g = lane >> 2, t = lane & 3;
                    for (int ni = 0; ni < kNT; ++ni) {
                      const uint32_t bits =
                          cols_pair_bits(draws[lane][ni].mine, draws[lane ^ 4][ni].theirs_part, lane, plane.threshold);
                      for (int e = 0; e < 4; ++e) {
                        const int k = key0 + g + 8 * (e / 2), q = r0 + ni * 8 + 2 * t + e % 2;
                        expect(dropout_keep(host, b, heads, h, q, k), (bits >> e) & 1u ? 1.f : 0.f, 1.f, "cols pair",
                               lane, k, q);
                      }
                    }
                  }
                }
              for (int lane = 0; lane < 32; ++lane) {
                const int g = lane >> 2, t = lane & 3;
                for (int r0 : {0, 16, 48, 1000})
                  for (int c0 : {0, 32, 64, 4096}) {
                    // rows: queries r0 + mi*16 + g (+8), keys c0 + ni*8 + 2t (+1)
                    float s[2][8][4];
                    for (auto& x : s)
                      for (auto& y : x)
                        for (float& z : y) z = 1.f;
                    apply_dropout_rows(s, plane, r0, c0, lane, 2.f);
                    for (int mi = 0; mi < 2; ++mi)
                      for (int ni = 0; ni < 8; ++ni)
                        for (int e = 0; e < 4; ++e) {
                          const int q = r0 + mi * 16 + g + 8 * (e / 2), k = c0 + ni * 8 + 2 * t + e % 2;
                          expect(dropout_keep(host, b, heads, h, q, k), s[mi][ni][e], 2.f, "rows", lane, q, k);
                        }
                    // rows, one m-tile, as bits (KeepBitsRows: the dropout-only Hopper forward)
                    const KeepBitsRows<16> row_bits(plane, r0, c0, lane);
                    float x1[1][16][4];
                    for (auto& y : x1[0])
                      for (float& z : y) z = 1.f;
                    row_bits.apply(x1, 2.f);
                    for (int ni = 0; ni < 16; ++ni)
                      for (int e = 0; e < 4; ++e) {
                        const int q = r0 + g + 8 * (e / 2), k = c0 + ni * 8 + 2 * t + e % 2;
                        expect(dropout_keep(host, b, heads, h, q, k), x1[0][ni][e], 2.f, "rows bits", lane, q, k);
                      }
                    // cols: keys c0 + mi*16 + g (+8), queries r0 + qi*8 + 2t (+1); and KeepBitsCols
                    float u[2][4][4];
                    for (auto& x : u)
                      for (auto& y : x)
                        for (float& z : y) z = 1.f;
                    apply_dropout_cols(u, plane, c0, r0, lane, 2.f);
                    const KeepBitsCols<2, 4> bits(plane, c0, r0, lane);
                    float w[2][4][4];
                    for (auto& x : w)
                      for (auto& y : x)
                        for (float& z : y) z = 1.f;
                    bits.apply(w, 2.f);
                    for (int mi = 0; mi < 2; ++mi)
                      for (int qi = 0; qi < 4; ++qi)
                        for (int e = 0; e < 4; ++e) {
                          const int k = c0 + mi * 16 + g + 8 * (e / 2), q = r0 + qi * 8 + 2 * t + e % 2;
                          const bool keep = dropout_keep(host, b, heads, h, q, k);
                          expect(keep, u[mi][qi][e], 2.f, "cols", lane, k, q);
                          expect(keep, w[mi][qi][e], 2.f, "keep bits", lane, k, q);
                          expect(keep, bits.kept(mi, qi, e) ? 1.f : 0.f, 1.f, "keep bit", lane, k, q);
                        }
                    // cols, one m-tile at the upper half of a 32-key group (key0 % 32 == 16)
                    float v1[1][4][4];
                    for (auto& y : v1[0])
                      for (float& z : y) z = 1.f;
                    apply_dropout_cols(v1, plane, c0 + 16, r0, lane, 2.f);
                    for (int qi = 0; qi < 4; ++qi)
                      for (int e = 0; e < 4; ++e) {
                        const int k = c0 + 16 + g + 8 * (e / 2), q = r0 + qi * 8 + 2 * t + e % 2;
                        expect(dropout_keep(host, b, heads, h, q, k), v1[0][qi][e], 2.f, "cols half", lane, k, q);
                      }
                  }
              }
            }
        }
  std::printf("%ld elements, %ld mismatches\n", n, bad);
  return bad != 0;
}
