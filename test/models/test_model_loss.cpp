// Model::token_loss_sum, the fused and chunked output projection + cross-entropy, against the
// unfused path of the same model (logits materialized, then titan::token_loss_sum): every
// family, tied and untied output, with gradient accumulation over two micro-batches. Loss to
// 1e-6 and gradients to 1e-5 relative (max|a - b| / max|b|), fp32 on the CPU. And the peak
// CPU memory of a step with vocab 32768 falls by at least the fp32 logits' size.
#include <catch2/catch.hpp>

#include <functional>
#include <memory>

#include "core/telemetry/memory_stats.h"
#include "models/deepseek_v3.h"
#include "models/llama3.h"
#include "models/llama4.h"
#include "test_util.h"

using namespace titan;

namespace {

struct LossAndGrads {
  double loss = 0;
  std::vector<at::Tensor> grads;
};

// Two micro-batches (one with ignored labels), each loss / tokens backpropagated, as the
// train step does; the MoE auxiliary loss is added when the model has one.
LossAndGrads accumulate(Model& m, bool fused) {
  m.set_fused_loss(fused);
  for (auto& p : m.params().all()) p.value.mutable_grad() = at::Tensor();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t V = m.info().vocab_size, B = 2, T = 24;
  LossAndGrads r;
  for (int mb = 0; mb < 2; ++mb) {
    at::Tensor tok = at::randint(V, {B, T}, gen, at::kLong);
    at::Tensor lab = at::randint(V, {B, T}, gen, at::kLong);
    if (mb == 1) lab.slice(1, 0, 5).fill_(-100);
    at::Tensor loss = m.token_loss_sum(tok, lab) / static_cast<double>(2 * B * T);
    at::Tensor aux = m.aux_loss();
    (aux.defined() ? loss + aux : loss).backward();
    r.loss += loss.item<double>();
  }
  for (auto& p : m.params().all()) r.grads.push_back(p.value.grad().clone());
  return r;
}

void check_fused_equals_unfused(Model& m) {
  LossAndGrads fused = accumulate(m, true);
  LossAndGrads ref = accumulate(m, false);
  const double e_loss = std::abs(fused.loss - ref.loss) / std::abs(ref.loss);
  INFO("loss " << fused.loss << " against " << ref.loss << ", rel " << e_loss);
  CHECK(e_loss <= 1e-6);
  double worst = 0;
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    INFO(m.params()[static_cast<int64_t>(i)].name);
    const double e = test::rel_err(fused.grads[i], ref.grads[i]);
    worst = std::max(worst, e);
    CHECK(e <= 1e-5);
  }
  WARN(m.info().name << ": loss rel " << e_loss << ", worst gradient rel " << worst);
}

}  // namespace

TEST_CASE("model loss: fused equals unfused for llama3, untied and tied", "[loss][llama3]") {
  Llama3Args a = llama3_flavor("debugmodel");
  a.n_layers = 2;
  for (bool tie : {false, true}) {
    a.tie_embeddings = tie;
    Llama3 m(a, at::kCPU);
    m.init_weights(3);
    INFO("tie_embeddings " << tie);
    check_fused_equals_unfused(m);
  }
}

TEST_CASE("model loss: fused equals unfused for llama4 and deepseek_v3", "[loss][moe]") {
  Llama4Args l4 = llama4_flavor("debugmodel");
  l4.n_layers = 2;
  Llama4 m4(l4, at::kCPU);
  m4.init_weights(3);
  check_fused_equals_unfused(m4);

  DeepSeekV3Args ds = deepseek_v3_flavor("debugmodel");
  ds.n_layers = 2;
  ds.moe.seq_aux_loss_coeff = 1e-3;  // the auxiliary loss rides along with the fused loss
  DeepSeekV3 m3(ds, at::kCPU);
  m3.init_weights(3);
  check_fused_equals_unfused(m3);
}

TEST_CASE("model loss: the fused loss removes the logits from a step's peak CPU memory",
          "[loss][memory]") {
  install_cpu_memory_counter();
  REQUIRE(cpu_memory_counter_installed());
  Llama3Args a = llama3_flavor("debugmodel");
  a.n_layers = 1;
  a.dim = 64;
  a.n_heads = 4;
  a.n_kv_heads = 4;
  a.vocab_size = 32768;
  Llama3 m(a, at::kCPU);
  m.init_weights(1);
  const int64_t B = 2, T = 256;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  at::Tensor tok = at::randint(a.vocab_size, {B, T}, gen, at::kLong);
  auto step_peak = [&](bool fused) {
    m.set_fused_loss(fused);
    for (auto& p : m.params().all()) p.value.mutable_grad() = at::Tensor();
    const int64_t base = cpu_memory_stats().allocated;
    reset_cpu_memory_peak();
    (m.token_loss_sum(tok, tok) / static_cast<double>(B * T)).backward();
    return cpu_memory_stats().peak - base;
  };
  (void)step_peak(true);  // warm-up: one-time allocations (thread pools, oneDNN) out of the way
  (void)step_peak(false);
  const int64_t fused = step_peak(true), unfused = step_peak(false);
  const int64_t logits_bytes = B * T * a.vocab_size * 4;  // 64 MiB
  WARN("step peak above the parameters: fused " << fused / (1 << 20) << " MiB, unfused "
                                                << unfused / (1 << 20) << " MiB, fp32 logits "
                                                << logits_bytes / (1 << 20) << " MiB");
  CHECK(unfused - fused >= logits_bytes);
}
