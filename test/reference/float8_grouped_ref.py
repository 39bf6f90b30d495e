#!/usr/bin/env python3
"""torchao 0.18's float8 rowwise grouped GEMM (torchao.prototype.moe_training.fp8_grouped_mm,
_Float8GroupedMM) on the CPU: the reference of titan-train's float8 grouped experts op
(moe/float8_grouped_gemm.*, test/moe/test_moe_float8.cpp).

torchao's own op runs only through Triton kernels and at::_scaled_grouped_mm (CUDA SM90), and
torchao 0.18 has no emulated mode for it. So this file rebuilds _Float8GroupedMM's forward and
backward step by step with torchao's own quantization helpers from the same wheel
(float8_utils.tensor_to_scale / to_fp8_saturated, moe_training.utils
.torch_to_3d_rowwise_float8_transpose_rhs and torch_to_float8_per_group_colwise: the torch
references of its Triton kernels), e4m3 with power-of-2 scales as its forward sets them, and
emulates each at::_scaled_grouped_mm as torchao emulates _scaled_mm: dequantize, fp32 matmul
per group, round to the output dtype. torchao's out_dtype is bf16; here it is the inputs'
dtype (bf16 or fp32), as titan-train's op returns.

Inputs (--inputs, safetensors written by the C++ test), per dtype tag D in --dtypes:
  "x.D" (M, D_), "w1.D", "w3.D" (E, H, D_), "w2.D" (E, D_, H), "dy.D" (M, D_); "offs" (E) int32.
Output (--out): "D.out", "D.dx", "D.dw1", "D.dw2", "D.dw3": the SwiGLU of three float8 grouped
  GEMMs, h = silu(x w1^T) * (x w3^T), y = h w2^T per group, then backward of (y * dy).sum();
  and "D.gemm.out", "D.gemm.grad_a", "D.gemm.grad_b": one float8 grouped GEMM x w1^T alone,
  backward with dy1 = "dy1.D" (M, H).
Exits 3, printing why, when torchao 0.18 cannot be imported.
"""
import argparse

import torch
from safetensors.torch import load_file, save_file
from torchao_version import require_torchao

E4M3 = torch.float8_e4m3fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="bf16,f32")
    a = ap.parse_args()
    require_torchao()
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training.utils import (
        torch_to_3d_rowwise_float8_transpose_rhs,
        torch_to_float8_per_group_colwise,
    )

    def axiswise(t, dim):
        """tensor_to_scale + to_fp8_saturated, axiswise over `dim`, power-of-2 scales."""
        s = tensor_to_scale(t, E4M3, scaling_granularity=ScalingGranularity.AXISWISE,
                            axiswise_dim=dim, round_scales_to_power_of_2=True)
        return to_fp8_saturated(t.to(torch.float32) * s, E4M3), s

    def groups(offs):
        start = 0
        for g, end in enumerate(offs.tolist()):
            yield g, start, end
            start = end

    def grouped_2d_3d(a8, sa, b8, sb, offs, out_dtype):
        """Emulated _scaled_grouped_mm, a (M, K) with scales (M, 1), b (E, K, N), (E, 1, N)."""
        out = torch.zeros(a8.shape[0], b8.shape[2], dtype=torch.float32)
        for g, s, e in groups(offs):
            out[s:e] = (a8[s:e].float() / sa[s:e]) @ (b8[g].float() / sb[g])
        return out.to(out_dtype)

    class Float8GroupedMM(torch.autograd.Function):
        """_Float8GroupedMM's steps (A (M, K), B_t (E, K, N)), emulated GEMMs."""

        @staticmethod
        def forward(ctx, A, B_t, offs):
            ctx.save_for_backward(A, B_t, offs)
            a8, sa = axiswise(A, -1)  # triton_fp8_rowwise_2d_scale_and_cast: per row
            b8, sb = axiswise(B_t, -2)  # triton_fp8_colwise_3d_scale_and_cast: over K
            return grouped_2d_3d(a8, sa, b8, sb, offs, A.dtype)

        @staticmethod
        def backward(ctx, go):
            A, B_t, offs = ctx.saved_tensors
            g8, sg = axiswise(go, -1)
            b8, sb = torch_to_3d_rowwise_float8_transpose_rhs(
                B_t, E4M3, round_scales_to_power_of_2=True)  # (E, N, K), (E, 1, K)
            grad_A = grouped_2d_3d(g8, sg, b8, sb, offs, go.dtype)
            go8, sgo = torch_to_float8_per_group_colwise(go, offs, E4M3, True)
            a8, sa = torch_to_float8_per_group_colwise(A, offs, E4M3, True)
            N, K = go.shape[1], A.shape[1]
            grad_B = torch.zeros(B_t.shape[0], N, K, dtype=torch.float32)
            for g, s, e in groups(offs):
                lhs = go8[s:e].float() / sgo[g * N:(g + 1) * N]
                rhs = a8[s:e].float() / sa[g * K:(g + 1) * K]
                grad_B[g] = lhs.t() @ rhs
            return grad_A, grad_B.to(go.dtype).transpose(-2, -1), None

    def f8mm(x, w, offs):  # x (M, K), w (E, N, K): torchtitan's _grouped_mm(x, w^T, offs)
        return Float8GroupedMM.apply(x, w.transpose(-2, -1), offs)

    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    t = load_file(a.inputs)
    offs = t["offs"]
    out = {}
    for tag in a.dtypes.split(","):
        dt = dtypes[tag]
        x = t[f"x.{tag}"].clone().requires_grad_(True)
        w = {n: t[f"{n}.{tag}"].clone().requires_grad_(True) for n in ("w1", "w2", "w3")}
        assert x.dtype == dt
        h = torch.nn.functional.silu(f8mm(x, w["w1"], offs)) * f8mm(x, w["w3"], offs)
        y = f8mm(h, w["w2"], offs)
        y.backward(t[f"dy.{tag}"])
        out[f"{tag}.out"] = y.detach().contiguous()
        out[f"{tag}.dx"] = x.grad.contiguous()
        for n in ("w1", "w2", "w3"):
            out[f"{tag}.d{n}"] = w[n].grad.contiguous()
        x1 = t[f"x.{tag}"].clone().requires_grad_(True)
        w1 = t[f"w1.{tag}"].clone().requires_grad_(True)
        y1 = f8mm(x1, w1, offs)
        y1.backward(t[f"dy1.{tag}"])
        out[f"{tag}.gemm.out"] = y1.detach().contiguous()
        out[f"{tag}.gemm.grad_a"] = x1.grad.contiguous()
        out[f"{tag}.gemm.grad_b"] = w1.grad.contiguous()
    save_file(out, a.out)


if __name__ == "__main__":
    main()
