#include "moe/grouped_gemm.h"

#if defined(TITAN_HAVE_CUTLASS) && __has_include(<ATen/cuda/CUDAContext.h>)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#define TITAN_MOE_CUTLASS 1
#endif

namespace titan {

const char* grouped_kernel_name(GroupedKernel k) {
  switch (k) {
    case GroupedKernel::GroupedMM:
      return "grouped_mm";
    case GroupedKernel::Cutlass:
      return "cutlass";
    case GroupedKernel::Cpu:
      return "cpu";
  }
  return "?";
}

bool cutlass_grouped_gemm_built() {
#ifdef TITAN_MOE_CUTLASS
  return true;
#else
  return false;
#endif
}

namespace {

// at::_grouped_mm with the operands of each form (its CPU kernel too).
at::Tensor aten_grouped(GemmForm form, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor& offs) {
  switch (form) {
    case GemmForm::NT:
      return at::_grouped_mm(a, b.transpose(-2, -1), offs);
    case GemmForm::NN:
      return at::_grouped_mm(a, b, offs);
    case GemmForm::TN:
      return at::_grouped_mm(a.t(), b, offs);
  }
  TORCH_CHECK(false, "grouped_gemm: unknown form");
}

#ifdef TITAN_MOE_CUTLASS
// 16-byte aligned and contiguous, as the kernel's vector loads need (a copy otherwise).
at::Tensor aligned_operand(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

at::Tensor cutlass_grouped(GemmForm form, const at::Tensor& a0, const at::Tensor& b0,
                           const at::Tensor& offs) {
  TORCH_CHECK(a0.is_cuda() && a0.scalar_type() == at::kBFloat16 &&
                  b0.scalar_type() == at::kBFloat16 && offs.scalar_type() == at::kInt,
              "cutlass grouped GEMM: bf16 CUDA operands and int32 offsets");
  const c10::cuda::CUDAGuard guard(a0.device());  // the kernel sizes its grid for this device
  at::Tensor a = aligned_operand(a0), b = aligned_operand(b0);
  at::Tensor o = offs.contiguous();
  moe_detail::GroupedGemmArgs args;
  args.form = form;
  args.E = o.size(0);
  args.M = a.size(0);
  at::Tensor out;
  if (form == GemmForm::TN) {  // a (M, N), b (M, K) -> (E, N, K)
    TORCH_CHECK(b.size(0) == a.size(0), "cutlass grouped GEMM: TN operands of unequal rows");
    args.N = a.size(1);
    args.K = b.size(1);
    out = at::empty({args.E, args.N, args.K}, a.options());
  } else {  // b (E, N, K)
    TORCH_CHECK(b.dim() == 3 && b.size(0) == args.E, "cutlass grouped GEMM: one weight per group");
    args.N = b.size(1);
    args.K = b.size(2);
    TORCH_CHECK(a.size(1) == (form == GemmForm::NT ? args.K : args.N),
                "cutlass grouped GEMM: inner dimensions differ");
    // Zeroed: rows past offs[E-1] belong to no group and the kernel never writes them; left
    // as allocated they could hold NaN that a later product with a zero weight would spread.
    // A memset of M x N bf16 costs far less than the GEMM that follows.
    out = at::zeros({args.M, form == GemmForm::NT ? args.N : args.K}, a.options());
  }
  if (args.E == 0 || out.numel() == 0) return out;
  at::Tensor ws = at::empty({moe_detail::grouped_gemm_workspace_bytes(args.E)},
                            a.options().dtype(at::kByte));
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.offs = o.data_ptr<int32_t>();
  args.out = out.data_ptr();
  args.workspace = ws.data_ptr();
  args.stream = at::cuda::getCurrentCUDAStream(a.device().index()).stream();
  const char* err = moe_detail::cutlass_grouped_gemm_bf16(args);
  TORCH_CHECK(err == nullptr, err ? err : "");
  return out;
}
#endif

}  // namespace

at::Tensor grouped_gemm(GemmForm form, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor& offs, GroupedKernel k) {
  if (!a.is_cuda() || k != GroupedKernel::Cutlass) return aten_grouped(form, a, b, offs);
#ifdef TITAN_MOE_CUTLASS
  return cutlass_grouped(form, a, b, offs);
#else
  TORCH_CHECK(false, "grouped_gemm: this build has no CUTLASS kernel (no nvcc or nvidia-cutlass)");
#endif
}

}  // namespace titan
