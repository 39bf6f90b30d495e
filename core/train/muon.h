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
// the momentum update is element-wise on the slices, then a MatrixLayout sends U's pieces to
// the matrix's owner rank, which runs Newton-Schulz on the whole and sends each rank its slice
// of O back (docs/training.md, "Muon"). The learning rate is a device tensor as AdamW's, so the
// step reads nothing on the host and can be captured.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/config/param_groups.h"

namespace titan {

// How Muon's parameters relate to their whole matrices. The default (nullptr where a layout
// is taken) is one process: every local tensor is the whole thing.
class MatrixLayout {
 public:
  virtual ~MatrixLayout() = default;
  // Parameter `param` (its index in the model's ParamStore) holds a piece of its matrices:
  // Newton-Schulz needs the pieces of other ranks.
  virtual bool split(int64_t param) const = 0;
  // Called once, with the split parameters in Muon's order: the distributed plan.
  virtual void plan(const std::vector<int64_t>& params) = 0;
  // Whether this rank runs Newton-Schulz on planned parameter k (an owner plan spreads them).
  virtual bool owns(size_t k) const = 0;
  // local[k]: this rank's piece of planned parameter k's update (bf16, shaped like the
  // parameter). Runs `orth` on the whole of the matrices this rank owns (a collective over
  // the ranks sharing them) and returns every parameter's piece of the result, shaped like
  // local[k] (padding rows 0).
  virtual std::vector<at::Tensor> orthogonalize(
      const std::vector<at::Tensor>& local,
      const std::function<at::Tensor(const at::Tensor&)>& orth) = 0;
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

// newton_schulz on each matrix of a (E, A, B) tensor, batched (bmm): the routed experts.
at::Tensor newton_schulz_batched(const at::Tensor& g, const std::array<double, 3>& abc,
                                 int64_t steps, double eps);

class Muon {
 public:
  // params: local tensors; ids: their ParamStore indices (for the layout); whole: each one's
  // whole model shape (2-D or 3-D). layout may be null (nothing split).
  // set: optimizer.param_groups' settings per parameter (empty: none), a group's own peak
  // lr (in place of muon_lr, scaled by the schedule alike) and weight decay.
  Muon(std::vector<at::Tensor> params, std::vector<int64_t> ids,
       std::vector<std::vector<int64_t>> whole, const MuonArgs& args, MatrixLayout* layout,
       const std::vector<ParamOverride>& set = {});
  // The lr this step (already Muon's: the caller scales the schedule's lr), written into the
  // device tensor the update reads.
  void set_lr(double lr);
  void step();
  std::vector<at::Tensor>& momentum_buffer() { return buf_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  // Matrices (a 3-D tensor counts E) this rank orthogonalizes per step by the plan, of all
  // it holds a piece of, and their Newton-Schulz cost (sum of E A B min(A, B)).
  struct Plan {
    int64_t own_matrices = 0, all_matrices = 0;
    double own_cost = 0, all_cost = 0;
  };
  const Plan& plan() const { return plan_; }
  // Matrices Newton-Schulz ran on, on this rank, since construction (a host count, no sync).
  int64_t newton_schulz_calls() const { return ns_calls_; }

 private:
  std::vector<at::Tensor> params_, buf_;
  std::vector<int64_t> ids_;
  std::vector<double> ratio_;          // muon_lr_ratio of each parameter's matrices
  std::vector<double> lr_scale_, wd_;  // per parameter: its lr / muon_lr, its weight decay
  MuonArgs args_;
  MatrixLayout* layout_;
  std::vector<size_t> split_;  // indices of the split parameters, in the layout's plan order
  std::vector<bool> is_split_;
  Plan plan_;
  int64_t ns_calls_ = 0;
  at::Tensor lr_;  // fp64 on the CPU (as AdamW's), fp32 on CUDA
};

}  // namespace titan
