#include "parallel/ddp.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace titan {
namespace {

struct ReadyHook : torch::autograd::PostAccumulateGradHook {
  ReadyHook(DataParallel* ddp, size_t i) : ddp(ddp), i(i) {}
  void operator()(const torch::autograd::Variable&) override { ddp->grad_ready(i); }
  DataParallel* ddp;
  size_t i;
};

}  // namespace

DataParallel::DataParallel(ProcessGroup& pg, const std::vector<at::Tensor>& params,
                           at::ScalarType reduce_dtype, int64_t bucket_bytes, bool overlap)
    : pg_(pg), reduce_dtype_(reduce_dtype), params_(params), overlap_(overlap) {
  bucket_of_.resize(params.size());
  seen_.assign(params.size(), false);
  int64_t bytes = 0;
  for (size_t j = params.size(); j-- > 0;) {
    const int64_t b = params[j].numel() * static_cast<int64_t>(sizeof(float));
    if (buckets_.empty() || bytes + b > bucket_bytes) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().params.push_back(j);
    bucket_of_[j] = buckets_.size() - 1;
    bytes += b;
  }
  for (size_t j = 0; j < params.size() && overlap; ++j)
    if (params[j].requires_grad())
      torch::autograd::impl::set_post_acc_grad_hooks(params[j],
                                                     std::make_unique<ReadyHook>(this, j));
}

DataParallel::~DataParallel() {
  for (auto& p : params_)
    if (overlap_ && p.requires_grad()) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

std::string DataParallel::describe() const {
  return std::to_string(buckets_.size()) + " gradient buckets (reverse parameter order, " +
         (overlap_ ? "all-reduced during backward" : "all-reduced after backward") +
         "), all-reduce in " + c10::toString(reduce_dtype_);
}

void DataParallel::broadcast_state(Model& model) {
  at::NoGradGuard ng;
  auto params = model.params().tensors();
  for (auto& bucket : buckets_) {
    std::vector<at::Tensor> flat;
    for (size_t i : bucket.params) flat.push_back(params[i].detach().reshape({-1}));
    at::Tensor buf = at::cat(flat);
    pg_.broadcast(buf, 0);
    int64_t off = 0;
    for (size_t i : bucket.params) {
      const int64_t n = params[i].numel();
      params[i].detach().copy_(buf.narrow(0, off, n).view_as(params[i]));
      off += n;
    }
  }
  for (auto& [name, t] : model.buffers()) pg_.broadcast(t, 0);
}

void DataParallel::begin_micro_batch(bool last) { last_micro_batch_ = last; }

void DataParallel::grad_ready(size_t i) {
  if (!last_micro_batch_ || seen_[i]) return;
  seen_[i] = true;
  ++buckets_[bucket_of_[i]].ready;
  // Launch in order: a complete bucket behind an incomplete one waits for it.
  while (next_ < buckets_.size() &&
         buckets_[next_].ready == static_cast<int64_t>(buckets_[next_].params.size()))
    launch(buckets_[next_++]);
}

std::vector<at::Tensor> DataParallel::tensors_of(const Bucket& b) const {
  std::vector<at::Tensor> r;
  r.reserve(b.params.size());
  for (size_t i : b.params) r.push_back(params_[i]);
  return r;
}

void DataParallel::launch(Bucket& b) { b.flat.start(pg_, tensors_of(b), reduce_dtype_); }

void DataParallel::reduce_gradients(const std::vector<at::Tensor>&) {
  at::NoGradGuard ng;
  while (next_ < buckets_.size()) launch(buckets_[next_++]);
  for (Bucket& b : buckets_) {
    b.flat.finish(tensors_of(b));
    b.ready = 0;
  }
  next_ = 0;
  seen_.assign(seen_.size(), false);
  last_micro_batch_ = true;
}

}  // namespace titan
