// Host check of the CUDA kernels' element masks (csrc/cuda/mask.cuh): every
// element apply_mask_rows / apply_mask_cols keep or fill must be what the
// per-row rule key_lo(row) <= key < key_hi(row) says, over windows, diagonals
// out to +-2e9, sequence edges and all lane positions. Built with nvcc as host
// code by tests/test_mask_rule.py; prints "N elements, M mismatches" and exits
// non-zero on a mismatch. Also checks BlockMask::masks_first_step_only (the
// forward's MaskSteps::kFirst policy) against tile_needs_mask.
#include <cmath>
#include <cstdio>

#include "../../csrc/cuda/mask.cuh"

using flashattn::BlockMask;

// masks_first_step_only against tile_needs_mask: where the rule says yes, no
// tile of kBlockM rows needs the mask at a key block after the first it
// visits (the last of [n_min, n_max)). Counts the calls the rule admits.
template <int kBlockM, int kBlockN>
void check_first_step_rule(long& calls, long& admitted, long& bad) {
  for (int sq : {1, 100, 128, 129, 1000, 1024, 4096})
    for (int sk : {1, 77, 128, 1000, 1024, 4096, 4100})
      for (int wl : {-1, 0, 3, 1000})
        for (int wr : {-1, 0, 5, 127, 128, 300, 2000000000})
          for (int diag : {0, sk - sq, -37, 64, 127, 128, 2000000000}) {
            const BlockMask m(sq, sk, wl, wr, diag);
            ++calls;
            if (!m.masks_first_step_only<kBlockM, kBlockN>()) continue;
            ++admitted;
            for (int m0 = 0; m0 < sq; m0 += kBlockM) {
              int n_min, n_max;
              m.key_block_range<kBlockN>(m0, sq - m0 < kBlockM ? sq - m0 : kBlockM, n_min, n_max);
              for (int n = n_min; n < n_max - 1; ++n)
                if (m.tile_needs_mask<kBlockM, kBlockN>(m0, n * kBlockN) && ++bad <= 5)
                  std::printf("first-step rule broken: tile %dx%d sq %d sk %d wl %d wr %d diag %d m0 %d block %d\n",
                              kBlockM, kBlockN, sq, sk, wl, wr, diag, m0, n);
            }
          }
}

int main() {
  long n = 0, bad = 0;
  for (int sq : {1, 100, 1000, 5000})
    for (int sk : {1, 77, 1000, 5000})
      for (int wl : {-1, 0, 3, 100, 2000000000})
        for (int wr : {-1, 0, 5, 300, 2000000000})
          for (int diag : {0, sk - sq, -37, 64, -2000000000, 2000000000}) {
            const BlockMask m(sq, sk, wl, wr, diag);
            for (int r0 : {0, 16, 64, 960, 4990})
              for (int c0 : {0, 64, 960, 4992})
                for (int lane = 0; lane < 32; lane += 3) {
                  float s[2][16][4], u[2][16][4];
                  for (auto& a : s) for (auto& b : a) for (auto& x : b) x = 1.f;
                  for (auto& a : u) for (auto& b : a) for (auto& x : b) x = 1.f;
                  flashattn::apply_mask_rows(s, m, r0, c0, lane);       // rows queries, columns keys
                  flashattn::apply_mask_cols(u, m, r0, c0, lane, 0.f);  // rows keys, columns queries
                  const int g = lane >> 2, t = lane & 3;
                  for (int mi = 0; mi < 2; ++mi)
                    for (int h = 0; h < 2; ++h)
                      for (int ni = 0; ni < 16; ++ni)
                        for (int e = 0; e < 2; ++e) {
                          const int row = r0 + mi * 16 + g + 8 * h, col = c0 + ni * 8 + 2 * t + e;
                          const bool seen = col >= m.key_lo(row) && col < m.key_hi(row);
                          const bool seen_t = row >= m.key_lo(col) && row < m.key_hi(col);
                          const bool kept = !std::isinf(s[mi][ni][2 * h + e]);
                          const bool kept_t = u[mi][ni][2 * h + e] == 1.f;
                          n += 2;
                          if (seen != kept || seen_t != kept_t) {
                            if (++bad <= 5)
                              std::printf("mismatch: sq %d sk %d wl %d wr %d diag %d r0 %d c0 %d lane %d\n", sq, sk,
                                          wl, wr, diag, r0, c0, lane);
                          }
                        }
                }
          }
  long calls = 0, admitted = 0;
  check_first_step_rule<128, 128>(calls, admitted, bad);
  check_first_step_rule<192, 128>(calls, admitted, bad);
  check_first_step_rule<128, 80>(calls, admitted, bad);
  check_first_step_rule<128, 64>(calls, admitted, bad);
  std::printf("first-step rule: %ld of %ld calls admitted\n", admitted, calls);
  if (admitted == 0 || admitted == calls) ++bad;  // the check must see both answers
  std::printf("%ld elements, %ld mismatches\n", n, bad);
  return bad != 0;
}
