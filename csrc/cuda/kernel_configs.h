// The tile configuration chosen for each head dim. Changing a line here is
// how a kernel is retuned; benchmarks/NOTES.md has the measurements behind
// each choice, and a build with FLASHATTN_TUNING=1 compiles the candidates of
// TuneVariants so benchmarks/tune.py can time them side by side.
#pragma once

#include <type_traits>

#include "dispatch.h"
#include "kernel_traits.h"

namespace flashattn {

template <int kHeadDim, typename T>
struct KernelConfig;

// FwdTraits<D, M, N, warps, minBlocks, stages>
// BwdTraits<D, M, N, warps, dsplit, qstages, query warps of S^T (1: P^T stays in registers)>
// BwdDqTraits<D, M, N, warps>
// FwdSm90WsTraits<D, N, consumer warpgroups, stages> (Hopper warp-specialized TMA forward: 64/128/192/256)
// FwdSm90Traits<D, N, minBlocksPerSm>, BwdSm90Traits<D, M, warpgroups> (Hopper wgmma kernels: forward 64/128/192/256,
// backward 64/128), BwdSm90WsTraits<D, M, stages> (Hopper warp-specialized TMA backward: 64/128),
// BwdSm90WsSplitTraits<D> (the same with the head dim split between the consumers: 192/256)
template <typename T>
struct KernelConfig<32, T> {
  using Fwd = FwdTraits<32, 128, 128, 4, 2, 1, T>;
  using Bwd = BwdTraits<32, 32, 128, 4, 1, 2, 1, T>;
  using BwdDq = BwdDqTraits<32, 64, 64, 4, T>;
};
template <typename T>
struct KernelConfig<64, T> {
  using Fwd = FwdTraits<64, 128, 64, 4, 2, 1, T>;
  using Bwd = BwdTraits<64, 32, 128, 4, 1, 2, 1, T>;  // 32 keys per warp: half the Q/dO fragment traffic
  using BwdDq = BwdDqTraits<64, 64, 64, 4, T>;
  using FwdSm90 = FwdSm90Traits<64, 64, T, 2>;          // 64 keys a block, two CTAs an SM
  using FwdSm90Ws = FwdSm90WsTraits<64, 128, 3, 2, T>;  // 192 queries: three consumers
  // Causal / windowed up to kTwoConsumersMaxSeqlen queries: 128-query tiles waste less on the diagonal. Session 14
  // (tune.py, one H200 build, 16k tokens, causal, three / two consumers, TFLOP/s): 512 191/211, 1k 261/283, 2k
  // 321/343, 4k 419/370, 8k 467/379, 16k 469/381 (the three-consumer kernel stopped spilling with the band mask,
  // session 9; the rule was 8k since session 3, when it spilled 100 bytes). Calls with a score mod or dropout run
  // it at every length: its instances hold them (in the three-consumer kernel, ptxas sm_90a bf16, dropout took the
  // softcap / ALiBi instance from 0 to 72/92 bytes of spills and the attn_mask one from 340/468 to 424/600).
  using FwdSm90WsTwoConsumers = FwdSm90WsTraits<64, 128, 2, 2, T>;
  static constexpr int kTwoConsumersMaxSeqlen = 2048;
  using BwdSm90 = BwdSm90Traits<64, 128, T>;  // 128 queries a step: half the dQ atomics per flop of 64
  // 128 queries a step: twice the products per step's fixed costs (barriers, waits, the dQ tile's bulk add).
  using BwdSm90Ws = BwdSm90WsTraits<64, 128, 2, T, true>;
  // The 64-query steps it replaced (session 7), for the A/B (p.bwd_long_steps = false): one dQ block a step, the
  // consumers in turn; short steps: 4 stages.
  using BwdSm90WsShortSteps = BwdSm90WsTraits<64, 64, 4, T>;
};
template <typename T>
struct KernelConfig<96, T> {
  using Fwd = FwdTraits<96, 128, 64, 4, 2, 2, T>;
  using Bwd = BwdTraits<96, 64, 128, 8, 1, 2, 2, T>;
  using BwdDq = BwdDqTraits<96, 64, 64, 4, T>;
  // Hopper: the head dim 128 kernels; TMA zero-fills columns 96-127 of every
  // load and clips them from every store (a quarter of the products wasted,
  // still about twice the mma.sync kernels' rate).
  using FwdSm90Ws = FwdSm90WsTraits<128, 128, 2, 2, T>;
  using BwdSm90Ws = BwdSm90WsTraits<128, 64, 2, T, true>;
};
template <typename T>
struct KernelConfig<128, T> {
  using Fwd = FwdTraits<128, 128, 64, 4, 2, 2, T>;     // two K/V stages
  using Bwd = BwdTraits<128, 64, 128, 8, 1, 2, 2, T>;  // 2-D S^T tiles, P^T / dS^T through smem
  using BwdDq = BwdDqTraits<128, 64, 64, 4, T>;
  using FwdSm90 = FwdSm90Traits<128, 128, T>;
  using FwdSm90Ws = FwdSm90WsTraits<128, 128, 2, 2, T>;
  using BwdSm90 = BwdSm90Traits<128, 64, T>;
  using BwdSm90Ws = BwdSm90WsTraits<128, 64, 2, T, true>;
};
template <typename T>
struct KernelConfig<192, T> {
  using Fwd = FwdTraits<192, 128, 64, 8, 1, 1, T>;
  using FwdSm90 = FwdSm90Traits<192, 64, T>;
  using FwdSm90Ws = FwdSm90WsTraits<192, 64, 2, 2, T>;
  using Bwd = BwdTraits<192, 64, 64, 8, 1, 2, 4, T>;  // 2-D: dK/dV tiles of 32 keys x 48 columns a warp
  using BwdDq = BwdDqTraits<192, 64, 64, 4, T>;
  using BwdSm90Ws = BwdSm90WsSplitTraits<192, T>;  // 64 keys a CTA; the consumers split the head dim 128 / 64
};
template <typename T>
struct KernelConfig<256, T> {
  using Fwd = FwdTraits<256, 128, 64, 8, 1, 1, T>;
  using FwdSm90 = FwdSm90Traits<256, 64, T>;  // O is 128 registers a thread: 64-key blocks
  using FwdSm90Ws = FwdSm90WsTraits<256, 64, 2, 2, T>;
  using Bwd = BwdTraits<256, 64, 64, 8, 1, 1, 4, T>;  // 2-D: dK/dV tiles of 32 keys x 64 columns a warp
  using BwdDq = BwdDqTraits<256, 64, 64, 4, T>;
  using BwdSm90Ws = BwdSm90WsSplitTraits<256, T>;  // 64 keys a CTA, the head dim split between the consumers
};

// Whether a head dim has a Hopper (wgmma) kernel: KernelConfig names one.
template <typename Cfg, typename = void>
struct HasFwdSm90 : std::false_type {};
template <typename Cfg>
struct HasFwdSm90<Cfg, std::void_t<typename Cfg::FwdSm90>> : std::true_type {};
template <typename Cfg, typename = void>
struct HasFwdSm90Ws : std::false_type {};
template <typename Cfg>
struct HasFwdSm90Ws<Cfg, std::void_t<typename Cfg::FwdSm90Ws>> : std::true_type {};
template <typename Cfg, typename = void>
struct HasFwdSm90WsTwoConsumers : std::false_type {};
template <typename Cfg>
struct HasFwdSm90WsTwoConsumers<Cfg, std::void_t<typename Cfg::FwdSm90WsTwoConsumers>> : std::true_type {};
template <typename Cfg, typename = void>
struct HasBwdSm90 : std::false_type {};
template <typename Cfg>
struct HasBwdSm90<Cfg, std::void_t<typename Cfg::BwdSm90>> : std::true_type {};

template <typename Cfg, typename = void>
struct HasBwdSm90Ws : std::false_type {};
template <typename Cfg>
struct HasBwdSm90Ws<Cfg, std::void_t<typename Cfg::BwdSm90Ws>> : std::true_type {};
template <typename Cfg, typename = void>
struct HasBwdSm90WsShortSteps : std::false_type {};
template <typename Cfg>
struct HasBwdSm90WsShortSteps<Cfg, std::void_t<typename Cfg::BwdSm90WsShortSteps>> : std::true_type {};

template <typename... Kts>
struct Variants {};

template <typename Tv, typename = void>
struct HasBwdSm90WsDqLast : std::false_type {};
template <typename Tv>
struct HasBwdSm90WsDqLast<Tv, std::void_t<typename Tv::BwdSm90WsDqLast>> : std::true_type {};
template <typename Tv, typename = void>
struct HasFwdSm90WsVariants : std::false_type {};
template <typename Tv>
struct HasFwdSm90WsVariants<Tv, std::void_t<typename Tv::FwdSm90Ws>> : std::true_type {};

// Candidates for benchmarks/tune.py; element 0 of each list is KernelConfig's.
template <int kHeadDim, typename T>
struct TuneVariants {
  using Fwd = Variants<typename KernelConfig<kHeadDim, T>::Fwd>;
  using Bwd = Variants<typename KernelConfig<kHeadDim, T>::Bwd>;
};
template <typename T>
struct TuneVariants<64, T> {
  using Fwd = Variants<typename KernelConfig<64, T>::Fwd, FwdTraits<64, 128, 64, 4, 2, 2, T>>;
  using Bwd = Variants<typename KernelConfig<64, T>::Bwd, BwdTraits<64, 32, 128, 4, 1, 2, 1, T, false>>;
  using FwdSm90 = Variants<typename KernelConfig<64, T>::FwdSm90, FwdSm90Traits<64, 128, T>, FwdSm90Traits<64, 64, T>>;
  // Three / two consumers; then each with 1/4, then 1/16 of the exponentials on the FMA pipe (kPolyExpEvery;
  // 1/4 and 1/8 measured slower in session 14, 1/16 is near the predicted best share of 1/14).
  // FLASHATTN_FWD_VARIANT=2 runs the FMA-pipe exponentials at both head dims (1/4), =3 too (d128: 1/16).
  using FwdSm90Ws = Variants<typename KernelConfig<64, T>::FwdSm90Ws, FwdSm90WsTraits<64, 128, 2, 2, T>,
                             FwdSm90WsTraits<64, 128, 3, 2, T, 4>, FwdSm90WsTraits<64, 128, 2, 2, T, 4>,
                             FwdSm90WsTraits<64, 128, 3, 2, T, 16>, FwdSm90WsTraits<64, 128, 2, 2, T, 16>>;
  using BwdSm90 =
      Variants<typename KernelConfig<64, T>::BwdSm90, BwdSm90Traits<64, 128, T, 1>, BwdSm90Traits<64, 64, T>>;
  using BwdSm90WsDqLast = BwdSm90WsTraits<64, 128, 2, T, false>;  // FLASHATTN_BWD_DQ_FIRST=0
};
template <typename T>
struct TuneVariants<128, T> {
  using Fwd = Variants<typename KernelConfig<128, T>::Fwd, FwdTraits<128, 128, 64, 4, 2, 1, T>>;
  using Bwd = Variants<typename KernelConfig<128, T>::Bwd, BwdTraits<128, 64, 128, 8, 1, 2, 2, T, false>>;
  using FwdSm90 =
      Variants<typename KernelConfig<128, T>::FwdSm90, FwdSm90Traits<128, 64, T>, FwdSm90Traits<128, 64, T, 2>>;
  using FwdSm90Ws = Variants<typename KernelConfig<128, T>::FwdSm90Ws, FwdSm90WsTraits<128, 192, 2, 2, T>,
                             FwdSm90WsTraits<128, 128, 2, 2, T, 4>, FwdSm90WsTraits<128, 128, 2, 2, T, 16>>;
  using BwdSm90 = Variants<typename KernelConfig<128, T>::BwdSm90>;
  using BwdSm90WsDqLast = BwdSm90WsTraits<128, 64, 2, T, false>;  // FLASHATTN_BWD_DQ_FIRST=0
};
// 192 / 256: the default, then without ping-pong (each consumer issues its GEMMs as soon as it can).
template <typename T>
struct TuneVariants<192, T> {
  using Fwd = Variants<typename KernelConfig<192, T>::Fwd>;
  using Bwd = Variants<typename KernelConfig<192, T>::Bwd>;
  using FwdSm90 = Variants<typename KernelConfig<192, T>::FwdSm90>;
  using FwdSm90Ws = Variants<typename KernelConfig<192, T>::FwdSm90Ws, FwdSm90WsTraits<192, 64, 2, 2, T, 0, false>>;
};
template <typename T>
struct TuneVariants<256, T> {
  using Fwd = Variants<typename KernelConfig<256, T>::Fwd>;
  using Bwd = Variants<typename KernelConfig<256, T>::Bwd>;
  using FwdSm90 = Variants<typename KernelConfig<256, T>::FwdSm90>;
  using FwdSm90Ws = Variants<typename KernelConfig<256, T>::FwdSm90Ws, FwdSm90WsTraits<256, 64, 2, 2, T, 0, false>>;
};

}  // namespace flashattn
