#include "app/compiled_step.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include "core/base/errors.h"
#include "core/telemetry/cuda_info.h"

// The graph API needs the CUDA runtime headers (the wheel is a CUDA build, so they are here
// whenever nvcc is); a CPU-only LibTorch builds the CPU check only.
#if __has_include(<ATen/cuda/CUDAGraph.h>) && __has_include(<cuda_runtime_api.h>)
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define TITAN_CUDA_GRAPHS 1
#endif

namespace titan {

void check_compile_config(const JobConfig& cfg, bool moe_model, bool loop_experts) {
  if (!cfg.compile.enable) return;
  const std::string why = "compile.enable = true captures the train step, which ";
  if (cfg.parallelism.expert_parallel_degree > 1 && cfg.moe.ep_exchange == "exact")
    throw UserError("moe.ep_exchange = \"exact\" with parallelism.expert_parallel_degree = " +
                    std::to_string(cfg.parallelism.expert_parallel_degree) + ": " + why +
                    "cannot hold the exact exchange (its all-to-all splits are token counts "
                    "read on the host); allowed with compile.enable: \"static\" or \"auto\"");
  if (cfg.optimizer.implementation == "for-loop")
    throw UserError("optimizer.implementation = \"for-loop\": " + why +
                    "cannot hold (the reference AdamW reads each step count on the host); "
                    "allowed with compile.enable: \"fused\", \"foreach\"");
  if (moe_model && loop_experts)
    throw UserError(
        "moe.experts_backend = \"" + cfg.moe.experts_backend + "\" runs the loop experts here, " +
        why +
        "cannot hold: the loop reads the per-expert token counts on the host in every MoE "
        "layer; allowed with compile.enable: auto, grouped_mm (CUDA 9.x/10.x), cutlass (CUDA "
        "8.0+), or compile.enable = false");
  std::vector<std::string> c = cfg.compile.components;
  std::sort(c.begin(), c.end());
  if (c != std::vector<std::string>{"loss", "model"})
    throw UserError(
        "compile.components lists only part of [\"model\", \"loss\"]: titan-train captures the "
        "whole step (the model's blocks and the loss in one graph, with the optimizer in a "
        "second), so it cannot capture one without the other; allowed: [\"model\", \"loss\"] "
        "(the default), or compile.enable = false");
}

std::string step_inputs_key(const std::vector<MicroBatch>& micro) {
  std::ostringstream os;
  for (const auto& mb : micro)
    os << mb.tokens.sizes() << mb.labels.sizes() << mb.tokens.device() << '@'
       << mb.tokens.data_ptr() << ',' << mb.labels.data_ptr() << ';';
  return os.str();
}

#ifdef TITAN_CUDA_GRAPHS
struct CompiledStep::Graphs {
  c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
  std::unique_ptr<at::cuda::CUDAGraph> fwdbwd, opt;
  at::Tensor loss, grad_norm;  // static outputs, rewritten by every replay
};
#else
struct CompiledStep::Graphs {};
#endif

CompiledStep::CompiledStep(StepPhases& phases, bool cuda, int64_t warmup_steps)
    : phases_(phases), cuda_(cuda), warmup_(cuda ? warmup_steps : 1) {
  if (!cuda_) {
    // The warm-up step runs outside the check (as on CUDA, before the capture): the first
    // checked step is the reference.
    check_ = std::make_unique<CaptureCheck>(/*warmup_steps=*/0);
    return;
  }
#ifdef TITAN_CUDA_GRAPHS
  graphs_ = std::make_unique<Graphs>();
#else
  throw UserError(
      "compile.enable = true on CUDA: this LibTorch has no CUDA graph API; "
      "allowed: compile.enable = false");
#endif
}

CompiledStep::~CompiledStep() = default;

namespace {

// The CPU capture check as the step's executor: the two parts are the checked step; the
// host work between them (the overflow flag's read, an overflowed step's re-run) is outside
// it, as it is outside both graphs on CUDA.
class CheckedExecutor : public StepExecutor {
 public:
  CheckedExecutor(CaptureCheck& check, std::string key) : check_(check), key_(std::move(key)) {}
  at::Tensor forward_backward(const std::function<at::Tensor()>& part) override {
    check_.begin_step(key_);
    return part();
  }
  void between(const std::function<void()>& host_work) override {
    check_.pause();
    host_work();
    check_.resume();
  }
  at::Tensor optimizer(const std::function<at::Tensor()>& part) override {
    at::Tensor norm = part();
    compared = check_.end_step();
    return norm;
  }
  bool compared = false;

