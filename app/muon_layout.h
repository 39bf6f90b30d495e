// Where Muon's whole matrices come from under data and tensor parallelism (core/train/muon.h).
//
// The owner plan (docs/training.md, "Muon"): the momentum update is element-wise, so each
// rank runs it on its own piece; a matrix split over ranks (FSDP's rows over the parameter's
// shard group, tensor-parallel slices over the tp group, or both) then has one owner rank
// among the ranks that share it, balanced by Newton-Schulz cost (parallel/matrix_owners.h).
// The owner receives the pieces, orthogonalizes the whole, and sends each rank its piece of
// the result, so the Newton-Schulz work per rank falls with the number of ranks sharing the
// matrices. Routed experts (E, A, B) sharded or expert-parallel on dim 0 hold whole matrices
// already: each rank orthogonalizes its own experts. DDP replicas hold whole matrices too and
// each orthogonalizes all of them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/config/param_groups.h"
#include "core/train/model.h"
#include "core/train/muon.h"
#include "core/train/optimizer.h"
#include "parallel/fsdp.h"
#include "parallel/matrix_owners.h"

namespace titan {

class ShardedMatrixLayout : public MatrixLayout {
 public:
  // fsdp null: nothing sharded; tp: the tensor-parallel group (null without tensor
  // parallelism; expert tensor parallelism uses the same group).
  ShardedMatrixLayout(Model& model, FullyShardedDataParallel* fsdp, ProcessGroup* tp);
  bool split(int64_t param) const override;
  void plan(const std::vector<int64_t>& params) override;
  bool owns(size_t k) const override { return owners_->owns(k); }
  std::vector<at::Tensor> orthogonalize(
      const std::vector<at::Tensor>& local,
      const std::function<at::Tensor(const at::Tensor&)>& orth) override;

 private:
  bool rows_split(const Param& p) const;  // FSDP cut a 2-D matrix's rows
  bool tp_split(const Param& p) const;    // tensor parallelism cut a matrix dimension
  Model& model_;
  FullyShardedDataParallel* fsdp_;
  ProcessGroup* tp_;
  std::unique_ptr<MatrixOwners> owners_;
};

// "=> muon: Newton-Schulz on 12 of 24 matrices per step on rank 0 (owner plan); matrices per
// rank [12, 12], cost per rank relative to one process [0.50, 0.50]": every rank's plan,
// gathered over `world` (null: one process). A collective: every rank calls it.
std::string describe_muon_plan(const Optimizer& opt, ProcessGroup* world);

std::vector<OptimizerKind> route_model(const Model& model, const OptimizerSection& opt);

// Bytes of fp32 parameters + optimizer state of the whole model, unsharded, with the routing
// of `opt` (Muon's matrices keep one state tensor, AdamW's parameters two): the denominator
// of the startup log's memory ratio.
int64_t full_state_bytes(const Model& model, const OptimizerSection& opt);

}  // namespace titan
