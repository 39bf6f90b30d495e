// AdamW: the three implementations (fused = at::_fused_adamw_ with a tensor learning rate,
// foreach = multi-tensor ATen ops, for-loop = the textbook update read on the host) agree,
// and the fused one equals torch.optim.AdamW. References: the for-loop update, which follows
// the AdamW paper's formula term by term, and torch.optim.AdamW run from the venv
// (test/reference/adamw_ref.py); tolerance 1e-6 relative on the parameters after 6 steps
// (fp32).
#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <sstream>

#include "core/config/config.h"
#include "core/train/optimizer.h"
#include "core/checkpoint/safetensors.h"
#include "test_util.h"

using namespace titan;

namespace {

// `record`: the initial parameters, each step's gradients and learning rates, for the
// Python reference.
std::vector<at::Tensor> run_adamw(const std::string& impl,
                                  std::vector<std::pair<std::string, at::Tensor>>* record = nullptr) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  std::vector<at::Tensor> params;
  for (auto shape : {std::vector<int64_t>{7, 5}, {13}, {3, 4, 6}})
    params.push_back(at::randn(shape, gen).requires_grad_(true));
  if (record)
    for (size_t i = 0; i < params.size(); ++i)
      record->push_back({"param." + std::to_string(i), params[i].detach().clone()});
  OptimizerSection cfg = default_config().optimizer;
  cfg.implementation = impl;
  cfg.weight_decay = 0.1;
  AdamW opt(params, {true, false, true}, cfg);
  std::vector<double> lrs;
  for (int step = 1; step <= 6; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor g = at::randn(params[i].sizes(), gen);
      if (record)
        record->push_back({"grad." + std::to_string(i) + "." + std::to_string(step - 1), g});
      // Written into the gradient the optimizer zeroed in place after the previous step.
      if (params[i].grad().defined())
        params[i].mutable_grad().copy_(g);
      else
        params[i].mutable_grad() = g.clone();
    }
    lrs.push_back(1e-2 / step);
    opt.step(lrs.back());
    opt.zero_grad();
  }
  if (record) {
    record->push_back({"lr", at::tensor(lrs, at::kDouble)});
    record->push_back({"decay", at::tensor(std::vector<int64_t>{1, 0, 1}, at::kLong)});
  }
  std::vector<at::Tensor> out;
  for (auto& p : params) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

TEST_CASE("optimizer: fused, foreach and for-loop AdamW agree", "[optimizer]") {
  auto ref = run_adamw("for-loop");
  for (const char* impl : {"fused", "foreach"}) {
    auto got = run_adamw(impl);
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO(impl << " parameter " << i);
      const double err = (got[i] - ref[i]).abs().max().item<double>() /
                         ref[i].abs().max().item<double>();
      CHECK(err < 1e-6);
    }
  }
  // They did move: the parameters are not the initial ones.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  CHECK_FALSE(at::allclose(ref[0], at::randn({7, 5}, gen)));
}

TEST_CASE("optimizer: fused AdamW equals torch.optim.AdamW", "[optimizer]") {
  test::TempDir dir("adamw");
  std::vector<std::pair<std::string, at::Tensor>> rec;
  auto ours = run_adamw("fused", &rec);
  const OptimizerSection cfg = default_config().optimizer;
  auto num = [](double v) {
    std::ostringstream os;
    os.precision(17);
    os << v;
    return os.str();
  };
  save_safetensors(dir.file("in.safetensors"), rec,
                   {{"beta1", num(cfg.beta1)},
                    {"beta2", num(cfg.beta2)},
                    {"eps", num(cfg.eps)},
                    {"weight_decay", "0.1"},
                    {"steps", "6"}});
  auto r = test::run(test::python() + " " + test::source_dir() + "/test/reference/adamw_ref.py" +
                     " --inputs " + dir.file("in.safetensors") + " --out " +
                     dir.file("out.safetensors"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto ref = SafetensorsFile::open(dir.file("out.safetensors"));
  double worst = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    const double err = test::rel_err(ours[i], ref.get("param." + std::to_string(i)));
    INFO("parameter " << i << " relative error " << err);
    CHECK(err < 1e-6);
    worst = std::max(worst, err);
  }
  WARN("fused AdamW vs torch.optim.AdamW: worst relative error " << worst);
}

TEST_CASE("optimizer: foreach AdamW reading the device lr equals the host-lr update bit for bit",
          "[optimizer][compile]") {
  // The foreach path used to take the lr as a host scalar (which a captured graph would
  // freeze); it now reads AdamW's fp64 lr tensor. Reference: the former host-scalar
  // formula, written out here, over 6 steps with the lr changing every step.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor p = at::randn({9, 4}, gen).requires_grad_(true);
  at::Tensor q = p.detach().clone(), m = at::zeros_like(q), v = at::zeros_like(q);
  OptimizerSection cfg = default_config().optimizer;
  cfg.implementation = "foreach";
  cfg.weight_decay = 0.1;
  AdamW opt({p}, {true}, cfg);
  for (int t = 1; t <= 6; ++t) {
    at::Tensor g = at::randn({9, 4}, gen);
    p.mutable_grad() = g.clone();
    const double lr = 3e-3 / t;
    opt.set_lr(lr);
    opt.step();
    // The host-lr formula: the same ops in the same order with the lr as a double.
    const double bc1 = 1.0 - std::pow(cfg.beta1, t), bc2 = std::sqrt(1.0 - std::pow(cfg.beta2, t));
    q.mul_(1.0 - lr * cfg.weight_decay);
    m.lerp_(g, 1.0 - cfg.beta1);
    v.mul_(cfg.beta2).addcmul_(g, g, 1.0 - cfg.beta2);
    at::Tensor bc1_t = 1.0 - at::pow(cfg.beta1, at::full({}, static_cast<float>(t)));
    at::Tensor bc2_t = (1.0 - at::pow(cfg.beta2, at::full({}, static_cast<float>(t)))).sqrt();
    at::Tensor step = -(1.0 / (bc1_t / lr));
    at::Tensor denom = (v.sqrt() / bc2_t + cfg.eps) / step;
    q.addcdiv_(m, denom);
    (void)bc1;
    (void)bc2;
    INFO("step " << t);
    CHECK(at::equal(p.detach(), q));
  }
}