 private:
  CaptureCheck& check_;
  std::string key_;
};

}  // namespace

StepResult CompiledStep::step(const std::vector<MicroBatch>& micro, const StepDrivers& d) {
  if (d.ep && d.ep->exact_only()) {
    // Past the expert-parallel capacity cap the exact exchange runs, which reads its splits
    // on the host: the step runs eagerly, neither captured nor checked (the cap's warning
    // said so once), with the same phases (a pipeline's stay a pipeline's).
    if (graphs_) graphs_ = std::make_unique<Graphs>();  // releases the graphs and their pool
    key_.clear();
    return run_step(phases_, micro, d);
  }
  // The capture follows the input shapes and buffers and the exchange's capacity.
  const std::string key = step_inputs_key(micro) + (d.ep ? d.ep->capture_key() : "");
  if (key != key_) {  // new shapes or buffers (or the first step): warm up, then capture
    key_ = key;
    warm_ = 0;
  }
  if (cuda_) return step_cuda(micro, d);
  if (warm_ < warmup_) {  // the warm-up step, eagerly: the same path as CUDA's warm-up
    ++warm_;
    return run_step(phases_, micro, d);
  }
  // As on CUDA: the lr is written before the step (outside what is checked), then the
  // phases run as the graphs would hold them.
  CheckedExecutor ex(*check_, key);
  StepResult r = run_step(phases_, micro, d, ex);
  if (ex.compared && !reported_) {
    report_ = check_->summary();
    reported_ = true;
  }
  return r;
}

std::string CompiledStep::take_report() {
  std::string r = std::move(report_);
  report_.clear();
  return r;
}

#ifdef TITAN_CUDA_GRAPHS

namespace {

// A replay changes the parameters on the device without running the host code that bumps
// their version counters, so caches keyed by the version (the bf16 weight casts of
// Model::weight) would go stale for eager use between replays (validation). Bumped after
// every replay, and before a capture so that the capture records the casts.
void bump_versions(Model& model) {
  for (auto& p : model.params().tensors()) p.unsafeGetTensorImpl()->bump_version();
}

}  // namespace

namespace {

// The CUDA graphs as the step's executors: one records the two parts into the graphs (and
// runs nothing), the other replays them; the host work between the parts runs between the
// replays.
class GraphRecorder : public StepExecutor {
 public:
  GraphRecorder(at::cuda::CUDAGraph& fwdbwd, at::cuda::CUDAGraph& opt, at::cuda::MempoolId_t pool,
                const char*& phase)
      : fwdbwd_(fwdbwd), opt_(opt), pool_(pool), phase_(phase) {}
  at::Tensor forward_backward(const std::function<at::Tensor()>& part) override {
    fwdbwd_.capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
    at::Tensor loss = part();
    fwdbwd_.capture_end();
    return loss;
  }
  void between(const std::function<void()>&) override {}  // nothing ran: nothing to settle
  at::Tensor optimizer(const std::function<at::Tensor()>& part) override {
    phase_ = "clip+AdamW";
    opt_.capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
    at::Tensor norm = part();
    opt_.capture_end();
    return norm;
  }

 private:
  at::cuda::CUDAGraph& fwdbwd_;
  at::cuda::CUDAGraph& opt_;
  at::cuda::MempoolId_t pool_;
  const char*& phase_;
};

class GraphReplayer : public StepExecutor {
 public:
  GraphReplayer(at::cuda::CUDAGraph& fwdbwd, at::cuda::CUDAGraph& opt, at::Tensor loss,
                at::Tensor grad_norm)
      : fwdbwd_(fwdbwd), opt_(opt), loss_(std::move(loss)), grad_norm_(std::move(grad_norm)) {}
  at::Tensor forward_backward(const std::function<at::Tensor()>&) override {
    fwdbwd_.replay();
    return loss_;  // the graph's static output, rewritten by the replay
  }
  at::Tensor optimizer(const std::function<at::Tensor()>&) override {
    opt_.replay();
    return grad_norm_;
  }

