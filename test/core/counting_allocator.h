// Test-local counting wrapper of c10's CPU allocator: live bytes and their peak across every
// CPU tensor allocation while installed (for memory bounds in tests and benchmarks).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace titan::test {

// The allocator object outlives every tensor it handed out: it is never destroyed.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device dev = inner.device();
    auto* ctx = new Block{std::move(inner), n, this};
    const int64_t now = live_ += static_cast<int64_t>(n);
    for (int64_t p = peak_.load(); now > p && !peak_.compare_exchange_weak(p, now);) {
    }
    return {data, ctx, &Block::release, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    std::memcpy(dest, src, count);
  }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_.load(); }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t n;
    CountingCpuAllocator* owner;
    static void release(void* p) {
      auto* b = static_cast<Block*>(p);
      b->owner->live_ -= static_cast<int64_t>(b->n);
      delete b;
    }
  };
  c10::Allocator* base_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

// Installs the counter for its lifetime.
struct CountAllocations {
  CountingCpuAllocator& counter;
  c10::Allocator* prev;
  CountAllocations()
      : counter(*new CountingCpuAllocator(c10::GetCPUAllocator())), prev(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(&counter, /*priority=*/0);
  }
  ~CountAllocations() { c10::SetCPUAllocator(prev, /*priority=*/0); }
};

}  // namespace titan::test
