// Float8 linears on a tensor-parallel rank's slice of the weight, with torchao 0.18's
// Float8ColwiseParallel / Float8RowwiseParallel scales (docs/float8.md, "Tensor
// parallelism"): every scale is the one a single process computes on the whole tensor. An
// amax taken over a dimension the slice cuts is all-reduced (max) over the tp group before
// it becomes a scale: the tensorwise amax of any operand the slice cuts, and the rowwise
// amax of a GEMM whose reduction dimension is cut. The all-reduce runs on device tensors (no
// host read), so the op stays capturable.
#pragma once

#include <ATen/core/ivalue.h>

#include "core/kernels/float8_linear.h"

namespace titan::float8 {

// Which dimension of w (N, K) a tp rank holds a slice of (Megatron's layout):
//   Column  rows of w: N is cut; x (M, K) is whole (gathered), the output and its gradient
//           (M, N/tp) are cut.
//   Row     columns of w: K is cut; x (M, K/tp) is cut, the output is a partial sum and its
//           gradient (M, N) is whole.
enum class TpSplit { None, Column, Row };

// All-reduces an fp32 amax tensor in place (max) over the ranks that hold the linear's other
// slices. A CustomClassHolder so that the autograd node can keep it for its backward.
class AmaxAllReduce : public torch::CustomClassHolder {
 public:
  virtual void max_(at::Tensor& amax) const = 0;
};

struct TpSlice {
  TpSplit split = TpSplit::None;
  c10::intrusive_ptr<AmaxAllReduce> reduce;  // set when split != None
};

// float8_linear on a tp slice: x and w are this rank's (x whole for Column, cut along K for
// Row); the returned output is this rank's (cut along N for Column, a partial sum for Row)
// and the gradients are those of its slice. tp.split None is float8_linear itself.
at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                         const Options& opts, const Quantized* w8, const TpSlice& tp);

}  // namespace titan::float8
