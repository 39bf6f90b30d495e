#include "core/telemetry/metrics.h"

#include <sys/resource.h>

#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/telemetry/tb_writer.h"

namespace titan {

double peak_flops_for_device(const std::string& name, PeakMath math) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  struct Peaks {
    double bf16, tf32, fp32;
  };
  Peaks p{0, 0, 0};
  if (has("H100") || has("H200") || has("H800") || has("GH200"))
    p = {989e12, 494.5e12, 66.9e12};
  else if (has("B200") || has("GB200"))
    p = {2250e12, 1100e12, 80e12};
  else if (has("A100") || has("A800"))
    p = {312e12, 156e12, 19.5e12};
  switch (math) {
    case PeakMath::BF16: return p.bf16;
    case PeakMath::TF32: return p.tf32;
    case PeakMath::FP32: return p.fp32;
  }
  return 0;
}

double max_rss_gib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / (1024.0 * 1024.0);  // ru_maxrss is KiB
}

MetricsLogger::MetricsLogger(const std::string& dump_folder, bool writer, bool tensorboard,
                             const std::string& tb_folder, bool color, int64_t rank)
    : writer_(writer), color_(color), rank_(rank) {
  if (!writer_) return;
  std::error_code ec;
  std::filesystem::create_directories(dump_folder, ec);
  if (ec)
    throw UserError("job.dump_folder '" + dump_folder + "': cannot be created (" + ec.message() +
                    ")");
  std::string name =
      rank_ == 0 ? "metrics.jsonl" : "metrics_rank" + std::to_string(rank_) + ".jsonl";
  jsonl_.open(dump_folder + "/" + name, std::ios::app);
  if (!jsonl_)
    throw UserError("metrics file '" + dump_folder + "/" + name + "': cannot be written");
  if (tensorboard) {
    std::string folder = dump_folder + "/" + tb_folder;
    if (rank_ != 0) folder += "/rank_" + std::to_string(rank_);
    tb_ = std::make_unique<TensorBoardWriter>(folder);
  }
}

MetricsLogger::~MetricsLogger() = default;

void MetricsLogger::write_json(const std::string& line) {
  if (!writer_) return;
  jsonl_ << line << "\n";
  jsonl_.flush();
}

void MetricsLogger::progress(int64_t step, int64_t total, double secs_per_step) {
  if (rank_ != 0 || !log_is_tty()) return;
  const int width = 30;
  int filled = total > 0 ? static_cast<int>(width * step / total) : 0;
  double eta = secs_per_step * static_cast<double>(total - step);
  std::printf("\r  [%s%s] step %lld/%lld  eta %.0fs ", std::string(filled, '#').c_str(),
              std::string(width - filled, ' ').c_str(), static_cast<long long>(step),
              static_cast<long long>(total), eta);
  std::fflush(stdout);
  progress_shown_ = true;
}

