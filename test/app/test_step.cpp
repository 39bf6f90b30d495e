// The capture-ready step (docs/training.md): a non-logging step reads nothing from the device,
// the learning rate reaches the fused AdamW as a tensor, gradients and inputs keep their
// storage from step to step. Host reads are counted at run time through a RecordFunction
// callback: every .item() (and bool() of a tensor) dispatches aten::_local_scalar_dense, and
// the ops that size their output from tensor values (nonzero, masked_select and boolean-mask
// indexing, unique, bincount) must read the device too. The CPU fused AdamW kernel reads its
// own CPU lr tensor with .item(); on CUDA it reads device memory, so reads inside
// aten::_fused_adamw_ are not counted. Also the CPU memory columns of the metrics.
#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <set>

#include "app/train_step.h"
#include "core/config/config.h"
#include "models/registry.h"
#include "test_util.h"

using namespace titan;

namespace {

// The ops that read device values to the host: _local_scalar_dense (.item()), and the ops whose
// output size depends on the values. Not here: repeat_interleave, which reads only without
// its output_size argument (the RecordFunction does not show which), and copies to the CPU,
// which a CPU-only step cannot tell from local copies (scripts/check_host_reads.py covers
// both statically).
bool reads_host(const std::string& op) {
  static const std::set<std::string> ops = {
      "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique",
      "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
      "aten::unique_dim_consecutive", "aten::bincount"};
  return ops.count(op) > 0;
}

// Counts host reads (reads_host, outermost only) outside aten::_fused_adamw_ while installed,
// with the op that called each, for the failure message.
struct HostReadCounter {
  static inline std::atomic<int> reads{0}, fused_calls{0};
  static inline thread_local std::vector<std::string> stack;
  static inline std::mutex mu;
  static inline std::set<std::string> callers;
  at::CallbackHandle handle;

  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    const std::string name = fn.name();
    const bool in_fused =
        std::find(stack.begin(), stack.end(), "aten::_fused_adamw_") != stack.end();
    if (name == "aten::_fused_adamw_") ++fused_calls;
    const bool in_read = std::any_of(stack.begin(), stack.end(), reads_host);
    if (reads_host(name) && !in_fused && !in_read) {
      ++reads;
      std::lock_guard<std::mutex> lk(mu);
      callers.insert(name + " in " + (stack.empty() ? "(top level)" : stack.back()));
    }
    stack.push_back(name);
    return nullptr;
  }
  static void exit(const at::RecordFunction&, at::ObserverContext*) {
    if (!stack.empty()) stack.pop_back();
  }
  HostReadCounter() {
    reads = 0;
    fused_calls = 0;
    callers.clear();
    handle = at::addGlobalCallback(at::RecordFunctionCallback(&enter, &exit));
  }
  ~HostReadCounter() { at::removeCallback(handle); }
  static std::string describe() {
    std::string s;
    for (auto& c : callers) s += c + " ";
    return s;
  }
};

std::vector<MicroBatch> random_batches(int64_t n, int64_t B, int64_t T, int64_t vocab,
                                       uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<MicroBatch> out;
  for (int64_t i = 0; i < n; ++i)
    out.push_back({at::randint(vocab, {B, T}, gen, at::kLong),
                   at::randint(vocab, {B, T}, gen, at::kLong)});
  return out;
}

struct Setup {
  std::unique_ptr<Model> model;
  std::unique_ptr<Optimizer> opt;
  std::vector<MicroBatch> micro;
  StepObjective obj;
  StepDrivers d;
};

Setup make_setup(const std::string& name) {
  JobConfig cfg = default_config();
  cfg.model.name = name;
  cfg.model.flavor = "debugmodel";
  Setup s;
  s.model = build_model(cfg, at::kCPU);
  std::vector<bool> decay;
  for (auto& p : s.model->params().all()) decay.push_back(p.weight_decay);
  s.opt = std::make_unique<Optimizer>(s.model->params().tensors(), decay, cfg.optimizer);
  s.micro = random_batches(2, 2, 32, s.model->info().vocab_size, 5);  // 2 micro-batches
  s.obj.global_tokens = 2 * 2 * 32;
  s.obj.max_norm = 1.0;
  s.d.lr = 1e-3;
  return s;
}

}  // namespace

TEST_CASE("step: a non-logging dense step makes no host read", "[step]") {
  Setup s = make_setup("llama3");
  (void)train_step(*s.model, *s.opt, s.micro, s.obj, s.d);  // the first step allocates the state
  StepResult r;
  {
    HostReadCounter c;
    r = train_step(*s.model, *s.opt, s.micro, s.obj, s.d);
    INFO("host reads called from: " << HostReadCounter::describe());
    CHECK(HostReadCounter::reads == 0);
    CHECK(HostReadCounter::fused_calls == 2);  // the counter sees ops: both parameter groups
    // The logging step's read is what the counter counts (so it can fail), and so is an op
    // sized by values.
    (void)r.loss.item<double>();
    CHECK(HostReadCounter::reads == 1);
    (void)at::nonzero(r.grad_norm.view({1}));
    CHECK(HostReadCounter::reads == 2);
  }
  CHECK(std::isfinite(r.grad_norm.item<double>()));
}

