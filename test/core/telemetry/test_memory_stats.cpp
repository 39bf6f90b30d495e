// The counting CPU allocator: what it reports is what tensors hold. Reference: the tensors'
// own byte sizes (numel x element size); exact.
#include <catch2/catch.hpp>

#include "core/telemetry/memory_stats.h"

using namespace titan;

TEST_CASE("memory stats: the CPU counter sees allocations, frees and the peak", "[memory]") {
  install_cpu_memory_counter();
  REQUIRE(cpu_memory_counter_installed());
  const MemoryStats before = cpu_memory_stats();
  reset_cpu_memory_peak();
  {
    at::Tensor a = at::empty({1024, 1024}, at::kFloat);  // 4 MiB
    CHECK(cpu_memory_stats().allocated - before.allocated == 4 << 20);
    {
      at::Tensor b = at::empty({512, 1024}, at::kDouble);  // 4 MiB more
      CHECK(cpu_memory_stats().allocated - before.allocated == 8 << 20);
    }
    CHECK(cpu_memory_stats().allocated - before.allocated == 4 << 20);
    // Data written through the counter's blocks survives (64-byte aligned, usable memory).
    a.fill_(2.5);
    CHECK(a.sum().item<double>() == 2.5 * 1024 * 1024);
    CHECK(reinterpret_cast<uintptr_t>(a.data_ptr()) % 64 == 0);
  }
  const MemoryStats after = cpu_memory_stats();
  CHECK(after.allocated == before.allocated);
  // The cumulative count keeps both blocks (and the 0-d sum) after they are freed.
  CHECK(after.total - before.total >= 8 << 20);
  CHECK(after.total - before.total < (8 << 20) + 4096);
  CHECK(after.peak - before.allocated >= 8 << 20);
  reset_cpu_memory_peak();
  CHECK(cpu_memory_stats().peak == cpu_memory_stats().allocated);
}