void MetricsLogger::log_step(const StepMetrics& m) {
  if (progress_shown_) {
    std::printf("\r%80s\r", "");
    progress_shown_ = false;
  }
  std::ostringstream os;
  auto c = [&](const char* code) {
    return color_ ? std::string("\033[") + code + "m" : std::string();
  };
  os << c("31") << "step: " << std::setw(5) << m.step << c("0") << "  " << c("32")
     << "loss: " << std::fixed << std::setprecision(4) << m.loss << c("0");
  if (m.loss_max != m.loss) os << " (max " << std::setprecision(4) << m.loss_max << ")";
  os << "  grad_norm: " << std::setprecision(4) << m.grad_norm << "  lr: " << std::scientific
     << std::setprecision(2) << m.lr << std::fixed << "  " << c("33")
     << "memory: " << std::setprecision(2) << m.memory_gib << "/" << m.memory_peak_gib
     << "GiB(" << m.memory_kind << " alloc/peak) rss " << m.rss_gib << "GiB"
     << c("0") << "  " << c("34") << "tps: " << std::setprecision(0) << m.tps << c("0")
     << "  tflops: " << std::setprecision(3) << m.tflops << "  mfu: ";
  if (m.mfu < 0)
    os << "n/a";
  else
    os << std::setprecision(2) << m.mfu << "%";
  os << "  time(ms) data/fwdbwd/opt: " << std::setprecision(1) << m.data_ms << "/" << m.fwdbwd_ms
     << "/" << m.opt_ms << "  comm_wait_ms: ";
  if (m.comm_wait_ms < 0)
    os << "n/a";
  else
    os << m.comm_wait_ms;
  if (m.compile_checked_steps >= 0)
    os << "  capture check: " << m.compile_checked_steps << " steps compared";
  else if (m.compile_captures >= 0)
    os << "  graphs: " << m.compile_captures << " captured, " << m.compile_replays
       << " replays";
  log_info(os.str());

  nlohmann::json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["loss_max"] = m.loss_max;
  j["grad_norm"] = m.grad_norm;
  j["lr"] = m.lr;
  j["tps"] = m.tps;
  j["tflops"] = m.tflops;
  j["mfu"] = m.mfu < 0 ? nlohmann::json(nullptr) : nlohmann::json(m.mfu);
  j["memory_gib"] = m.memory_gib;
  j["memory_peak_gib"] = m.memory_peak_gib;
  j["memory_rss_gib"] = m.rss_gib;
  j["memory_kind"] = m.memory_kind;
  j["time_data_ms"] = m.data_ms;
  j["time_fwdbwd_ms"] = m.fwdbwd_ms;
  j["time_optimizer_ms"] = m.opt_ms;
  j["comm_wait_ms"] = m.comm_wait_ms < 0 ? nlohmann::json(nullptr) : nlohmann::json(m.comm_wait_ms);
  if (m.compile_captures >= 0) j["compile_captures"] = m.compile_captures;
  if (m.compile_replays >= 0) j["compile_replays"] = m.compile_replays;
  if (m.compile_checked_steps >= 0) j["compile_checked_steps"] = m.compile_checked_steps;
  for (auto& [k, v] : m.extra) j[k] = v;
  write_json(j.dump());
  if (tb_) {
    tb_->add_scalar("loss_metrics/global_avg_loss", m.loss, m.step);
    tb_->add_scalar("loss_metrics/global_max_loss", m.loss_max, m.step);
    tb_->add_scalar("grad_norm", m.grad_norm, m.step);
    tb_->add_scalar("lr", m.lr, m.step);
    tb_->add_scalar("throughput(tps)", m.tps, m.step);
    tb_->add_scalar("tflops", m.tflops, m.step);
    if (m.mfu >= 0) tb_->add_scalar("mfu(%)", m.mfu, m.step);
    tb_->add_scalar("memory/allocated_gib", m.memory_gib, m.step);
    tb_->add_scalar("memory/peak_allocated_gib", m.memory_peak_gib, m.step);
    tb_->add_scalar("memory/max_rss_gib", m.rss_gib, m.step);
    tb_->add_scalar("time_metrics/data_ms", m.data_ms, m.step);
    tb_->add_scalar("time_metrics/fwdbwd_ms", m.fwdbwd_ms, m.step);
    tb_->add_scalar("time_metrics/optimizer_ms", m.opt_ms, m.step);
    if (m.comm_wait_ms >= 0) tb_->add_scalar("time_metrics/comm_wait_ms", m.comm_wait_ms, m.step);
    for (auto& [k, v] : m.extra) tb_->add_scalar(k, v, m.step);
    tb_->flush();
  }
}

void MetricsLogger::log_validation(int64_t step, double loss, double ppl, int64_t tokens) {
  std::ostringstream os;
  os << "validate step: " << step << "  loss: " << std::fixed << std::setprecision(4) << loss
     << "  perplexity: " << std::setprecision(3) << ppl << "  tokens: " << tokens;
  log_info(os.str());
  nlohmann::json j;
  j["step"] = step;
  j["validation_loss"] = loss;
  j["validation_perplexity"] = ppl;
  j["validation_tokens"] = tokens;
  write_json(j.dump());
  if (tb_) {
    tb_->add_scalar("validation_metrics/loss", loss, step);
    tb_->add_scalar("validation_metrics/perplexity", ppl, step);
    tb_->flush();
  }
}

}  // namespace titan
