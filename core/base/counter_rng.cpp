#include "core/base/counter_rng.h"

#include "core/base/hash.h"

#include <ATen/Parallel.h>
#include <ATen/native/Math.h>

#include <array>
#include <cmath>

namespace titan {
namespace {

using Block = std::array<uint32_t, 4>;

// Philox4x32 with 10 rounds: the 128-bit counter `ctr` under the 64-bit key.
Block philox(Block ctr, uint64_t key) {
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53} * ctr[0];
    const uint64_t p1 = uint64_t{0xCD9E8D57} * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ k0, static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ k1, static_cast<uint32_t>(p0)};
    k0 += 0x9E3779B9;
    k1 += 0xBB67AE85;
  }
  return ctr;
}


// Two uniform doubles of element k: u1 in (0, 1], u2 in [0, 1), 53 bits each.
std::pair<double, double> uniforms(uint64_t key, int64_t k) {
  const auto idx = static_cast<uint64_t>(k);
  const Block b = philox({static_cast<uint32_t>(idx), static_cast<uint32_t>(idx >> 32), 0, 0}, key);
  const double scale = 1.0 / 9007199254740992.0;  // 2^-53
  const uint64_t a = ((uint64_t{b[0]} << 32) | b[1]) >> 11;
  const uint64_t c = ((uint64_t{b[2]} << 32) | b[3]) >> 11;
  return {(static_cast<double>(a) + 1.0) * scale, static_cast<double>(c) * scale};
}

template <class F>
void fill(at::Tensor& out, int64_t first, F draw) {
  TORCH_CHECK(out.is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "counter rng: out must be a contiguous CPU fp32 tensor");
  float* p = out.data_ptr<float>();
  at::parallel_for(0, out.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) p[j] = static_cast<float>(draw(first + j));
  });
}

}  // namespace

uint64_t param_stream_key(uint64_t seed, const std::string& name) {
  const uint64_t h = fnv1a(kFnv1aOffset, name.data(), name.size());
  return splitmix64(splitmix64(seed) ^ h);
}

void counter_normal_(at::Tensor& out, uint64_t key, int64_t first, double std) {
  const double two_pi = 6.283185307179586;
  fill(out, first, [&](int64_t k) {
    auto [u1, u2] = uniforms(key, k);
    return std * std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2);  // Box-Muller
  });
}

void counter_trunc_normal_(at::Tensor& out, uint64_t key, int64_t first, double std, double lo,
                           double hi) {
  auto cdf = [](double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))); };
  const double a = cdf(lo / std), b = cdf(hi / std);
  fill(out, first, [&](int64_t k) {
    const double u = uniforms(key, k).second;
    const double v = 2.0 * (a + u * (b - a)) - 1.0;  // in [2a - 1, 2b - 1]
    const double z = calc_erfinv(v) * std * std::sqrt(2.0);
    return std::min(std::max(z, lo), hi);
  });
}

}  // namespace titan
