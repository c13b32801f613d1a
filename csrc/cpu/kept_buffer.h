// A call-sized scratch buffer kept between calls.
//
// The tiled forward lays out every value tile of a call once (FwdPlan's
// v_t_acc / v_t_lowp: all of V, 32 MB at b4 h16 n1024 d128 float32). Taken
// fresh from the allocator at every call, such a buffer is a new mapping:
// the kernel faults in and zeroes every page of it inside the call (perf on a
// 2-core AVX2 EPYC, float32 forward of that shape: 1k more kernel samples
// than torch's call, ~3% of it; benchmarks/cpu_perf_log.md). So the last
// buffer a call gives back is kept for the next, up to kMaxKeptBytes: the
// memory held between calls is bounded by that, whatever the shapes. Several
// calls at once (Python threads) each take their own; a call that finds the
// kept buffer too small or taken allocates one.
#pragma once

#include <c10/core/impl/alloc_cpu.h>

#include <cstddef>
#include <mutex>

namespace flashattn {
namespace cpu {

class KeptBuffer {
 public:
  static constexpr size_t kMaxKeptBytes = size_t(64) << 20;

  // At least `bytes` bytes, 64-byte aligned, uninitialized: the kept buffer
  // when it is free and large enough, else a new one.
  static void* take(size_t bytes, size_t& capacity) {
    {
      std::lock_guard<std::mutex> lock(state().mutex);
      State& s = state();
      if (s.data != nullptr && s.capacity >= bytes) {
        void* p = s.data;
        capacity = s.capacity;
        s.data = nullptr;
        s.capacity = 0;
        return p;
      }
    }
    capacity = bytes;
    return c10::alloc_cpu(bytes > 0 ? bytes : 1);
  }

  // Keeps p (capacity bytes) for the next call when it is within the bound
  // and larger than what is kept; frees what it does not keep.
  static void give_back(void* p, size_t capacity) {
    void* to_free = p;
    if (capacity <= kMaxKeptBytes) {
      std::lock_guard<std::mutex> lock(state().mutex);
      State& s = state();
      if (s.capacity < capacity) {
        to_free = s.data;
        s.data = p;
        s.capacity = capacity;
      }
    }
    if (to_free != nullptr) c10::free_cpu(to_free);
  }

 private:
  struct State {
    std::mutex mutex;
    void* data = nullptr;
    size_t capacity = 0;
  };
  static State& state() {
    static State s;  // (never destroyed before the process's last call: kept until exit)
    return s;
  }
};

// An array of n T in a buffer from KeptBuffer, given back when it goes.
template <typename T>
class KeptArray {
 public:
  KeptArray() = default;
  explicit KeptArray(size_t n) : data_(static_cast<T*>(KeptBuffer::take(n * sizeof(T), capacity_))) {}
  KeptArray(const KeptArray&) = delete;
  KeptArray& operator=(const KeptArray&) = delete;
  KeptArray(KeptArray&& o) noexcept : data_(o.data_), capacity_(o.capacity_) { o.data_ = nullptr; }
  KeptArray& operator=(KeptArray&& o) noexcept {
    if (this != &o) {
      release();
      data_ = o.data_;
      capacity_ = o.capacity_;
      o.data_ = nullptr;
    }
    return *this;
  }
  ~KeptArray() { release(); }
  T* get() const { return data_; }

 private:
  void release() {
    if (data_ != nullptr) KeptBuffer::give_back(data_, capacity_);
    data_ = nullptr;
  }
  T* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace cpu
}  // namespace flashattn
