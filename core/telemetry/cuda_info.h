// CUDA device facts for logging and metrics, callable from CPU-only builds and machines.
#pragma once

#include <cstdint>
#include <string>

#include "core/telemetry/memory_stats.h"

namespace titan {

struct CudaDeviceInfo {
  bool available = false;
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int64_t total_memory = 0;  // bytes
};

CudaDeviceInfo cuda_device_info(int device);
// CUDA devices this process sees (0 without CUDA or without a driver).
int64_t cuda_device_count();
// Makes `device` the current CUDA device of this thread (no-op without CUDA). Called first
// at start-up with LOCAL_RANK, so NCCL and every op that uses "the current device" land on
// this rank's GPU rather than GPU 0.
void cuda_set_device(int device);
// Bytes allocated by the caching allocator on `device`, now and at the peak since start or
// the last reset (zeros without CUDA).
MemoryStats cuda_memory_stats(int device);
void cuda_reset_memory_peak(int device);
// Returns the caching allocator's unused cached blocks to the driver (no-op without CUDA).
void cuda_release_cached_memory();
// Free and total bytes of the current CUDA device as the driver sees them (zeros without CUDA).
struct DeviceMemory {
  int64_t free = 0, total = 0;
};
DeviceMemory cuda_free_and_total();

}  // namespace titan
