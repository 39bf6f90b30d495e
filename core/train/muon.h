// Muon: momentum orthogonalized by a Newton-Schulz iteration (torch.optim.Muon's update).
//
// Per matrix W with gradient G and momentum buffer B (the only state, fp32, shaped like W):
//   B <- mu B + (1 - mu) G            (torch's lerp form)
//   U <- nesterov ? G + mu (B - G) : B
//   O <- NS_k^(a,b,c)(U)              (bf16, on the whole matrix)
//   W <- W (1 - lr wd) - lr s(A, B) O  with s from muon_adjust_lr_fn and W of shape (A, B)
// A 3-D parameter (E, A, B) is E matrices (routed experts), each orthogonalized alone.
//
// Distributed layouts hold slices of a matrix (FSDP rows, tensor-parallel columns or rows):
// the momentum update is element-wise on the slices, then a MatrixLayout gathers U to the
// whole matrix, every rank of the group runs Newton-Schulz on it, and keeps its own slice of
// O (docs/training.md, "Muon"). The learning rate is a device tensor as AdamW's, so the step
// reads nothing on the host and can be captured.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <string>
#include <vector>

#include "core/config/config.h"

namespace titan {

// How a Muon parameter's local tensor relates to its whole matrices. The default (nullptr
// where a layout is taken) is one process: the local tensor is the whole thing.
class MatrixLayout {
 public:
  virtual ~MatrixLayout() = default;
  // Parameter `param` (its index in the model's ParamStore) holds a slice: its update must be
  // gathered before Newton-Schulz.
  virtual bool split(int64_t param) const = 0;
  // The whole update (the model shape: 2-D or 3-D) from this rank's local update; a
  // collective over the ranks sharing the parameter.
  virtual at::Tensor gather(int64_t param, const at::Tensor& local) = 0;
  // This rank's part of a whole tensor, shaped like the local parameter (padding rows 0).
  virtual at::Tensor mine(int64_t param, const at::Tensor& whole) = 0;
};

struct MuonArgs {
  double lr = 1e-3;  // peak; the schedule's factor scales it (Optimizer::set_lr)
  double weight_decay = 0.1;
  double momentum = 0.95;
  bool nesterov = true;
  std::array<double, 3> ns{3.4445, -4.7750, 2.0315};
  int64_t ns_steps = 5;
  double eps = 1e-7;
  std::string adjust_lr_fn = "original";
  static MuonArgs from(const OptimizerSection& o);
};

// The lr multiplier of a matrix with `rows` x `cols` (the whole matrix, W's (A, B)).
double muon_lr_ratio(const std::string& adjust_lr_fn, int64_t rows, int64_t cols);

// torch's _zeropower_via_newtonschulz on one matrix: bf16, transposed so the Gram matrix is
// the smaller side, scaled to norm <= 1, then ns_steps quintic steps.
at::Tensor newton_schulz(const at::Tensor& g, const std::array<double, 3>& abc, int64_t steps,
                         double eps);

class Muon {
 public:
  // params: local tensors; ids: their ParamStore indices (for the layout); whole: each one's
  // whole model shape (2-D or 3-D). layout may be null (nothing split).
  Muon(std::vector<at::Tensor> params, std::vector<int64_t> ids,
       std::vector<std::vector<int64_t>> whole, const MuonArgs& args, MatrixLayout* layout);
  // The lr this step (already Muon's: the caller scales the schedule's lr), written into the
  // device tensor the update reads.
  void set_lr(double lr);
  void step();
  std::vector<at::Tensor>& momentum_buffer() { return buf_; }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  std::vector<at::Tensor> params_, buf_;
  std::vector<int64_t> ids_;
  std::vector<double> ratio_;  // muon_lr_ratio of each parameter's matrices
  MuonArgs args_;
  MatrixLayout* layout_;
  at::Tensor lr_;  // fp64 on the CPU (as AdamW's), fp32 on CUDA
};

}  // namespace titan
