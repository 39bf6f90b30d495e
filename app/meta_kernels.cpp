#include "app/meta_kernels.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>
#include <mutex>

namespace titan {
namespace {

at::Tensor index_select_meta(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  std::vector<int64_t> shape = self.sizes().vec();
  if (!shape.empty()) shape[static_cast<size_t>(at::maybe_wrap_dim(dim, self.dim()))] = index.numel();
  return at::empty(shape, self.options());
}

at::Tensor embedding_dense_backward_meta(const at::Tensor& grad, const at::Tensor&,
                                         c10::SymInt num_weights, c10::SymInt, bool) {
  return at::empty({num_weights.expect_int(), grad.size(-1)}, grad.options());
}

at::Tensor where_meta(const at::Tensor& cond, const at::Tensor& self, const at::Tensor& other) {
  const std::vector<int64_t> shape =
      at::infer_size(at::infer_size(cond.sizes(), self.sizes()), other.sizes());
  return at::empty(shape, self.options().dtype(at::result_type(self, other)));
}

at::Tensor& where_out_meta(const at::Tensor& cond, const at::Tensor& self, const at::Tensor& other,
                           at::Tensor& out) {
  const std::vector<int64_t> shape =
      at::infer_size(at::infer_size(cond.sizes(), self.sizes()), other.sizes());
  out.resize_(shape);
  return out;
}

// The CPU flash kernel's outputs: (B, H, T, Dv) and the fp32 log-sum-exp (B, H, T).
std::tuple<at::Tensor, at::Tensor> cpu_flash_meta(const at::Tensor& q, const at::Tensor&,
                                                  const at::Tensor& v, double, bool,
                                                  const std::optional<at::Tensor>&,
                                                  std::optional<double>) {
  std::vector<int64_t> shape = q.sizes().vec();
  shape.back() = v.size(-1);
  return {at::empty(shape, q.options()),
          at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_flash_backward_meta(
    const at::Tensor&, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor&, const at::Tensor&, double, bool, const std::optional<at::Tensor>&,
    std::optional<double>) {
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

at::Tensor max_meta(const at::Tensor& self) { return at::empty({}, self.options()); }

at::Tensor searchsorted_meta(const at::Tensor&, const at::Tensor& values, bool out_int32, bool,
                             std::optional<c10::string_view>, const std::optional<at::Tensor>&) {
  return at::empty(values.sizes(), values.options().dtype(out_int32 ? at::kInt : at::kLong));
}

// at::_grouped_mm's output shape (its CPU and CUDA fallbacks copy the offsets to the host,
// which a meta tensor cannot): 2-D x 3-D (rows grouped by offs, one weight per group) gives
// (M, N); 2-D x 2-D with offs (the weight gradient, the reduction dim grouped) gives
// (groups, M, N); 3-D x 2-D gives (M, N) with the columns grouped; 3-D x 3-D is batched.
at::Tensor grouped_mm_meta(const at::Tensor& a, const at::Tensor& b,
                           const std::optional<at::Tensor>& offs, const std::optional<at::Tensor>&,
                           std::optional<at::ScalarType> out_dtype) {
  const auto opts = a.options().dtype(out_dtype.value_or(a.scalar_type()));
  if (a.dim() == 2 && b.dim() == 3) return at::empty({a.size(0), b.size(2)}, opts);
  if (a.dim() == 2 && b.dim() == 2) {
    TORCH_CHECK(offs.has_value(), "_grouped_mm (meta): 2-D x 2-D needs offsets");
    return at::empty({offs->size(0), a.size(0), b.size(1)}, opts);
  }
  if (a.dim() == 3 && b.dim() == 2) return at::empty({a.size(1), b.size(1)}, opts);
  return at::empty({a.size(0), a.size(1), b.size(2)}, opts);
}

}  // namespace

void register_meta_kernels() {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> lib;
  std::call_once(once, [] {
    lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                           c10::DispatchKey::Meta, __FILE__, __LINE__);
    lib->impl("index_select", TORCH_FN(index_select_meta));
    lib->impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward_meta));
    lib->impl("where.self", TORCH_FN(where_meta));
    lib->impl("where.self_out", TORCH_FN(where_out_meta));
    lib->impl("max", TORCH_FN(max_meta));
    lib->impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(cpu_flash_meta));
    lib->impl("_scaled_dot_product_flash_attention_for_cpu_backward",
              TORCH_FN(cpu_flash_backward_meta));
    lib->impl("searchsorted.Tensor", TORCH_FN(searchsorted_meta));
    lib->impl("_grouped_mm", TORCH_FN(grouped_mm_meta));
  });
}

}  // namespace titan
