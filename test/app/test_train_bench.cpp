// The titan side of scripts/bench_cpu.sh: training steps of a Llama-3 (or Llama-4 MoE) model
// of the sizes in BENCH_* environment variables, through the product's Model, train_step
// and fused AdamW, on random tokens like test/reference/train_ref.py. Hidden (tag
// [.trainbench]): never run by ctest. Prints one JSON line: per-step tokens/s, peak RSS
// before the first step and at the end (KiB), and the counting allocator's step peak.
#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <sys/resource.h>

#include <algorithm>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "app/train_step.h"
#include "core/telemetry/memory_stats.h"
#include "models/llama3.h"
#include "models/llama4.h"

using namespace titan;

namespace {

int64_t env_int(const char* name, int64_t def) {
  const char* v = std::getenv(name);
  return v && *v ? std::stoll(v) : def;
}

int64_t max_rss_kib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

std::unique_ptr<Model> bench_model(int64_t seq) {
  // The shape knobs both families share (Llama3Args and Llama4Args name them alike).
  auto shape = [seq](auto& a) {
    a.dim = env_int("BENCH_DIM", 256);
    a.n_layers = env_int("BENCH_LAYERS", 6);
    a.n_heads = env_int("BENCH_HEADS", 16);
    a.n_kv_heads = env_int("BENCH_KV_HEADS", a.n_heads);
    a.vocab_size = env_int("BENCH_VOCAB", 2048);
    a.max_seq_len = std::max<int64_t>(2048, seq);
  };
  const int64_t experts = env_int("BENCH_EXPERTS", 0);
  if (experts > 0) {
    Llama4Args a = llama4_flavor("debugmodel");
    shape(a);
    a.moe.num_experts = experts;
    a.moe.top_k = env_int("BENCH_TOP_K", 1);
    a.moe.backend = ExpertsBackend::Loop;
    return std::make_unique<Llama4>(a, at::kCPU);
  }
  Llama3Args a = llama3_flavor("debugmodel");
  shape(a);
  return std::make_unique<Llama3>(a, at::kCPU);
}

}  // namespace

TEST_CASE("bench: training steps of a configurable model on random tokens", "[.trainbench]") {
  install_cpu_memory_counter();  // as main() does
  const int64_t B = env_int("BENCH_BATCH", 8), T = env_int("BENCH_SEQ", 256);
  const int64_t steps = env_int("BENCH_STEPS", 20);
  std::unique_ptr<Model> model = bench_model(T);
  model->init_weights(0);
  // torch.optim.AdamW(model.parameters(), weight_decay=0.1, fused=True), as train_ref.py:
  // every parameter decays. Fields by name: a positional list once put "fused" into a field
  // added later, and the bench silently measured the per-tensor loop optimizer.
  std::vector<bool> decay(model->params().all().size(), true);
  OptimizerSection oc;
  oc.name = "AdamW";
  oc.lr = 8e-4;
  oc.beta1 = 0.9;
  oc.beta2 = 0.95;
  oc.eps = 1e-8;
  oc.weight_decay = 0.1;
  oc.weight_decay_scope = "all";
  oc.implementation = "fused";
  Optimizer opt(model->params().tensors(), decay, oc);
  const int64_t V = model->info().vocab_size;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const int64_t rss_before = max_rss_kib();
  reset_cpu_memory_peak();
  std::string tps = "[";
  for (int64_t s = 0; s < steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor buf = at::randint(V, {B, T + 1}, gen, at::kLong);
    std::vector<MicroBatch> mb{{buf.slice(1, 0, T), buf.slice(1, 1, T + 1)}};
    StepObjective obj;
    obj.global_tokens = static_cast<double>(B * T);
    obj.max_norm = 1.0;
    StepDrivers o;
    o.lr = 8e-4;
    StepResult r = train_step(*model, opt, mb, obj, o);
    (void)r.loss.item<double>();  // the log read the reference makes too
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tps += (s ? "," : "") + std::to_string(static_cast<double>(B * T) / sec);
  }
  std::printf("{\"tps\": %s], \"rss_before_kib\": %lld, \"rss_peak_kib\": %lld, "
              "\"alloc_peak_bytes\": %lld}\n",
              tps.c_str(), static_cast<long long>(rss_before),
              static_cast<long long>(max_rss_kib()),
              static_cast<long long>(cpu_memory_stats().peak));
  std::fflush(stdout);
}
