// Deferred weight gradients: the split backward of the zero-bubble pipeline schedules
// (docs/distributed.md, "Pipeline parallel"). Their I action computes a stage's input
// gradient; their W action, later, its weight gradients. The GEMM that dominates W is a
// linear layer's grad_w = grad_out^T x (in (O, D) = (M, O)^T (M, D)), so during an I the
// linear layers record what that GEMM needs instead of running it, and W runs the recorded
// GEMMs; so do the routed experts (moe/experts.cpp) with their three grouped weight GEMMs.
// Parameters whose gradients do not come from such a GEMM (norm weights, embeddings, the
// output projection under the fused loss) still get theirs in I.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <utility>
#include <vector>

namespace titan {

// One (stage, micro-batch)'s deferred weight-gradient GEMMs. Each record is the weight
// tensor the layer received (an autograd root: a parameter, or a compute form of one with
// its history, e.g. a cast or FSDP's gathered alias) and a function that computes its
// gradient from the stashed grad_out and x. The stash holds those tensors until flush().
class WeightGradStore {
 public:
  void add(const at::Tensor& weight, std::function<at::Tensor()> grad);
  size_t size() const { return weights_.size(); }
  // Runs the recorded GEMMs, sums those of the same weight tensor, and backpropagates the
  // sums from the weights in one autograd backward, so that a history shared by several
  // weights (one FSDP unit's gather) runs once with all of their gradients. Empties the
  // store. No host reads.
  void flush();
  void clear();
  // Runs `fn` at the end of the next flush(), after its backward: for work an I held back
  // for its W (FSDP's reduce-scatter of a unit whose W may never reach it).
  void after_flush(std::function<void()> fn);
  // Removes and returns the records from index `first` on, each a weight and its GEMM: a
  // block's recompute re-adds them on the block's own weight tensors.
  std::vector<std::pair<at::Tensor, std::function<at::Tensor()>>> take_from(size_t first);

 private:
  std::vector<at::Tensor> weights_;
  std::vector<std::function<at::Tensor()>> grads_;
  std::vector<std::function<void()>> after_;
};

// While alive, the linear layers' backward (deferrable_linear, float8_linear, async TP's
// fused GEMMs) record their weight-gradient GEMMs into `store` instead of running
// them, and give no gradient for the weight. Process-wide (the autograd engine runs CUDA
// nodes on its own thread); one backward runs at a time.
class DeferWeightGrads {
 public:
  explicit DeferWeightGrads(WeightGradStore* store);
  ~DeferWeightGrads();
  DeferWeightGrads(const DeferWeightGrads&) = delete;
  DeferWeightGrads& operator=(const DeferWeightGrads&) = delete;

 private:
  WeightGradStore* prev_;
};

// Suspends deferral while alive.
class NoWeightGradDeferral {
 public:
  NoWeightGradDeferral();
  ~NoWeightGradDeferral();
  NoWeightGradDeferral(const NoWeightGradDeferral&) = delete;
  NoWeightGradDeferral& operator=(const NoWeightGradDeferral&) = delete;

 private:
  WeightGradStore* prev_;
};

// The store the linear layers' backward records into, or null when not deferring.
WeightGradStore* weight_grad_deferral();

// While alive (a split-backward schedule's stage forward), project() routes its GEMMs
// through deferrable_linear, so their backward can be deferred; so does a block's recompute
// inside a deferring backward. Elsewhere project() is at::linear, untouched.
class SplitBackwardForward {
 public:
  explicit SplitBackwardForward(bool on);
  ~SplitBackwardForward();
  SplitBackwardForward(const SplitBackwardForward&) = delete;
  SplitBackwardForward& operator=(const SplitBackwardForward&) = delete;

 private:
  bool prev_;
};
bool split_backward_forward();

// x w^T (x: (..., D), w: (O, D) -> (..., O)) whose backward computes grad_x = grad_out w
// and grad_w = grad_out^T x with one mm each, as autograd does for at::linear without
// bias; grad_w is recorded instead while a store is deferring.
at::Tensor deferrable_linear(const at::Tensor& x, const at::Tensor& w);

}  // namespace titan
