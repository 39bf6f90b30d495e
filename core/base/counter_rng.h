// Counter-based random numbers for parameter initialization. Draw k of a parameter is a
// pure function of (seed, parameter name, k) (Philox4x32-10, Salmon et al. 2011), so a rank
// that holds rows [r0, r0 + n) of a parameter draws exactly those values and nothing else,
// and every world size and layout (1 process, FSDP, HSDP, expert parallelism) starts from
// bit-identical weights (docs/models.md, "Initialization").
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace titan {

// The Philox key of one parameter's stream: the seed mixed with a hash of its name (not its
// registration index, so adding a parameter leaves the others' values alone).
uint64_t param_stream_key(uint64_t seed, const std::string& name);

// Fill a contiguous CPU fp32 tensor whose element j is element `first` + j of the
// parameter (row-major over the full shape). Every element is computed on its own, in
// double, by scalar code, so the result does not depend on where a shard starts.
// N(0, std):
void counter_normal_(at::Tensor& out, uint64_t key, int64_t first, double std);
// N(0, std) truncated to [lo, hi] by inverse-CDF sampling (torch.nn.init.trunc_normal_):
void counter_trunc_normal_(at::Tensor& out, uint64_t key, int64_t first, double std, double lo,
                           double hi);

}  // namespace titan
