#include "core/telemetry/cuda_info.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

namespace titan {

CudaDeviceInfo cuda_device_info(int device) {
  CudaDeviceInfo info;
  if (!at::hasCUDA()) return info;
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(device);
  info.available = true;
  info.name = p->name;
  info.major = p->major;
  info.minor = p->minor;
  info.total_memory = static_cast<int64_t>(p->totalGlobalMem);
  return info;
}

int64_t cuda_device_count() {
  return at::hasCUDA() ? static_cast<int64_t>(c10::cuda::device_count()) : 0;
}

void cuda_set_device(int device) {
  if (at::hasCUDA()) c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
}

MemoryStats cuda_memory_stats(int device) {
  if (!at::hasCUDA()) return {};
  auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const auto& a = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  const auto& r = stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  MemoryStats m;
  m.allocated = a.current;
  m.peak = a.peak;
  m.reserved = r.current;
  return m;
}

void cuda_release_cached_memory() {
  if (at::hasCUDA()) c10::cuda::CUDACachingAllocator::emptyCache();
}

void cuda_reset_memory_peak(int device) {
  if (at::hasCUDA())
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
}

DeviceMemory cuda_free_and_total() {
  if (!at::hasCUDA()) return {};
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query must not poison the next CUDA call
    return {};
  }
  DeviceMemory m;
  m.free = static_cast<int64_t>(free);
  m.total = static_cast<int64_t>(total);
  return m;
}

}  // namespace titan
