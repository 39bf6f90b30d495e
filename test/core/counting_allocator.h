// Test-local counting wrapper of c10's CPU allocator: live bytes and their peak across every
// CPU tensor allocation while installed (for memory bounds in tests and benchmarks).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace titan::test {

// One process-wide instance (the deleter is a plain function). Each DataPtr's context is its
// data pointer, as c10's raw_allocate (used by oneDNN's scratchpads) requires; the wrapped
// allocation and its size are kept in a map until freed.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& instance() {
    static auto* a = new CountingCpuAllocator(c10::GetCPUAllocator());  // never destroyed
    return *a;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device dev = inner.device();
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_.emplace(data, Block{std::move(inner), n});
    }
    const int64_t now = live_ += static_cast<int64_t>(n);
    for (int64_t p = peak_.load(); now > p && !peak_.compare_exchange_weak(p, now);) {
    }
    return {data, data, &release, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }
  c10::Allocator* base() const { return base_; }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_.load(); }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t n;
  };
  explicit CountingCpuAllocator(c10::Allocator* base) : base_(base) {}
  static void release(void* data) {
    if (!data) return;
    auto& a = instance();
    c10::DataPtr inner;  // freed outside the lock
    {
      std::lock_guard<std::mutex> lock(a.mu_);
      auto it = a.blocks_.find(data);
      if (it == a.blocks_.end()) return;
      a.live_ -= static_cast<int64_t>(it->second.n);
      inner = std::move(it->second.inner);
      a.blocks_.erase(it);
    }
  }
  c10::Allocator* base_;
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

// Installs the counter for its lifetime.
struct CountAllocations {
  CountingCpuAllocator& counter = CountingCpuAllocator::instance();
  CountAllocations() { c10::SetCPUAllocator(&counter, /*priority=*/0); }
  ~CountAllocations() { c10::SetCPUAllocator(counter.base(), /*priority=*/0); }
};

}  // namespace titan::test
