// CPU memory accounting: a counting allocator under every CPU tensor, so CPU runs report
// allocated and peak-allocated bytes as CUDA runs do from the caching allocator (and tests
// can assert memory, e.g. that the chunked loss never holds the full logits).
#pragma once

#include <cstdint>

namespace titan {

struct MemoryStats {
  int64_t allocated = 0;  // bytes held by live tensors now
  int64_t peak = 0;       // the most held at once since start (or the last reset)
  int64_t total = 0;      // bytes ever allocated since start: the difference over a call
                          // is what it allocated, temporaries included (never reset)
  int64_t reserved = 0;   // CUDA: bytes the caching allocator holds from the driver (graph
                          // pools included); 0 on the CPU
};

// Makes the counting allocator c10's CPU allocator. Idempotent; tensors allocated before
// the call are not counted. main() installs it first thing.
void install_cpu_memory_counter();
bool cpu_memory_counter_installed();
MemoryStats cpu_memory_stats();
// Sets the peak to the current allocation (measure the peak of one phase).
void reset_cpu_memory_peak();

// The same count for meta tensors, whose storage has no data: `titan-train estimate` runs the
// model's forward and backward on the meta device and reads how many bytes the autograd graph
// holds and the most it held at once, without allocating any. Idempotent.
void install_meta_memory_counter();
MemoryStats meta_memory_stats();
void reset_meta_memory_peak();

}  // namespace titan