TEST_CASE("step: MoE steps read only the loop backend's counts", "[step][moe]") {
  // On the CPU the loop backend's counts reach the host through data_ptr, not .item(), so the
  // count here is of every other read: there must be none.
  for (const char* name : {"llama4", "deepseek_v3"}) {
    INFO(name);
    Setup s = make_setup(name);
    (void)train_step(*s.model, *s.opt, s.micro, s.obj, s.d);
    HostReadCounter c;
    (void)train_step(*s.model, *s.opt, s.micro, s.obj, s.d);
    INFO("host reads called from: " << HostReadCounter::describe());
    CHECK(HostReadCounter::reads == 0);
  }
}

// On CUDA the step computes in bf16 from casts of the fp32 masters, kept from one optimizer
// step to the next. at::_fused_adamw_ bumps no version counter, so only train_step's
// weights_updated() refreshes them: without it every forward saw the initial weights (the
// first GPU run's flat losses). Here the same path on the CPU: the same batch, three steps,
// and the loss must fall (it was bitwise constant before the fix).
TEST_CASE("step: bf16 compute casts follow every optimizer step", "[step]") {
  for (const char* name : {"llama3", "deepseek_v3"}) {
    INFO(name);
    Setup s = make_setup(name);
    s.model->set_compute_dtype(at::kBFloat16);
    s.d.lr = 3e-3;
    std::vector<double> loss;
    for (int i = 0; i < 3; ++i)
      loss.push_back(train_step(*s.model, *s.opt, s.micro, s.obj, s.d).loss.item<double>());
    INFO("losses " << loss[0] << " " << loss[1] << " " << loss[2]);
    CHECK(loss[1] < loss[0]);
    CHECK(loss[2] < loss[0]);
    CHECK(loss[2] != loss[1]);  // each step's forward sees the previous update
  }
}

TEST_CASE("step: lr tensor, in-place gradients and persistent inputs", "[step]") {
  Setup s = make_setup("llama3");
  StepInputs inputs;
  (void)train_step(*s.model, *s.opt, inputs.stage(s.micro), s.obj, s.d);
  // The fused kernel's learning rate is a 0-d tensor holding the step's lr exactly.
  const at::Tensor& lr = s.opt->lr_tensor();
  CHECK(lr.dim() == 0);
  CHECK(lr.scalar_type() == at::kDouble);
  CHECK(lr.item<double>() == s.d.lr);
  // Gradients were zeroed in place: defined, zero, and the same storage after another step.
  std::vector<const void*> where;
  for (auto& p : s.model->params().tensors()) {
    REQUIRE(p.grad().defined());
    CHECK(p.grad().abs().max().item<double>() == 0);
    where.push_back(p.grad().data_ptr());
  }
  const void* tokens_at = inputs.stage(s.micro)[0].tokens.data_ptr();
  std::vector<MicroBatch> next = random_batches(2, 2, 32, s.model->info().vocab_size, 6);
  s.d.lr = 5e-4;
  const std::vector<MicroBatch>& staged = inputs.stage(next);
  (void)train_step(*s.model, *s.opt, staged, s.obj, s.d);
  CHECK(lr.item<double>() == 5e-4);
  size_t i = 0;
  for (auto& p : s.model->params().tensors()) CHECK(p.grad().data_ptr() == where[i++]);
  // The inputs went through the same buffers, holding the new batch.
  CHECK(inputs.allocations() == 1);
  CHECK(staged[0].tokens.data_ptr() == tokens_at);
  CHECK(at::equal(staged[1].labels, next[1].labels));
  CHECK(staged[0].tokens.data_ptr() != next[0].tokens.data_ptr());
}

namespace {

nlohmann::json step_metrics(const std::string& dump, int64_t step) {
  auto m = test::training_metrics(dump + "/metrics.jsonl");
  return m.count(step) ? m[step] : nlohmann::json();
}

}  // namespace

TEST_CASE("step: CPU runs log allocated and peak memory that grow with the batch", "[step]") {
  test::TempDir dir("mem");
  double extra[2] = {0, 0};  // peak - allocated after the step: the step's transient memory
  int k = 0;
  for (int64_t batch : {2, 8}) {
    const std::string dump = dir.file("b" + std::to_string(batch));
    auto r = test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " +
                       test::binary() +
                       " --config configs/llama3_debug.toml --training.steps 2 "
                       "--metrics.log_freq 1 --validation.enable false --training.seq_len 256 "
                       "--metrics.enable_tensorboard false --training.local_batch_size " +
                       std::to_string(batch) + " --job.dump_folder " + dump);
    INFO(r.out);
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Catch::Matchers::Contains("GiB(cpu alloc/peak) rss"));
    nlohmann::json j = step_metrics(dump, 2);  // step 2's own peak (the log resets it)
    REQUIRE(j.is_object());
    CHECK(j["memory_kind"] == "cpu");
    const double alloc = j["memory_gib"].get<double>(), peak = j["memory_peak_gib"].get<double>();
    CHECK(alloc > 0);
    CHECK(peak > alloc);
    CHECK(j["memory_rss_gib"].get<double>() >= peak);
    extra[k++] = peak - alloc;
    WARN("batch " << batch << ": allocated " << alloc << " GiB, peak " << peak << " GiB, rss "
                  << j["memory_rss_gib"].get<double>() << " GiB");
  }
  // Activations scale with the batch: 4x the batch holds at least 3x the transient memory.
  CHECK(extra[1] >= 3 * extra[0]);
}
