// Matrices held in pieces by groups of ranks, each orthogonalized by one owner rank (Muon's
// distributed plan, docs/training.md "Muon").
//
// A rank holds a piece of each shared matrix: FSDP's padded rows of it over the parameter's
// shard group, tensor parallelism's slice of it over the tp group, or both (the FSDP rows of
// the tp slice). Each cut is a level. Every matrix gets one owner position per level, chosen
// once from the shapes alone (so every rank computes the same plan), balancing the
// Newton-Schulz cost E A B min(A, B) over the ranks that share the matrices. A step then
//   gather:  per level, innermost first, one all-to-all per group sends every piece to its
//            owner, which concatenates them (dropping FSDP's padding rows);
//   compute: the rank that owns a matrix at every level runs `orth` on the whole of it;
//   scatter: per level, outermost first, one all-to-all per group sends each rank its piece
//            of the result (FSDP's padding rows 0).
// Two all-to-alls per group and level per step, whatever the number of matrices; the splits
// are fixed at construction, so the step reads nothing on the host and keeps the same
// collectives from step to step (capture-ready). Only the ranks that hold a level's result
// take part in the next level: the tp group of the matrix's FSDP owner position. This
// assumes the mesh's regularity (the ranks of a tp group sit at the same position of their
// shard groups), which the Mesh's groups (parallel/mesh.h) have.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "parallel/process_group.h"

namespace titan {

// One level: the pieces of the ranks of `group` (in rank order) concatenated along `dim`
// make the next level's tensor, cut to `keep` along dim when keep >= 0 (FSDP's rows: the
// last rank's padding dropped).
struct MatrixCut {
  ProcessGroup* group = nullptr;  // size > 1
  int64_t dim = 0;
  int64_t keep = -1;
};

struct SharedMatrix {
  std::vector<int64_t> local_shape;  // this rank's piece (FSDP: padded rows)
  std::vector<MatrixCut> cuts;       // innermost first: FSDP rows, then tensor parallel
  double cost = 1;                   // what the balance weighs: E A B min(A, B)
};

class MatrixOwners {
 public:
  explicit MatrixOwners(std::vector<SharedMatrix> matrices);
  // Whether this rank runs `orth` on matrix k (owns it at every level).
  bool owns(size_t k) const { return owns_[k]; }
  size_t size() const { return ms_.size(); }
  // local[k]: this rank's piece of matrix k (any float dtype; sent as is, so the caller picks
  // the wire dtype). orth(whole) is called on each owned whole, in k order. Returns each
  // matrix's piece of orth's result, shaped like local[k], in orth's dtype.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& local,
                              const std::function<at::Tensor(const at::Tensor&)>& orth);

 private:
  // The matrices exchanged over one group at one level (in k order) and their owners.
  struct Exchange {
    int64_t level = 0;
    ProcessGroup* group = nullptr;
    std::vector<size_t> ks;
  };
  std::vector<SharedMatrix> ms_;
  std::vector<std::vector<int64_t>> pos_;  // [k][level]: the owner's rank in the group
  std::vector<std::vector<std::vector<int64_t>>> shape_;  // [k][level]: the tensor at that level
  std::vector<bool> owns_;
  std::vector<Exchange> exchanges_;  // level-major, groups in order of first use
};

}  // namespace titan
