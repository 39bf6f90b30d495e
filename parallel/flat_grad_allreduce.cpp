#include "parallel/flat_grad_allreduce.h"

#include <ATen/core/grad_mode.h>

namespace titan {

void FlatGradAllReduce::start(ProcessGroup& pg, const std::vector<at::Tensor>& params,
                              at::ScalarType dtype) {
  at::NoGradGuard ng;
  std::vector<at::Tensor> flat;
  flat.reserve(params.size());
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    flat.push_back(g.defined() ? g.reshape({-1}) : at::zeros({p.numel()}, p.options()));
  }
  buf = at::cat(flat).to(dtype);
  work = pg.allreduce_start(buf, ReduceOp::Sum);
}

void FlatGradAllReduce::finish(const std::vector<at::Tensor>& params) {
  at::NoGradGuard ng;
  work.wait();
  const at::Tensor sums = buf.to(at::kFloat);
  int64_t off = 0;
  for (at::Tensor p : params) {
    const int64_t n = p.numel();
    at::Tensor part = sums.narrow(0, off, n).view_as(p);
    if (p.grad().defined())
      p.mutable_grad().copy_(part);
    else
      p.mutable_grad() = part.clone();
    off += n;
  }
  buf = at::Tensor();
}

}  // namespace titan
