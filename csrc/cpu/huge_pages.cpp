// huge_pages.h: CPU memory on transparent huge pages.
#include "huge_pages.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flashattn {
namespace cpu {

void* alloc_huge(size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHugePage = size_t(2) << 20;
  if (bytes >= kHugePage) {
    void* p = nullptr;
    TORCH_CHECK(posix_memalign(&p, kHugePage, bytes) == 0, "flashattn_ext: out of memory allocating ", bytes,
                " bytes on the CPU");
    madvise(p, bytes, MADV_HUGEPAGE);  // advice: where it fails, the pages stay 4 KiB
    return p;
  }
#endif
  return c10::alloc_cpu(bytes);
}

// (c10::free_cpu is free(): both allocations above are posix_memalign's.)
void free_huge(void* p) { c10::free_cpu(p); }

namespace {

struct HugePageAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* p = alloc_huge(bytes);
    return {p, p, &free_huge, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_huge; }
  void copy_data(void* dest, const void* src, std::size_t count) const final { default_copy_data(dest, src, count); }
};

HugePageAllocator g_huge_page_allocator;

}  // namespace

at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TORCH_INTERNAL_ASSERT(options.device().is_cpu());
  return at::detail::empty_generic(sizes, &g_huge_page_allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), std::nullopt);
}

}  // namespace cpu
}  // namespace flashattn
