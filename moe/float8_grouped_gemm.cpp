#include "moe/float8_grouped_gemm.h"

#include "core/kernels/float8_linear.h"

namespace titan {

const char* float8_grouped_kernel_name(Float8GroupedKernel k) {
  return k == Float8GroupedKernel::ScaledGroupedMm ? "scaled_grouped_mm" : "emulated";
}

Float8GroupedKernel choose_float8_grouped_kernel(int cc, int64_t dim, int64_t hidden,
                                                 at::ScalarType dtype, std::string* why) {
  auto emulated = [&](const std::string& w) {
    *why = w;
    return Float8GroupedKernel::Emulated;
  };
  if (cc == 0) return emulated("the CPU has no float8 grouped GEMM");
  // torch 2.11 runs the rowwise grouped kernel on 9.0 (and 10.0, which torchao does not use
  // for this recipe); elsewhere it refuses.
  if (cc != 90)
    return emulated(
        "at::_scaled_grouped_mm's rowwise kernel needs compute capability 9.0, "
        "this GPU is " +
        std::to_string(cc / 10) + "." + std::to_string(cc % 10));
  if (dtype != at::kBFloat16)
    return emulated(std::string("the experts compute in ") + c10::toString(dtype) +
                    " and the rowwise grouped kernel gives bf16 only");
  if (dim % 16 != 0 || hidden % 16 != 0)
    return emulated("the experts' GEMM sizes (dim " + std::to_string(dim) + ", hidden " +
                    std::to_string(hidden) + ") are not multiples of 16");
  *why = "at::_scaled_grouped_mm on compute capability 9.0";
  return Float8GroupedKernel::ScaledGroupedMm;
}

namespace {

constexpr auto kE4m3 = at::kFloat8_e4m3fn;

// Rowwise cast of t over dim `dim` (the GEMM's reduction dim): scale has size 1 there.
float8::Quantized rowwise(const at::Tensor& t, int64_t dim) {
  return float8::quantize(t, kE4m3, /*rowwise=*/true, dim, /*power_of_2=*/true);
}

// The group of each of M rows: g with offs[g-1] <= row < offs[g]; E for rows past offs[E-1].
at::Tensor row_groups(const at::Tensor& offs, int64_t M) {
  return at::searchsorted(offs.contiguous(), at::arange(M, offs.options()), /*out_int32=*/false,
                          /*right=*/true);  // (M) int64
}

// Per group and column of t (M, C), the amax over the group's rows (torchao's
// per-group colwise scales of the weight-gradient GEMM). scale (E, C); row_scale (M, C): each
// row's group's scale (the spare group E holds the rows past the last offset, which no GEMM
// reads).
struct GroupCast {
  at::Tensor data, scale, row_scale;
};
GroupCast per_group_colwise(const at::Tensor& t, const at::Tensor& groups, int64_t E) {
  const int64_t M = t.size(0), C = t.size(1);
  // amax in t's dtype (a max is exact), reduced into zeros: |t| >= 0.
  at::Tensor amax = at::zeros({E + 1, C}, t.options())
                        .scatter_reduce_(0, groups.unsqueeze(1).expand({M, C}), t.abs(), "amax",
                                         /*include_self=*/true);
  at::Tensor scale = float8::amax_to_scale(amax, kE4m3, /*power_of_2=*/true);  // (E + 1, C)
  at::Tensor row_scale = scale.index_select(0, groups);                        // (M, C)
  return {float8::to_float8_saturated(t, row_scale, kE4m3), scale.narrow(0, 0, E), row_scale};
}

// float8 / scale in the compute dtype: exact, the scales being powers of 2.
at::Tensor dequantize(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype) {
  return data.to(at::kFloat).div(scale).to(dtype);
}

// torchao's emulation: dequantize, multiply in fp32, round to the operands' dtype. On CUDA
// the dequantized operands stay in their dtype (bf16: exact), the form in which the grouped
// kernels run sync-free; they accumulate in fp32 and round once as well.
at::Tensor emulated(GemmForm form, const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs,
                    GroupedKernel k) {
  const at::ScalarType t = a.is_cuda() ? a.scalar_type() : at::kFloat;
  if (form == GemmForm::TN) {
    const at::Tensor groups = row_groups(offs, a.size(0));
    const GroupCast qa = per_group_colwise(a, groups, offs.size(0));
    const GroupCast qb = per_group_colwise(b, groups, offs.size(0));
    return grouped_gemm(form, dequantize(qa.data, qa.row_scale, t),
                        dequantize(qb.data, qb.row_scale, t), offs, k)
        .to(a.scalar_type());
  }
  // NT: b's amax over K (its last dim); NN: over N (its dim 1). a's over its last dim.
  const float8::Quantized qa = rowwise(a, -1);
  const float8::Quantized qb = rowwise(b, form == GemmForm::NT ? -1 : 1);
  return grouped_gemm(form, dequantize(qa.data, qa.scale, t), dequantize(qb.data, qb.scale, t),
                      offs, k)
      .to(a.scalar_type());
}

// torchao's calls of at::_scaled_grouped_mm: a row-major, b column-major (per group),
// inverse scales, bf16 output, fast accumulation on all three GEMMs.
at::Tensor scaled_grouped(GemmForm form, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& offs) {
  TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kBFloat16,
              "float8 grouped GEMM: the scaled kernel takes bf16 CUDA operands");
  const at::Tensor o = offs.contiguous();
  if (form == GemmForm::TN) {  // (E, N, K): the scales flat, group-major (E * N), (E * K)
    const at::Tensor groups = row_groups(o, a.size(0));
    const GroupCast qa = per_group_colwise(a, groups, o.size(0));
    const GroupCast qb = per_group_colwise(b, groups, o.size(0));
    return at::_scaled_grouped_mm(qa.data.t().contiguous(), qb.data.t().contiguous().t(),
                                  qa.scale.reciprocal().reshape(-1),
                                  qb.scale.reciprocal().reshape(-1), o, std::nullopt, std::nullopt,
                                  at::kBFloat16, /*use_fast_accum=*/true);
  }
  const float8::Quantized qa = rowwise(a.contiguous(), -1);  // scale (M, 1)
  at::Tensor bd, bs;
  if (form == GemmForm::NT) {  // b (E, N, K): scale (E, N, 1); b^T (E, K, N) column-major
    const float8::Quantized qb = rowwise(b.contiguous(), -1);
    bd = qb.data.transpose(-2, -1);
    bs = qb.scale.squeeze(-1);
  } else {  // NN, b (E, N, K) is the right operand itself: scale (E, 1, K)
    const float8::Quantized qb = rowwise(b, 1);
    bd = qb.data.transpose(-2, -1).contiguous().transpose(-2, -1);
    bs = qb.scale.squeeze(1);
  }
  return at::_scaled_grouped_mm(qa.data, bd, qa.scale.squeeze(-1).reciprocal(), bs.reciprocal(), o,
                                std::nullopt, std::nullopt, at::kBFloat16,
                                /*use_fast_accum=*/true);
}

}  // namespace

at::Tensor float8_grouped_gemm(GemmForm form, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& offs, GroupedKernel k, Float8GroupedKernel f8) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "float8 grouped GEMM: fp32 or bf16 operands of one dtype, got ", a.scalar_type(),
              " and ", b.scalar_type());
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.dim() == 1,
              "float8 grouped GEMM: int32 offsets (E)");
  if (f8 == Float8GroupedKernel::ScaledGroupedMm && a.is_cuda())
    return scaled_grouped(form, a, b, offs);
  return emulated(form, a, b, offs, k);
}

}  // namespace titan
