// Shard-local initialization (core/base/counter_rng.h, ParamStore::initialize): every rank draws
// only its rows, and the rows are bit-identical to one process's whole tensor for 1, 2 and 4
// ranks (the sharding FSDP applies: chunk = ceil(rows / n), zero padding rows). Reference
// for the distributions: the moments of N(0, std) over 2^17 draws, within 1% (about 4
// standard errors of the std estimate).
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "core/base/counter_rng.h"
#include "core/train/model.h"

using namespace titan;

namespace {

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  InitSpec init;
};

const std::vector<Spec> kSpecs = {
    {"a.weight", {10, 6}, InitSpec::normal(0.02)},
    {"b.weight", {7, 3, 2}, InitSpec::trunc_normal(0.5, -0.6, 0.6)},
    {"c.weight", {3}, InitSpec::ones()},
    {"d.experts", {5, 4, 3}, InitSpec::trunc_normal(0.02)},
};

ParamStore make_store() {
  ParamStore s;
  for (auto& p : kSpecs) s.add(p.name, p.shape, at::kCPU, true, p.init);
  return s;
}

// Cuts every parameter of `s` to rank r of n the way parallel/fsdp.cpp does.
void shard(ParamStore& s, int64_t r, int64_t n) {
  for (Param& p : s.all()) {
    const std::vector<int64_t> global = p.value.sizes().vec();
    const int64_t rows = global[0], chunk = (rows + n - 1) / n;
    const int64_t begin = std::min(rows, r * chunk);
    std::vector<int64_t> shape = global;
    shape[0] = chunk;
    p.global_shape = global;
    p.dim0_offset = begin;
    p.dim0_rows = std::min(rows, begin + chunk) - begin;
    p.value = at::zeros(shape).requires_grad_(true);
  }
}

}  // namespace

TEST_CASE("initial weights are bit-identical for 1, 2 and 4 ranks", "[core][init]") {
  ParamStore whole = make_store();
  whole.initialize(42);
  for (int64_t n : {1, 2, 4}) {
    for (int64_t r = 0; r < n; ++r) {
      ParamStore part = make_store();
      shard(part, r, n);
      part.initialize(42);
      for (int64_t i = 0; i < part.size(); ++i) {
        const Param& p = part[i];
        INFO(p.name << " rank " << r << " of " << n);
        at::Tensor mine = p.value.detach().narrow(0, 0, p.dim0_rows);
        CHECK(at::equal(mine, whole[i].value.detach().narrow(0, p.dim0_offset, p.dim0_rows)));
        const int64_t pad = p.value.size(0) - p.dim0_rows;
        if (pad > 0) CHECK(p.value.detach().narrow(0, p.dim0_rows, pad).abs().sum().item<float>() == 0);
      }
    }
  }
  // Another seed, or another parameter name, gives other values.
  ParamStore other = make_store();
  other.initialize(43);
  CHECK_FALSE(at::equal(other[0].value, whole[0].value));
  CHECK(param_stream_key(42, "a.weight") != param_stream_key(42, "b.weight"));
}

TEST_CASE("counter-based normal and truncated normal draws have the right moments",
          "[core][init]") {
  const int64_t n = 1 << 17;
  at::Tensor x = at::empty({n});
  counter_normal_(x, param_stream_key(1, "x"), 0, 0.02);
  const double mean = x.mean().item<double>(), sd = x.std().item<double>();
  CHECK(std::abs(mean) < 0.01 * 0.02 * 4);
  CHECK(sd == Approx(0.02).epsilon(0.01));
  // Bounds far out: the plain normal. Bounds at +-1.2 std: std of N(0,1) truncated to
  // [-1.2, 1.2] is sqrt(1 - 2 * 1.2 * phi(1.2) / (2 * Phi(1.2) - 1)) = 0.6373 (closed form).
  at::Tensor t = at::empty({n});
  counter_trunc_normal_(t, param_stream_key(1, "t"), 0, 0.5, -0.6, 0.6);
  CHECK(t.max().item<double>() <= 0.6);
  CHECK(t.min().item<double>() >= -0.6);
  const double phi = std::exp(-0.5 * 1.44) / std::sqrt(2 * M_PI);
  const double Phi = 0.5 * (1 + std::erf(1.2 / std::sqrt(2.0)));
  const double expect = 0.5 * std::sqrt(1 - 2 * 1.2 * phi / (2 * Phi - 1));
  CHECK(t.std().item<double>() == Approx(expect).epsilon(0.01));
  // A draw is a function of its index alone: a window starting at 1000 repeats those values.
  at::Tensor w = at::empty({64});
  counter_normal_(w, param_stream_key(1, "x"), 1000, 0.02);
  CHECK(at::equal(w, x.narrow(0, 1000, 64)));
}