 private:
  at::cuda::CUDAGraph& fwdbwd_;
  at::cuda::CUDAGraph& opt_;
  at::Tensor loss_, grad_norm_;
};

}  // namespace

StepResult CompiledStep::step_cuda(const std::vector<MicroBatch>& micro, const StepDrivers& d) {
  Graphs& g = *graphs_;
  if (warm_ == 0) {  // a new key: the old graphs go
    g.fwdbwd.reset();
    g.opt.reset();
  }
  if (warm_ < warmup_ || !g.fwdbwd) {
    auto current = c10::cuda::getCurrentCUDAStream();
    at::cuda::CUDAEvent before, after;
    before.record(current);
    before.block(g.stream);
    StepResult r;
    {
      c10::cuda::CUDAStreamGuard guard(g.stream);
      if (warm_ < warmup_) {
        r = run_step(phases_, micro, d);  // the eager warm-up: its phase marks are on g.stream
        ++warm_;
      } else {
        capture(micro, d);
      }
    }
    after.record(g.stream);
    after.block(current);
    if (!g.fwdbwd) return r;  // a warm-up step
  }
  // Replay on the current stream (the loader's copies into the inputs are ordered before),
  // with the phase marks (CUDA events) around the two graphs; between them the
  // expert-parallel overflow flag (one small read) and, if a pair overflowed, the step's
  // eager re-run with the exact exchange into the same gradients. The lr is written before
  // the first replay: each replay reads this step's lr.
  GraphReplayer ex(*g.fwdbwd, *g.opt, g.loss, g.grad_norm);
  StepResult r = run_step(phases_, micro, d, ex);
  bump_versions(phases_.model());
  ++replays_;
  comm_.replay();  // the replay ran the captured collectives without the host counting them
  return r;
}

void CompiledStep::capture(const std::vector<MicroBatch>& micro, const StepDrivers& drivers) {
  Graphs& g = *graphs_;
  StepDrivers d = drivers;
  d.timer = nullptr;  // no events inside the graphs: the replays are marked instead
  // Capturing records the kernels without running them; the replay that follows runs them.
  // One private pool for both graphs: the second may reuse what the first freed, and the
  // static outputs (loss, norm) stay allocated in it. Thread-local capture mode: the
  // loader's thread may copy on its own stream meanwhile; the autograd engine's device thread
  // launches backward onto the capturing stream, which records it.
  // The eager warm-up's cached blocks go back to the driver first: the graphs' private pool
  // then takes free memory instead of sitting beside blocks no eager step will use again
  // (between replays only validation and the log step allocate outside the pool).
  const int dev = static_cast<int>(c10::cuda::current_device());
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double eager_reserved = static_cast<double>(cuda_memory_stats(dev).reserved) / gib;
  cuda_release_cached_memory();
  const at::cuda::MempoolId_t pool = at::cuda::graph_pool_handle();
  bump_versions(phases_.model());
  g.fwdbwd = std::make_unique<at::cuda::CUDAGraph>();
  g.opt = std::make_unique<at::cuda::CUDAGraph>();
  const char* phase = "forward+backward";
  comm_.begin();  // the collectives issued while capturing are recorded, not run
  try {
    GraphRecorder ex(*g.fwdbwd, *g.opt, pool, phase);
    const StepResult r = run_step(phases_, micro, d, ex);
    g.loss = r.loss;
    g.grad_norm = r.grad_norm;
  } catch (const std::exception& e) {
    // Not a user error: something on the step's path cannot be captured. The CPU capture
    // check names the op and module of most such breaks.
    TORCH_CHECK(false, "compile.enable: capturing the ", phase,
                " graph of the train step failed (run the same config on the CPU for the "
                "capture check's diagnosis, or set compile.enable = false): ",
                e.what());
  }
  comm_.end();
  ++captures_;
  std::ostringstream os;
  const double captured_reserved = static_cast<double>(cuda_memory_stats(dev).reserved) / gib;
  os.setf(std::ios::fixed);
  os.precision(2);
  os << "compile: captured the train step as 2 CUDA graphs after " << warm_
     << " eager warm-up steps (capture " << captures_ << "); reserved memory " << captured_reserved
     << " GiB captured against " << eager_reserved << " GiB after the eager warm-up";
  if (!comm_.empty()) {
    os << "; each replay runs the collectives the capture recorded:";
    for (const auto& [kind, c] : comm_.record()) os << " " << kind << " " << c.calls;
  }
  report_ = os.str();
}

#else

StepResult CompiledStep::step_cuda(const std::vector<MicroBatch>&, const StepDrivers&) {
  TORCH_CHECK(false, "CompiledStep: built without the CUDA graph API");
}

void CompiledStep::capture(const std::vector<MicroBatch>&, const StepDrivers&) {}

#endif

}  // namespace titan
