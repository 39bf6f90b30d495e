// CUDA device facts for logging and metrics, callable from CPU-only builds and machines.
#pragma once

#include <cstdint>
#include <string>

namespace titan {

struct CudaDeviceInfo {
  bool available = false;
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int64_t total_memory = 0;  // bytes
};

CudaDeviceInfo cuda_device_info(int device);
// Peak bytes allocated by the caching allocator on `device` since start (0 without CUDA).
int64_t cuda_peak_allocated(int device);

}  // namespace titan
