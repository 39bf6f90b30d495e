// Per-step metrics: one console line on rank 0, metrics.jsonl and TensorBoard events, all
// with the same names (step, loss, grad_norm, lr, tps, tflops, mfu, memory, timings).
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>

namespace titan {

class TensorBoardWriter;

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;      // global mean loss per token
  double loss_max = 0;  // largest per-rank loss
  double grad_norm = 0;
  double lr = 0;
  double tps = 0;         // tokens per second per rank
  double tflops = 0;      // achieved TFLOP/s per rank
  double mfu = -1;        // percent of the device's bf16 dense peak; < 0: unknown (CPU)
  // Tensor memory from the device's allocator statistics (CUDA's caching allocator, or the
  // counting CPU allocator of core/telemetry/memory_stats.h): allocated now and the peak since the last
  // log line; the process's max RSS beside them.
  double memory_gib = 0;       // allocated
  double memory_peak_gib = 0;  // peak allocated
  double rss_gib = 0;
  std::string memory_kind = "cpu";  // "cpu" or "cuda"
  double data_ms = 0, fwdbwd_ms = 0, opt_ms = 0;
  // Time the step spent blocked on collectives that compute did not hide (per step, averaged
  // over the steps since the last line); 0 for one process. < 0: unknown, because a step
  // since the last line was a CUDA-graph replay with collectives inside (no wait can be timed
  // inside a graph): "n/a" on the line, null in metrics.jsonl.
  double comm_wait_ms = 0;
  // compile.enable (docs/compile.md), cumulative since the start; < 0: not reported (compile
  // off; checked_steps on CUDA). CUDA: captures and replays of the step's graphs. CPU:
  // captures and replays 0, and the steps the capture check compared with its reference.
  int64_t compile_captures = -1, compile_replays = -1, compile_checked_steps = -1;
  std::map<std::string, double> extra;  // e.g. per-layer MoE load statistics
};

class MetricsLogger {
 public:
  // `writer`: this rank writes files (rank 0, or every rank with save_for_all_ranks).
  MetricsLogger(const std::string& dump_folder, bool writer, bool tensorboard,
                const std::string& tb_folder, bool color, int64_t rank);
  ~MetricsLogger();
  void log_step(const StepMetrics& m);
  void log_validation(int64_t step, double loss, double perplexity, int64_t tokens);
  // An in-place progress line on a terminal, between log lines.
  void progress(int64_t step, int64_t total, double secs_per_step);

 private:
  void write_json(const std::string& line);
  bool writer_, color_;
  int64_t rank_;
  std::ofstream jsonl_;
  std::unique_ptr<TensorBoardWriter> tb_;
  bool progress_shown_ = false;
};

// The math a step's matrix products run in, which sets the peak MFU divides by.
enum class PeakMath { BF16, TF32, FP32 };
// Peak dense FLOP/s of a CUDA device by name (H100/H200/H800, A100/A800, B200) for that math
// (vendor datasheets, SXM parts); 0 when unknown.
double peak_flops_for_device(const std::string& device_name, PeakMath math = PeakMath::BF16);
// Max resident set size of this process in GiB.
double max_rss_gib();

}  // namespace titan
