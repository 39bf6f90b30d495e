#include "core/memory_stats.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace titan {
namespace {

std::atomic<int64_t> g_allocated{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_total{0};
std::atomic<bool> g_installed{false};

// Each block carries its size in a 64-byte header, so the deleter (which gets only the
// pointer) can subtract it, and the data keeps c10's 64-byte alignment.
constexpr size_t kHeader = 64;

// Large blocks are kept after they are freed, up to kCacheBytes in all, and handed out again
// for a request of exactly the same size. A training step allocates the same big tensors every
// step (the loss's chunk logits, the output layer's gradient, activation buffers); glibc maps
// blocks above 32 MiB fresh each time and returns freed heap tops to the kernel, so without
// the cache every step pays their page faults and the kernel's zeroing of the pages again.
// Exact sizes only, so a cached block never holds more than the request; the counts above
// are of live tensors, never of cached blocks.
constexpr size_t kCacheMinBytes = size_t{1} << 20;
constexpr size_t kCacheBytes = size_t{256} << 20;

struct BlockCache {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<char*>> free;  // block size (with header) -> blocks
  size_t bytes = 0;
};
BlockCache& block_cache() {
  static auto* c = new BlockCache;  // never destroyed: tensors may be freed at exit
  return *c;
}
std::atomic<bool> g_cache_enabled{true};

char* take_cached(size_t total) {
  if (total < kCacheMinBytes || !g_cache_enabled.load(std::memory_order_relaxed)) return nullptr;
  BlockCache& c = block_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.free.find(total);
  if (it == c.free.end() || it->second.empty()) return nullptr;
  char* b = it->second.back();
  it->second.pop_back();
  c.bytes -= total;
  return b;
}

void release_block(char* base, size_t total) {
  if (total >= kCacheMinBytes && g_cache_enabled.load(std::memory_order_relaxed)) {
    BlockCache& c = block_cache();
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.bytes + total <= kCacheBytes) {
      c.free[total].push_back(base);
      c.bytes += total;
      return;
    }
  }
  c10::free_cpu(base);
}

void counted_free(void* p) {
  if (!p) return;
  char* base = static_cast<char*>(p) - kHeader;
  int64_t n = 0;
  std::memcpy(&n, base, sizeof n);
  g_allocated.fetch_sub(n, std::memory_order_relaxed);
  release_block(base, static_cast<size_t>(n) + kHeader);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    char* base = take_cached(n + kHeader);
    if (!base) base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
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
  // TITAN_CPU_BLOCK_CACHE=0 turns the block cache off: only to measure what it buys side by
  // side (docs/performance.md), not a setting anyone should train with.
  const char* cache = std::getenv("TITAN_CPU_BLOCK_CACHE");
  if (cache && std::string(cache) == "0") g_cache_enabled.store(false);
  c10::SetCPUAllocator(&allocator, /*priority=*/100);
}

bool cpu_memory_counter_installed() {
  return g_installed.load() && c10::GetCPUAllocator()->raw_deleter() == &counted_free;
}

MemoryStats cpu_memory_stats() {
  return {g_allocated.load(std::memory_order_relaxed), g_peak.load(std::memory_order_relaxed),
          g_total.load(std::memory_order_relaxed)};
}

int64_t cpu_memory_cached_bytes() {
  BlockCache& c = block_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return static_cast<int64_t>(c.bytes);
}

void set_cpu_block_cache(bool enabled) {
  g_cache_enabled.store(enabled);
  if (enabled) return;
  BlockCache& c = block_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto& [size, blocks] : c.free)
    for (char* b : blocks) c10::free_cpu(b);
  c.free.clear();
  c.bytes = 0;
}

void reset_cpu_memory_peak() {
  g_peak.store(g_allocated.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace titan
