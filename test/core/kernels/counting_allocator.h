// The product's counting CPU allocator (core/telemetry/memory_stats.h) seen through the small
// interface the memory tests and benchmarks use: live bytes and their peak.
#pragma once

#include <cstdint>

#include "core/telemetry/memory_stats.h"

namespace titan::test {

struct CpuCounter {
  int64_t live() const { return cpu_memory_stats().allocated; }
  int64_t peak() const { return cpu_memory_stats().peak; }
  void reset_peak() { reset_cpu_memory_peak(); }
};

// Makes sure the counter is installed (it stays: the product installs it at start-up too).
struct CountAllocations {
  CountAllocations() { install_cpu_memory_counter(); }
  CpuCounter counter;
};

}  // namespace titan::test
