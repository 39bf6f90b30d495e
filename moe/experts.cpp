#include "moe/experts.h"

#include <torch/csrc/autograd/custom_function.h>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/train/capture_check.h"

// The device query needs the CUDA runtime headers; the wheel's libtorch_cuda provides the
// symbol. Without them (a CPU-only LibTorch) every device reports capability 0.
#if __has_include(<ATen/cuda/CUDAContextLight.h>) && __has_include(<cuda_runtime_api.h>)
#include <ATen/cuda/CUDAContextLight.h>
#define TITAN_MOE_CUDA_QUERY 1
#endif

namespace titan {

const char* experts_backend_name(ExpertsBackend b) {
  return b == ExpertsBackend::GroupedMM ? "grouped_mm" : "loop";
}

int cuda_compute_capability(at::Device device) {
#ifdef TITAN_MOE_CUDA_QUERY
  if (!device.is_cuda() || !at::hasCUDA()) return 0;
  const auto* p = at::cuda::getDeviceProperties(device.has_index() ? device.index() : 0);
  return p->major * 10 + p->minor;
#else
  (void)device;
  return 0;
#endif
}

ExpertsBackend select_experts_backend(const std::string& requested, at::Device device) {
  const int cc = cuda_compute_capability(device);
  const bool grouped_ok = cc >= 90;
  std::string where = device.is_cuda() ? "CUDA device " + std::to_string(device.index()) +
                                             " (compute capability " + std::to_string(cc / 10) +
                                             "." + std::to_string(cc % 10) + ")"
                                       : "the CPU";
  ExpertsBackend b;
  std::string reason;
  if (requested == "grouped_mm") {
    if (!grouped_ok)
      throw UserError("moe.experts_backend = \"grouped_mm\" cannot run on " + where +
                      ": at::_grouped_mm needs a CUDA device of compute capability >= 9.0; "
                      "allowed here: auto, loop");
    b = ExpertsBackend::GroupedMM;
    reason = "asked for";
  } else if (requested == "loop") {
    b = ExpertsBackend::Loop;
    reason = "asked for";
  } else if (requested == "auto") {
    b = grouped_ok ? ExpertsBackend::GroupedMM : ExpertsBackend::Loop;
    reason = grouped_ok ? "auto: compute capability >= 9.0"
                        : "auto: grouped_mm needs a CUDA device of compute capability >= 9.0";
  } else {
    throw UserError("moe.experts_backend = \"" + requested +
                    "\" is not a backend; allowed: auto, grouped_mm, loop");
  }
  log_info(std::string("=> MoE experts backend = ") + experts_backend_name(b) + " on " + where +
           " (" + reason + ")");
  return b;
}

int64_t experts_alignment(ExpertsBackend b) {
  return b == ExpertsBackend::GroupedMM ? 8 : 0;
}

std::vector<int64_t> counts_to_host(const at::Tensor& counts) {
  TITAN_HOST_READ_SCOPE();  // the capture check names this read
  at::Tensor c = counts.to(at::kCPU, at::kLong).contiguous();  // the sync
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

at::Tensor grouped_experts(const at::Tensor& x_padded, const at::Tensor& w1, const at::Tensor& w2,
                           const at::Tensor& w3, const Dispatch& d) {
  TORCH_CHECK(d.align > 0 && x_padded.size(0) == d.padded_rows,
              "grouped_experts: x must be in the dispatch's aligned layout");
  // bf16 on CUDA: the CUTLASS kernel (SM90+) is sync-free only there.
  const at::ScalarType t = x_padded.is_cuda() ? at::kBFloat16 : x_padded.scalar_type();
  at::Tensor x = x_padded.to(t);  // (M, D)
  // _grouped_mm takes b as (E, K, N): the transposed views of the (E, out, in) weights.
  at::Tensor h = at::silu(at::_grouped_mm(x, w1.to(t).transpose(-2, -1), d.offs)) *
                 at::_grouped_mm(x, w3.to(t).transpose(-2, -1), d.offs);  // (M, H)
  at::Tensor y = at::_grouped_mm(h, w2.to(t).transpose(-2, -1), d.offs);  // (M, D)
  return y.to(x_padded.scalar_type());
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Per-expert SwiGLU with a hand-written backward: forward saves the host counts, so the
// backward splits by them without reading the device again.
struct LoopExperts : public torch::autograd::Function<LoopExperts> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2, const at::Tensor& w3,
                               const std::vector<int64_t>& counts) {
    auto xs = x.split_with_sizes(counts);
    std::vector<at::Tensor> h1s, h3s, ys;
    for (size_t e = 0; e < counts.size(); ++e) {
      const int64_t i = static_cast<int64_t>(e);
      at::Tensor h1 = at::matmul(xs[e], w1[i].t());  // (n_e, H)
      at::Tensor h3 = at::matmul(xs[e], w3[i].t());
      ys.push_back(at::matmul(at::silu(h1) * h3, w2[i].t()));  // (n_e, D)
      h1s.push_back(h1);
      h3s.push_back(h3);
    }
    ctx->saved_data["counts"] = c10::IValue(counts);
    ctx->save_for_backward({x, w1, w2, w3, at::cat(h1s), at::cat(h3s)});
    return {at::cat(ys)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w1 = s[1], &w2 = s[2], &w3 = s[3];
    auto xs = x.split_with_sizes(counts);
    auto h1s = s[4].split_with_sizes(counts);
    auto h3s = s[5].split_with_sizes(counts);
    auto dys = grad_out[0].contiguous().split_with_sizes(counts);
    std::vector<at::Tensor> dxs, dw1, dw2, dw3;
    for (size_t e = 0; e < counts.size(); ++e) {
      const int64_t i = static_cast<int64_t>(e);
      const at::Tensor &h1 = h1s[e], &h3 = h3s[e], &dy = dys[e];
      at::Tensor a = at::silu(h1);
      at::Tensor dg = at::matmul(dy, w2[i]);            // (n_e, H)
      at::Tensor dh1 = at::silu_backward(dg * h3, h1);  // d silu(h1)
      at::Tensor dh3 = dg * a;
      dw2.push_back(at::matmul(dy.t(), a * h3));  // (D, H)
      dw1.push_back(at::matmul(dh1.t(), xs[e]));  // (H, D)
      dw3.push_back(at::matmul(dh3.t(), xs[e]));
      dxs.push_back(at::matmul(dh1, w1[i]) + at::matmul(dh3, w3[i]));  // (n_e, D)
    }
    return {at::cat(dxs), at::stack(dw1), at::stack(dw2), at::stack(dw3), at::Tensor()};
  }
};

}  // namespace

at::Tensor loop_experts(const at::Tensor& x_sorted, const at::Tensor& w1, const at::Tensor& w2,
                        const at::Tensor& w3, const std::vector<int64_t>& host_counts) {
  TORCH_CHECK(static_cast<int64_t>(host_counts.size()) == w1.size(0),
              "loop_experts: one count per expert");
  return LoopExperts::apply(x_sorted, w1, w2, w3, host_counts)[0];
}

}  // namespace titan
