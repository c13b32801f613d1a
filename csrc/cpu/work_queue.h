// How the CPU kernels spread work over threads, and the per-thread scratch
// memory each worker keeps for its whole run.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "cpu_knobs.h"
#include "huge_pages.h"

namespace flashattn {
namespace cpu {

// Workers of this library's parallel loops, process-wide: the calling
// threads of the loops that run now and the helpers they were granted.
class WorkerBudget {
 public:
  // Up to `wanted` workers (the caller among them) out of `limit`: as many as
  // are free, at least one (the caller itself, running inline). Several
  // Python threads calling the kernels at once then share the thread count
  // instead of each opening a team of at::get_num_threads() (oversubscribed:
  // every team's threads would spin and preempt each other).
  WorkerBudget(int64_t wanted, int64_t limit) {
    int64_t busy = in_use().load(std::memory_order_relaxed);
    do {
      granted_ = std::max<int64_t>(1, std::min(wanted, limit - busy));
    } while (!in_use().compare_exchange_weak(busy, busy + granted_, std::memory_order_acq_rel));
  }
  ~WorkerBudget() { in_use().fetch_sub(granted_, std::memory_order_acq_rel); }
  WorkerBudget(const WorkerBudget&) = delete;
  WorkerBudget& operator=(const WorkerBudget&) = delete;

  int64_t granted() const { return granted_; }

  // The most workers that ever ran at once, counted where they run (a test
  // reads it through cpu_info.cpp); reset: start counting anew.
  static int64_t peak_running(bool reset) { return reset ? peak().exchange(0) : peak().load(); }

  // Held by each worker while it runs items.
  class Running {
   public:
    Running() {
      const int64_t now = running().fetch_add(1, std::memory_order_acq_rel) + 1;
      int64_t seen = peak().load(std::memory_order_relaxed);
      while (now > seen && !peak().compare_exchange_weak(seen, now)) {
      }
    }
    ~Running() { running().fetch_sub(1, std::memory_order_acq_rel); }
  };

 private:
  static std::atomic<int64_t>& in_use() {
    static std::atomic<int64_t> n{0};
    return n;
  }
  static std::atomic<int64_t>& running() {
    static std::atomic<int64_t> n{0};
    return n;
  }
  static std::atomic<int64_t>& peak() {
    static std::atomic<int64_t> n{0};
    return n;
  }
  int64_t granted_ = 1;
};

// Runs process(item, scratch) for every item of [0, num_items) on up to
// at::get_num_threads() workers (torch.set_num_threads), fewer while other
// calls of the kernels hold some of them (WorkerBudget). Each worker builds
// one scratch with make_scratch() and then pulls runs of items from a shared
// counter until none is left: a dynamic schedule, because items differ in cost (a
// causal query tile near the end sees many more keys than one near the
// start) and the machine may be shared, which a static split of the range
// handles badly. finish(scratch) runs on each worker after its last item.
//
// Which worker runs an item does not change its result: every item writes its
// own outputs with a fixed order of operations, so the kernels stay bitwise
// deterministic. Inside an outer parallel region at::parallel_for runs inline
// and the single worker processes every item.
template <typename MakeScratch, typename Process, typename Finish>
void for_each_item_in_parallel(int64_t num_items, MakeScratch make_scratch, Process process, Finish finish) {
  if (num_items <= 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const WorkerBudget budget(std::min<int64_t>(threads, num_items), threads);
  const int64_t workers = budget.granted();
  const bool one_at_a_time = test_knob_value(TestKnob::kClaimOneItem) != 0;
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, workers, /*grain_size=*/1, [&](int64_t, int64_t) {
    const WorkerBudget::Running running;
    auto scratch = make_scratch();
    for (;;) {
      // Guided claims: a run of neighbouring items, 1/(2 x workers) of those
      // left (at least one). Neighbouring items share their inputs (a
      // head's keys and values), so a worker keeps them in its own cache
      // where one item at a time sent each worker to a new head every item
      // (16 threads on a Xeon: 1.2-1.5x torch's time at b4 h16 n1k d128,
      // benchmarks/cpu_perf_log.md); the runs shrink towards the end, so the
      // last claims still balance the workers.
      const int64_t left = num_items - next_item.load(std::memory_order_relaxed);
      const int64_t run = one_at_a_time ? 1 : std::max<int64_t>(1, left / (2 * workers));
      const int64_t first = next_item.fetch_add(run);
      if (first >= num_items) break;
      for (int64_t item = first; item < std::min(first + run, num_items); ++item) process(item, scratch);
    }
    finish(scratch);
  });
}

template <typename MakeScratch, typename Process>
void for_each_item_in_parallel(int64_t num_items, MakeScratch make_scratch, Process process) {
  for_each_item_in_parallel(num_items, make_scratch, process, [](auto&) {});
}

// A 64-byte aligned array, uninitialized; on huge pages from 2 MiB on (huge_pages.h).
template <typename T>
class ScratchArray {
 public:
  ScratchArray() = default;
  explicit ScratchArray(size_t n) : data_(static_cast<T*>(alloc_huge(std::max<size_t>(n, 1) * sizeof(T)))) {}
  T* get() const { return data_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { free_huge(p); }
  };
  std::unique_ptr<T, Free> data_;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows per query block: `largest`, halved down to `smallest` while the blocks
// of all (batch, head) pairs would be fewer than 32 items, so that a small
// problem still spreads over the threads. It depends on the shape only, not
// on the thread count, which keeps results bitwise identical across thread
// counts (the block size can change the GEMMs' rounding).
inline int query_block_size(int64_t batch_heads, int64_t seqlen_q, int largest, int smallest) {
  constexpr int64_t kWantedItems = 32;
  int block = largest;
  while (block > smallest && batch_heads * ceil_div(seqlen_q, block) < kWantedItems) block /= 2;
  return block;
}

}  // namespace cpu
}  // namespace flashattn
