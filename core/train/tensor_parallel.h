// Tensor and sequence parallelism as the model declares it (docs/distributed.md).
//
// A model states, as data, how each of its parameters is split over the tensor-parallel
// ranks (TpPlan), and marks in its forward where activations cross a sequence-parallel
// boundary (Model::seq_gather / Model::seq_reduce, identities on one rank). parallel/ checks
// the plan, cuts the parameters and supplies the collectives (TensorParallelComm) without
// knowing the model; the model never sees a process group.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace titan {

enum class TpStyle {
  Column,     // dim 0 split (output features): wq/wk/wv by heads, w1/w3 by hidden rows
  Row,        // dim 1 split (input features): wo, w2; the output is a partial sum
  Vocab,      // dim 0 split over the vocabulary: embedding table, output projection
  Replicate,  // whole on every rank and applied to sequence shards (norms): the gradient
              // is a partial sum over the sequence, summed over the tp ranks
  // Routed experts (E, hidden, D) / (E, D, hidden) under expert tensor parallelism
  // (etp = tp): each rank holds a slice of every expert's hidden size and runs the whole
  // sequence through it; the outputs are partial sums.
  ExpertColumn,  // dim 1 split: experts.w1, experts.w3
  ExpertRow,     // dim 2 split: experts.w2
};
const char* tp_style_name(TpStyle s);

// Every parameter (store index) sits in exactly one group. `divisible` lists the counts the
// tp degree must divide (heads, kv heads, hidden size, vocabulary), by name for the message.
// The routed experts' weights are declared apart (expert_column: w1, w3; expert_row: w2):
// parallel/ splits them only when the job asks for expert tensor parallelism
// (split_experts); otherwise they are replicated like the rest of the MoE layer.
struct TpPlan {
  std::vector<int64_t> column, row, vocab, replicate;
  std::vector<int64_t> expert_column, expert_row;
  bool split_experts = false;
  std::vector<std::pair<std::string, int64_t>> divisible;
  bool declared() const {
    return !column.empty() || !row.empty() || !vocab.empty() || !replicate.empty();
  }
  bool has_experts() const { return !expert_column.empty() || !expert_row.empty(); }
  // The parameters whole on every tp rank whose gradients are summed over the tp ranks:
  // `replicate`, plus the routed experts when they are not split.
  std::vector<int64_t> replicated() const {
    std::vector<int64_t> r = replicate;
    if (!split_experts) {
      r.insert(r.end(), expert_column.begin(), expert_column.end());
      r.insert(r.end(), expert_row.begin(), expert_row.end());
    }
    return r;
  }
};

// The tensor-parallel collectives over one tp group, with autograd where the model needs
// gradients through them. parallel/tensor_parallel.cpp implements them over c10d.
class TensorParallelComm {
 public:
  virtual ~TensorParallelComm() = default;
  virtual int64_t size() const = 0;
  virtual int64_t rank() const = 0;
  // (B, T/tp, ...) -> (B, T, ...): all-gather along dim 1; backward reduce-scatters.
  virtual at::Tensor gather_seq(const at::Tensor& x) = 0;
  // Partial sums (B, T, ...) -> this rank's rows (B, T/tp, ...) of their sum over the ranks
  // (reduce-scatter along dim 1); backward all-gathers.
  virtual at::Tensor reduce_scatter_seq(const at::Tensor& x) = 0;
  // The sequence-parallel boundaries fused with the GEMMs beside them, so that an
  // implementation can overlap each chunk's collective with another chunk's GEMM (async
  // tensor parallelism, parallel/tensor_parallel.cpp). gather_seq_project: x (B, T/tp, D),
  // each w (O_i, D) -> project(gather_seq(x), w) (B, T, O_i). project_reduce_scatter_seq:
  // x (B, T, F), w (D, F) -> reduce_scatter_seq(project(x, w)) (B, T/tp, D). These defaults
  // are exactly those compositions (plain tensor parallelism).
  virtual std::vector<at::Tensor> gather_seq_project(const at::Tensor& x,
                                                     const std::vector<at::Tensor>& ws);
  virtual at::Tensor project_reduce_scatter_seq(const at::Tensor& x, const at::Tensor& w);
  // In place over the tp ranks, no autograd: a sum, or a max when `max`.
  virtual void allreduce(at::Tensor& t, bool max) = 0;
  // (..., V/tp) -> (..., V): all-gather along the last dim, no autograd (logits for tests
  // and exports; training never forms them).
  virtual at::Tensor gather_last(const at::Tensor& x) = 0;
  // Async tensor parallelism's GEMM-fused boundary calls since the last take: chunked and
  // overlapped, or fallen back to plain TP's composition (with the first fallback's reason,
  // e.g. "float8 weights"). Plain TP: zeros.
  struct AsyncCounts {
    int64_t chunked = 0, fallback = 0;
    std::string first_fallback;
  };
  virtual AsyncCounts take_async_counts() { return {}; }
};

}  // namespace titan
