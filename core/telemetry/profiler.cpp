#include "core/telemetry/profiler.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <filesystem>
#include <set>

#include "core/base/errors.h"
#include "core/base/log.h"

namespace titan {
namespace {

namespace kp = torch::profiler::impl;

kp::ProfilerConfig kineto_config() {
  // Input shapes, as torchtitan records them (record_shapes=True); no memory or stack events.
  return kp::ProfilerConfig(kp::ProfilerState::KINETO, /*report_input_shapes=*/true);
}

std::set<kp::ActivityType> activities(bool cuda) {
  std::set<kp::ActivityType> a = {kp::ActivityType::CPU};
  if (cuda) a.insert(kp::ActivityType::CUDA);
  return a;
}

}  // namespace

StepProfiler::StepProfiler(const ProfilingSection& cfg, std::string dump_folder, int64_t rank,
                           bool cuda)
    : cfg_(cfg),
      root_((std::filesystem::path(dump_folder) / cfg.save_traces_folder).string()),
      rank_(rank),
      cuda_(cuda) {
  // libkineto's own log lines (e.g. a failed GPU query on a machine without a driver) are
  // silenced as torchtitan does; an explicit KINETO_LOG_LEVEL wins.
  if (enabled()) setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  if (enabled())
    log_info("=> profiling: the last " + std::to_string(cfg_.profiler_active) + " of every " +
             std::to_string(cfg_.profile_freq) + " steps (after " +
             std::to_string(cfg_.profiler_warmup) + " warmup), Kineto traces under " + root_);
}

StepProfiler::~StepProfiler() {
  step_scope_.reset();
  if (recording_) (void)torch::autograd::profiler::disableProfiler();  // an aborted window
}

StepProfiler::Phase StepProfiler::phase(const ProfilingSection& cfg, int64_t step) {
  const int64_t pos = (step - 1) % cfg.profile_freq;  // 0-based position in its cycle
  const int64_t wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active;
  if (pos < wait) return Phase::Wait;
  return pos < wait + cfg.profiler_warmup ? Phase::Warmup : Phase::Active;
}

std::string StepProfiler::trace_path(int64_t step) const {
  return (std::filesystem::path(root_) / ("iteration_" + std::to_string(step)) /
          ("rank" + std::to_string(rank_) + "_trace.json"))
      .string();
}

void StepProfiler::before_step(int64_t step) {
  if (!enabled()) return;
  const Phase ph = phase(cfg_, step);
  if (ph == Phase::Wait) return;
  if (!prepared_) {
    // Warmup: Kineto sets its buffers (and CUPTI) up now, so the first recorded step does
    // not pay for it.
    torch::autograd::profiler::prepareProfiler(kineto_config(), activities(cuda_));
    prepared_ = true;
  }
  if (ph == Phase::Active && !recording_) {
    torch::autograd::profiler::enableProfiler(kineto_config(), activities(cuda_));
    recording_ = true;
  }
  if (recording_) {
    step_name_ = "ProfilerStep#" + std::to_string(step);
    step_scope_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (step_scope_->isActive()) step_scope_->before(std::string_view(step_name_));
  }
}

std::string StepProfiler::after_step(int64_t step) {
  step_scope_.reset();  // ends the step's span
  if (!recording_ || step % cfg_.profile_freq != 0) return "";
  return save(step);
}

std::string StepProfiler::finish(int64_t last_step) {
  step_scope_.reset();
  return recording_ ? save(last_step) : "";
}

std::string StepProfiler::save(int64_t step) {
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result =
      torch::autograd::profiler::disableProfiler();
  recording_ = prepared_ = false;
  const std::string path = trace_path(step);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec)
    throw UserError("profiling.save_traces_folder: cannot create '" +
                    std::filesystem::path(path).parent_path().string() + "' (" + ec.message() +
                    ")");
  // Written under a temporary name and renamed, so a reader never sees half a trace.
  const std::string tmp = path + ".tmp";
  result->save(tmp);
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw UserError("profiling: cannot write trace '" + path + "' (" + ec.message() + ")");
  log_info("=> profiling: trace of step " + std::to_string(step) + " written to " + path);
  return path;
}

}  // namespace titan
