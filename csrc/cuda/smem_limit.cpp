// allow_dynamic_smem (smem_limit.h): the limits already set, by (kernel, device).
#include "smem_limit.h"

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace flashattn {
namespace {

struct KernelOnDevice {
  const void* kernel;
  int device;
  bool operator==(const KernelOnDevice& o) const { return kernel == o.kernel && device == o.device; }
};

struct KernelOnDeviceHash {
  size_t operator()(const KernelOnDevice& k) const {
    return std::hash<const void*>()(k.kernel) ^ (static_cast<size_t>(k.device) * 0x9e3779b97f4a7c15ull);
  }
};

}  // namespace

cudaError_t allow_dynamic_smem(const void* kernel, int bytes) {
  static std::mutex mutex;
  static std::unordered_map<KernelOnDevice, int, KernelOnDeviceHash> limits;  // the largest limit set
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const KernelOnDevice key{kernel, device};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = limits.find(key);
  if (it != limits.end() && it->second >= bytes) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) limits[key] = bytes;
  return err;
}

}  // namespace flashattn
