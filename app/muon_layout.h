// Where Muon's whole matrices come from under data and tensor parallelism (core/train/muon.h).
//
// The plan (docs/training.md, "Muon"): the momentum update is element-wise, so each rank runs
// it on its own slice; a matrix split over ranks is then all-gathered whole (FSDP's rows over
// the parameter's shard group, then tensor-parallel slices over the tp group), every rank of
// the group runs Newton-Schulz on it, and each keeps its own slice of the result. Redundant
// compute (every rank orthogonalizes every matrix it shares) bought simplicity and exactness:
// no rank waits on another's result. Routed experts (E, A, B) sharded or expert-parallel on
// dim 0 hold whole matrices already and are not gathered.
#pragma once

#include <vector>

#include "core/config/param_groups.h"
#include "core/train/model.h"
#include "core/train/muon.h"
#include "parallel/fsdp.h"

namespace titan {

class ShardedMatrixLayout : public MatrixLayout {
 public:
  // fsdp null: nothing sharded; the model's tensor_parallel() gives the tp group, if any.
  ShardedMatrixLayout(Model& model, FullyShardedDataParallel* fsdp);
  bool split(int64_t param) const override;
  at::Tensor gather(int64_t param, const at::Tensor& local) override;
  at::Tensor mine(int64_t param, const at::Tensor& whole) override;

 private:
  bool rows_split(const Param& p) const;  // FSDP cut a 2-D matrix's rows
  bool tp_split(const Param& p) const;    // tensor parallelism cut a matrix dimension
  Model& model_;
  FullyShardedDataParallel* fsdp_;
};

// Each parameter's optimizer (core/config/param_groups.h) over the whole model, every
// pipeline stage's parameters included.
std::vector<OptimizerKind> route_model(const Model& model, const OptimizerSection& opt);

// Bytes of fp32 parameters + optimizer state of the whole model, unsharded, with the routing
// of `opt` (Muon's matrices keep one state tensor, AdamW's parameters two): the denominator
// of the startup log's memory ratio.
int64_t full_state_bytes(const Model& model, const OptimizerSection& opt);

}  // namespace titan
