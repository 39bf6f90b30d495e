// The CPU capture check (core/train/capture_check.h) on small synthetic steps: a static step
// passes with its op count; each kind of break (another op, a new shape, a host scalar that
// changes, a host read, a collective-like scope that changes size) is reported with the op,
// the module and the reason; a new input shape starts a new reference instead of failing.
#include <catch2/catch.hpp>

#include <functional>

#include "core/base/errors.h"
#include "core/train/capture_check.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

// A tiny "model": two layers of (matmul, relu) with autograd, in module scopes.
at::Tensor tiny_step(const at::Tensor& w, int64_t rows, double scale,
                     const std::function<void(const at::Tensor&)>& in_layer1 = nullptr) {
  at::Tensor h = at::ones({rows, 4});
  for (int64_t l = 0; l < 2; ++l) {
    ModuleScope layer("layers", l);
    ModuleScope sub("feed_forward");
    h = at::relu(at::matmul(h, w)).mul(scale);
    if (l == 1 && in_layer1) in_layer1(h);
  }
  at::Tensor loss = h.sum();
  loss.backward();
  return loss.detach();
}

// Runs `steps` steps under a check; step k (1-based) runs body(k). Returns the error text
// ("" when every step passed).
std::string run_steps(CaptureCheck& c, int steps, const std::function<void(int)>& body,
                      const std::function<std::string(int)>& key = nullptr) {
  try {
    for (int k = 1; k <= steps; ++k) {
      c.begin_step(key ? key(k) : "same");
      body(k);
      c.end_step();
    }
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("capture check: a static step passes and counts its ops", "[capture]") {
  at::Tensor w = at::full({4, 4}, 0.5).requires_grad_(true);
  CaptureCheck c(/*warmup_steps=*/1);
  const std::string err = run_steps(c, 4, [&](int) { tiny_step(w, 3, 0.5); });
  CHECK(err.empty());
  INFO(err);
  CHECK(c.steps_compared() == 2);  // steps 3 and 4 against step 2 (step 1 is warm-up)
  // forward and backward ops: at least the 2 matmuls, 2 relus and their backward nodes
  CHECK(c.ops_per_step() >= 8);
  CHECK(c.summary() == "capture check: " + std::to_string(c.ops_per_step()) + " ops per step, static");
}

TEST_CASE("capture check: a planted op names the op, the layer and the sub-module", "[capture]") {
  at::Tensor w = at::full({4, 4}, 0.5).requires_grad_(true);
  CaptureCheck c;
  const std::string err = run_steps(c, 4, [&](int k) {
    tiny_step(w, 3, 0.5, [k](const at::Tensor& h) {
      if (k == 3) (void)at::sigmoid(h);  // the planted break: an op only step 3 runs
    });
  });
  INFO(err);
  CHECK_THAT(err, Contains("aten::sigmoid in layers.1.feed_forward"));
  CHECK_THAT(err, Contains("the op sequence changed between steps"));
  CHECK_THAT(err, Contains("compile.enable"));
}

TEST_CASE("capture check: shape, host scalar and host read breaks give their reasons",
          "[capture]") {
  at::Tensor w = at::full({4, 4}, 0.5).requires_grad_(true);
  SECTION("a shape that changes inside the step") {
    CaptureCheck c;
    const std::string err =
        run_steps(c, 3, [&](int k) { tiny_step(w, k == 3 ? 5 : 3, 0.5); });
    INFO(err);
    CHECK_THAT(err, Contains("aten::ones (in the step itself): input shapes changed between steps"));
  }
  SECTION("a host scalar that changes (a learning rate passed as a double)") {
    CaptureCheck c;
    const std::string err = run_steps(c, 3, [&](int k) { tiny_step(w, 3, 0.5 / k); });
    INFO(err);
    CHECK_THAT(err, Contains("aten::mul in layers.0.feed_forward"));
    CHECK_THAT(err, Contains("a host scalar argument changed between steps"));
  }
  SECTION("a host read of a value, even in the reference step") {
    CaptureCheck c;
    const std::string err = run_steps(c, 2, [&](int) {
      tiny_step(w, 3, 0.5, [](const at::Tensor& h) { (void)h.sum().item<double>(); });
    });
    INFO(err);
    CHECK_THAT(err, Contains("aten::item in layers.1.feed_forward"));
    CHECK_THAT(err, Contains("reads a device value on the host"));
  }
  SECTION("a named host read (the loop experts' counts)") {
    CaptureCheck c;
    const std::string err = run_steps(c, 2, [&](int) {
      ModuleScope m("moe");
      TITAN_HOST_READ_SCOPE();
    });
    CHECK_THAT(err, Contains("titan::host_read in moe"));
  }
  SECTION("a data-sized op") {
    CaptureCheck c;
    const std::string err = run_steps(c, 2, [&](int) { (void)at::nonzero(at::ones({3})); });
    CHECK_THAT(err, Contains("aten::nonzero (in the step itself)"));
  }
  SECTION("a collective that changes size") {
    CaptureCheck c;
    const at::Tensor t4 = at::zeros({4}), t6 = at::zeros({6});  // made outside the steps
    const std::string err = run_steps(c, 3, [&](int k) {
      const at::Tensor& t = k == 3 ? t6 : t4;
      RECORD_USER_SCOPE_WITH_INPUTS("titan::collective:all-to-all",
                                    std::vector<c10::IValue>({t}));
    });
    CHECK_THAT(err, Contains("a collective changes size between steps"));
  }
}

TEST_CASE("capture check: backward ops are named after their forward's module", "[capture]") {
  at::Tensor w = at::full({4, 4}, 0.5).requires_grad_(true);
  CaptureCheck c;
  const std::string err = run_steps(c, 2, [&](int) {
    at::Tensor x;
    {
      ModuleScope layer("layers", 7);
      ModuleScope sub("attention");
      x = at::matmul(at::ones({3, 4}), w);
    }
    x.sum().backward();  // runs outside any module scope
  });
  REQUIRE(err.empty());
  bool node = false, inner = false;
  for (const CapturedOp& op : c.reference()) {
    if (op.name == "MmBackward0") {  // the node (its "evaluate_function" wrapper is outside)
      node = true;
      CHECK(op.module == "layers.7.attention (backward)");
    }
    if (op.name == "aten::mm" && op.module == "layers.7.attention (backward)") inner = true;
  }
  CHECK(node);
  CHECK(inner);  // the ops the backward node runs carry its module too
}

TEST_CASE("capture check: new input shapes start a new reference", "[capture]") {
  at::Tensor w = at::full({4, 4}, 0.5).requires_grad_(true);
  CaptureCheck c;
  // Steps 1-3 at 3 rows, then 4-6 at 5 rows (a new key: warm-up, reference, compare).
  const std::string err = run_steps(
      c, 6, [&](int k) { tiny_step(w, k <= 3 ? 3 : 5, 0.5); },
      [](int k) { return k <= 3 ? std::string("rows3") : std::string("rows5"); });
  CHECK(err.empty());
  CHECK(c.steps_compared() == 2);  // step 3 and step 6
}
