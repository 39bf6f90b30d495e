// The training loader: micro-batches of (B, T) int64 tokens and labels drawn from a Blend,
// prepared by a background thread, handed over on the device (through pinned memory with
// non-blocking copies on CUDA); and the validation reader.
//
// Step t reads global samples [t*G, (t+1)*G), G = grad_accum * dp * B; micro-batch m of
// data-parallel rank r, row b, reads sample g = t*G + (m*dp + r)*B + b (core/data/blend.h says
// which window that is). So every layout reads the same windows per step, ranks read
// disjoint windows, and a resume on another world size continues the same sequence.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json_fwd.hpp>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/data/blend.h"

namespace titan {

struct MicroBatch {
  at::Tensor tokens;  // (B, T) int64 on the model's device
  at::Tensor labels;  // (B, T) int64
};

// The loader's position, saved in checkpoints: O(sources), the same on every rank and
// independent of the world size. micro > 0 only between the micro-batches of a step.
struct LoaderState {
  int64_t g = 0;               // global samples of the completed steps
  std::vector<int64_t> drawn;  // of those, how many came from each source
  int64_t micro = 0;           // micro-batches of the current step already consumed

  nlohmann::json to_json() const;
  // Throws UserError naming `where` (e.g. the checkpoint file) when the object is malformed.
  static LoaderState from_json(const nlohmann::json& j, const std::string& where);
};

struct LoaderLayout {
  int64_t seq_len = 0;      // T; a window is T + 1 tokens
  int64_t local_batch = 0;  // B, rows per micro-batch on each rank
  int64_t dp_rank = 0, dp_size = 1;
  int64_t grad_accum = 1;   // M, micro-batches per step
  int64_t global_batch() const { return grad_accum * dp_size * local_batch; }
};

// One window a rank reads.
struct WindowRef {
  int64_t micro = 0, row = 0;  // where it lands on this rank
  int64_t g = 0;               // global sample index
  Draw draw;                   // source, epoch, window
  int64_t token = 0;           // its first token's position in the source's stream
};

// Which windows each step reads, without reading them.
class WindowPlanner {
 public:
  // Throws UserError when a source with a weight > 0 holds no whole window.
  WindowPlanner(const Blend& blend, const LoaderLayout& layout, uint64_t seed);
  // This rank's windows of the step starting at `st` (st.micro is ignored), in (micro, row)
  // order; `st` moves to the start of the next step. O(G * sources) time, O(M * B) memory.
  std::vector<WindowRef> next_step(LoaderState& st) const;
  LoaderState initial_state() const;
  const BlendSampler& sampler() const { return sampler_; }

 private:
  const Blend& blend_;
  LoaderLayout layout_;
  BlendSampler sampler_;
};

class Loader {
 public:
  // `blend` must outlive the loader. prefetch_depth: micro-batches prepared ahead by the
  // background thread; 0 reads on the caller's thread.
  Loader(const Blend& blend, int64_t seq_len, int64_t local_batch, int64_t dp_rank,
         int64_t dp_size, int64_t grad_accum, uint64_t seed, at::Device device = at::kCPU,
         int64_t prefetch_depth = 2);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next micro-batch, on the device. Rethrows a reader error (e.g. a token id outside
  // the vocabulary) at the batch it belongs to.
  MicroBatch next();
  // The position after the micro-batches next() has returned (not those prefetched).
  LoaderState state() const { return consumed_; }
  void load_state(const LoaderState& st);
  // Milliseconds the caller spent in next() (waiting for data and issuing the copies) since
  // the last call: the metrics' `data` time.
  double wait_ms();
  const LoaderLayout& layout() const { return layout_; }

 private:
  struct Item {
    at::Tensor tokens, labels;  // host, pinned on CUDA
    LoaderState after;
    std::exception_ptr error;
  };
  Item produce();
  void start();
  void stop();
  void run();

  const Blend& blend_;
  LoaderLayout layout_;
  WindowPlanner planner_;
  at::Device device_;
  int64_t depth_;
  // Producer cursor: the step being cut into micro-batches.
  LoaderState step_start_, step_end_;
  std::vector<WindowRef> plan_;
  int64_t next_micro_ = 0;
  // Consumer side.
  LoaderState consumed_;
  double wait_ms_ = 0;
  // Prefetch thread.
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
};

// Reads windows into rows of (B, T) tokens and labels; rows[i] -> row i. For the loader and
// the validation reader.
void read_windows(const Blend& blend, const std::vector<std::pair<int64_t, int64_t>>& starts,
                  int64_t seq_len, at::Tensor& tokens, at::Tensor& labels);

// Validation windows in order, without shuffling: the held-out ranges of a training blend
// (holdout = true) or the training ranges of a separate validation blend, interleaved by the
// greedy rule with weights proportional to each source's windows (a source whose windows are
// used up drops out), so one pass reads every window once. Rank r takes windows r, r + dp, ...
class ValidationReader {
 public:
  ValidationReader(const Blend& blend, bool holdout, int64_t seq_len, int64_t local_batch,
                   int64_t dp_rank, int64_t dp_size, at::Device device = at::kCPU);
  int64_t windows() const { return total_; }  // over all ranks
  int64_t batches() const;                    // full batches per rank, equal on every rank
  MicroBatch next();                          // batch i of batches(); then starts over
  void reset();

 private:
  const Blend& blend_;
  bool holdout_;
  int64_t seq_len_, batch_, rank_, dp_;
  at::Device device_;
  std::vector<int64_t> windows_;
  std::vector<double> weights_;
  int64_t total_ = 0;
  BlendState st_;  // position in the global validation order
  int64_t served_ = 0;
};

// data-preview: the windows of the first `steps` steps of one rank, with the shard holding
// each window's start and its first `ntokens` ids (nothing else is read).
struct WindowPreview {
  int64_t step = 0;  // 1-based, as the training log counts
  int64_t rank = 0, micro = 0, row = 0;
  int64_t source = 0;
  std::string path;    // the shard file holding the window's first token
  int64_t offset = 0;  // that token's offset within the shard, in tokens
  std::vector<int64_t> tokens;
};
std::vector<WindowPreview> preview_windows(const Blend& blend, const LoaderLayout& layout,
                                           uint64_t seed, int64_t steps, int64_t ntokens = 8);

}  // namespace titan
