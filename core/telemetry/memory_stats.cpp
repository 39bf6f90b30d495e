#include "core/telemetry/memory_stats.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstring>

namespace titan {
namespace {

std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_total{0};
std::atomic<bool> g_installed{false};

// Each block carries its size in a 64-byte header, so the deleter (which gets only the
// pointer) can subtract it, and the data keeps c10's 64-byte alignment.
constexpr size_t kHeader = 64;

void counted_free(void* p) {
  if (!p) return;
  char* base = static_cast<char*>(p) - kHeader;
  int64_t n = 0;
  std::memcpy(&n, base, sizeof n);
  g_allocated.fetch_sub(n, std::memory_order_relaxed);
  c10::free_cpu(base);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    const int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(base, &bytes, sizeof bytes);
    g_total.fetch_add(bytes, std::memory_order_relaxed);
    const int64_t now = g_allocated.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    void* data = base + kHeader;
    return {data, data, &counted_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

std::atomic<int64_t> g_meta_allocated{0};
std::atomic<int64_t> g_meta_peak{0};
std::atomic<int64_t> g_meta_total{0};

void meta_free(void* ctx) {
  auto* n = static_cast<int64_t*>(ctx);
  g_meta_allocated.fetch_sub(*n, std::memory_order_relaxed);
  delete n;
}

// Meta storage never has data; the context carries the size so the deleter can subtract it.
class CountingMetaAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const int64_t bytes = static_cast<int64_t>(n);
    g_meta_total.fetch_add(bytes, std::memory_order_relaxed);
    const int64_t now = g_meta_allocated.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t peak = g_meta_peak.load(std::memory_order_relaxed);
    while (now > peak &&
           !g_meta_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    return {nullptr, new int64_t(bytes), &meta_free, c10::Device(c10::DeviceType::Meta)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {}
};

}  // namespace

void install_meta_memory_counter() {
  static CountingMetaAllocator allocator;
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  c10::SetAllocator(c10::DeviceType::Meta, &allocator, /*priority=*/100);
}

MemoryStats meta_memory_stats() {
  return {g_meta_allocated.load(std::memory_order_relaxed),
          g_meta_peak.load(std::memory_order_relaxed), g_meta_total.load(std::memory_order_relaxed)};
}

void reset_meta_memory_peak() {
  g_meta_peak.store(g_meta_allocated.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

void install_cpu_memory_counter() {
  static CountingCpuAllocator allocator;
  if (g_installed.exchange(true)) return;
  c10::SetCPUAllocator(&allocator, /*priority=*/100);
}

bool cpu_memory_counter_installed() {
  return g_installed.load() && c10::GetCPUAllocator()->raw_deleter() == &counted_free;
}

MemoryStats cpu_memory_stats() {
  return {g_allocated.load(std::memory_order_relaxed), g_peak.load(std::memory_order_relaxed),
          g_total.load(std::memory_order_relaxed)};
}

void reset_cpu_memory_peak() {
  g_peak.store(g_allocated.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace titan
