// Tensor and sequence parallelism over one tp group (Megatron's layout, as torchtitan
// applies it): the model's TpPlan (core/train/tensor_parallel.h) says how each parameter is
// split; this file checks the plan, cuts the parameters to this rank's slices and installs
// the collectives at the model's sequence-parallel boundaries. It knows no model.
//
// Applied before FSDP: FSDP then shards each tp slice over the data-parallel ranks of the
// same tp index (parallel/mesh.h), and TensorParallelGradSync sums the gradients of the
// replicated (sequence-parallel) parameters over the tp ranks after FSDP's reductions.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/train/grad_sync.h"
#include "core/train/model.h"
#include "parallel/process_group.h"

namespace titan {

// Throws UserError (exit 2) naming the first fault: no plan declared, a parameter in no
// group or in two, an index that is no parameter, a count in `divisible` or a split
// dimension that `tp` does not divide.
void check_tp_plan(const Model& model, int64_t tp);

// Checks the plan, then replaces each split parameter by this rank's slice (deferred
// parameters stay unallocated, with the slice's shape) and installs the tp collectives in
// the model. A group of one rank changes nothing. `split_experts` (expert tensor
// parallelism, etp = tp): the routed experts are cut along their hidden size too and the
// MoE layers run the whole sequence through their slices (Model::set_expert_tensor_parallel);
// otherwise they stay whole and replicated.
// `async` (parallelism.enable_async_tensor_parallel): the all-gather before the column-
// parallel GEMMs and the reduce-scatter after the row-parallel ones run in chunks, each
// chunk's collective overlapping another chunk's GEMM, forward and backward; same math.
// Returns the installed communicator (null for a group of one rank), whose
// take_async_counts() says how many boundaries ran chunked.
std::shared_ptr<TensorParallelComm> apply_tensor_parallel(Model& model, ProcessGroup& tp_group,
                                                          bool split_experts = false,
                                                          bool async = false);

// The cut alone (no collectives installed): rank r's slices of a tp-way split, after the
// same checks. titan-train estimate sizes a rank with it.
void split_for_tensor_parallel(Model& model, int64_t tp, int64_t r, bool split_experts = false);

// The collectives at the sequence-parallel boundaries over `group` (exposed for tests).
// `async`: the GEMM-fused boundaries (gather_seq_project, project_reduce_scatter_seq)
// chunked and overlapped; the plain collectives are the same.
std::shared_ptr<TensorParallelComm> make_tp_comm(ProcessGroup& group, bool async = false);

// Wraps the data-parallel GradSync (or none): after it, sums the replicated parameters'
// gradients over the tp ranks; the squared norm counts the split parameters of every tp
// rank and the replicated ones once.
class TensorParallelGradSync : public GradSync {
 public:
  TensorParallelGradSync(Model& model, ProcessGroup& tp_group, GradSync* inner);
  void begin_micro_batch(bool last) override;
  void reduce_gradients(const std::vector<at::Tensor>& params) override;
  void reduce_norm_sq(at::Tensor& norm_sq) override;
  void after_optimizer_step() override {
    if (inner_) inner_->after_optimizer_step();
  }

 private:
  Model& model_;
  ProcessGroup& tp_;
  GradSync* inner_;
};

// "tp 2 (sequence parallel): 8 column-, 4 row-, 2 vocab-parallel, 5 replicated parameters",
// for the startup log, with the routed experts' split when expert tensor parallelism is on.
std::string describe_tp(const Model& model, int64_t tp);

}  // namespace titan
