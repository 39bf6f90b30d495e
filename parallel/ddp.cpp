#include "parallel/ddp.h"

#include <ATen/core/grad_mode.h>

namespace titan {

DataParallel::DataParallel(ProcessGroup& pg, const std::vector<at::Tensor>& params,
                           at::ScalarType reduce_dtype, int64_t bucket_bytes)
    : pg_(pg), reduce_dtype_(reduce_dtype) {
  int64_t bytes = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t b = params[i].numel() * static_cast<int64_t>(sizeof(float));
    if (buckets_.empty() || bytes + b > bucket_bytes) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().push_back(i);
    bytes += b;
  }
}

std::string DataParallel::describe() const {
  return std::to_string(buckets_.size()) + " gradient buckets, all-reduce in " +
         c10::toString(reduce_dtype_);
}

void DataParallel::broadcast_state(Model& model) {
  at::NoGradGuard ng;
  auto params = model.params().tensors();
  for (auto& bucket : buckets_) {
    std::vector<at::Tensor> flat;
    for (size_t i : bucket) flat.push_back(params[i].detach().reshape({-1}));
    at::Tensor buf = at::cat(flat);
    pg_.broadcast(buf, 0);
    int64_t off = 0;
    for (size_t i : bucket) {
      const int64_t n = params[i].numel();
      params[i].detach().copy_(buf.narrow(0, off, n).view_as(params[i]));
      off += n;
    }
  }
  for (auto& [name, t] : model.buffers()) pg_.broadcast(t, 0);
}

void DataParallel::reduce_gradients(const std::vector<at::Tensor>& params) {
  for (auto& bucket : buckets_) {
    std::vector<at::Tensor> flat;
    for (size_t i : bucket) {
      const at::Tensor& g = params[i].grad();
      // A parameter no token reached this step (an idle MoE expert) has no gradient here but
      // may have one on another rank: it contributes zeros.
      flat.push_back(g.defined() ? g.reshape({-1})
                                 : at::zeros({params[i].numel()}, params[i].options()));
    }
    at::Tensor buf = at::cat(flat).to(reduce_dtype_);
    pg_.allreduce(buf, ReduceOp::Sum);
    if (buf.scalar_type() != at::kFloat) buf = buf.to(at::kFloat);
    int64_t off = 0;
    for (size_t i : bucket) {
      at::Tensor p = params[i];
      const int64_t n = p.numel();
      at::Tensor part = buf.narrow(0, off, n).view_as(p);
      if (p.grad().defined())
        p.mutable_grad().copy_(part);
      else
        p.mutable_grad() = part.clone();
      off += n;
    }
  }
}

}  // namespace titan
