// Float8 training linear: out = x w^T (+ b) with its three GEMMs (output, input gradient,
// weight gradient) computed on float8 operands scaled dynamically on the device, following
// torchao 0.18's Float8Linear recipes (docs/float8.md). One autograd node with a hand-written
// backward: ATen's scaled matmuls have none.
//
// Scales are fp32 device tensors computed from the current amax (no host read, no state
// between steps), so the op can sit inside a captured step. Masters and the saved
// activations stay in high precision; float8 exists only inside the op.
//
// Kernels, chosen per call from the device and the recipe:
//   scaled_mm  ATen's at::_scaled_mm (CUDA from SM89; rowwise scales from SM90; on the CPU,
//              oneDNN's kernel, which takes per-tensor scales only), with torchao's
//              non-emulated arithmetic (inverse scales, rowwise post-scaling).
//   emulated   quantize to float8, dequantize to fp32, matmul in fp32, round to x's dtype:
//              torchao's `emulate = true` arithmetic, the same numbers on every device.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace titan::float8 {

// torchao's Float8LinearRecipeName.
//   Tensorwise        one scale per tensor; x and w in e4m3, the output gradient in e5m2.
//   Rowwise           one scale per row of each GEMM's left operand and per column of its
//                     right one (the amax over the GEMM's reduction dim), rounded down to a
//                     power of 2; e4m3 everywhere.
//   RowwiseWithGwHp   Rowwise for the output; for the input gradient the output gradient
//                     rowwise and w tensorwise (e4m3, power-of-2 scales); the weight gradient
//                     in high precision.
enum class Recipe { Tensorwise, Rowwise, RowwiseWithGwHp };

// "tensorwise", "rowwise", "rowwise_with_gw_hp".
const char* recipe_name(Recipe r);
// nullopt for anything else (the caller names the key and the allowed values).
std::optional<Recipe> parse_recipe(const std::string& name);
// "tensorwise, rowwise, rowwise_with_gw_hp": for error messages.
const char* recipe_names();

enum class Kernel { ScaledMm, Emulated };

struct Options {
  Recipe recipe = Recipe::Tensorwise;
  // torchao's `emulate`: every GEMM emulated, whatever the device can do.
  bool emulate = false;
  // false: ATen's CPU _scaled_mm was measured too slow on this processor at start
  // (probe_cpu_scaled_mm), so CPU GEMMs are emulated; CUDA is unaffected.
  bool cpu_scaled_mm = true;
};

// The kernel float8_linear uses for `opts` on `device`: ScaledMm where at::_scaled_mm takes
// the recipe's scales there (CPU: tensorwise; CUDA: SM89+ tensorwise, SM90+ rowwise),
// Emulated elsewhere or when opts.emulate. Reads the device's properties (host only).
Kernel kernel_for(const Options& opts, const c10::Device& device);
// "scaled_mm" or "emulated"; and one line for the start-up log: recipe, kernel and why.
const char* kernel_name(Kernel k);
std::string describe(const Options& opts, const c10::Device& device);

struct Quantized;

// ATen's CPU _scaled_mm (oneDNN's float8 GEMM) runs hundreds of times slower than the
// emulation on some processors (seen on one with AMX and AVX512-FP16: a debugmodel step of
// 84 s against 0.18 s), while elsewhere it is on par (docs/float8.md, "A slow CPU
// _scaled_mm"). The probe times one small tensorwise GEMM of the output's shape class both
// ways, best of a few calls after a warm-up: a host timing at start, never in the step.
struct CpuProbe {
  double scaled_mm_ms = 0;  // best of the timed calls
  double emulated_ms = 0;
  bool slow = false;  // scaled_mm_ms > kCpuSlowFactor x emulated_ms (+ a floor for noise)
  std::string describe() const;  // "CPU _scaled_mm 0.41 ms against 0.22 ms emulated (1.9x)"
};
// A factor far from both regimes: on par is 0.5x to 3x, the slow path ~500x.
constexpr double kCpuSlowFactor = 8.0;
// out_dtype: the model's compute dtype (fp32 or bf16). planted_delay_ms (test seam,
// debug.float8_plant_slow_scaled_mm_ms): added to every timed _scaled_mm call, a stand-in
// for the slow kernel on processors that do not have it.
CpuProbe probe_cpu_scaled_mm(at::ScalarType out_dtype, double planted_delay_ms = 0);

// y = x w^T (+ bias) with float8 GEMMs. x: (..., K) fp32/bf16/fp16; w: (N, K) in x's dtype;
// bias: (N) or undefined. Returns (..., N) in x's dtype. Saves x and w (high precision, as
// torchao does) and re-quantizes them in backward; gives dx and dw (and dbias through the
// ordinary add). Internal invariants are TORCH_CHECKs.
//
// w8: w already cast by its owner (FSDP's float8 all-gather, docs/float8.md): e4m3 data (N, K)
// and its 0-d fp32 tensorwise scale; tensorwise recipe only. The output and input-gradient
// GEMMs then take it as it is (torchao's Float8TrainingTensor weight: no re-cast, in forward
// or backward), the node saves it instead of w, and w's values are never read: w may be a
// stand-in of w's shape and dtype whose only role is to receive dw.
at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                         const Options& opts, const Quantized* w8 = nullptr);

// One dynamic cast, exposed for tests and FSDP's float8 all-gather: the float8 tensor and its
// fp32 scale (float8 = saturate(x * scale), x ~ float8 / scale).
//   rowwise false: amax over all of x, scale shape ().
//   rowwise true:  amax over dim `dim` (keepdim), one scale per slice.
// scale = float8_max / max(amax, 1e-12) in fp64, then fp32; power_of_2 rounds it down to a
// power of 2.
// torchao's amax_to_scale: float8_max / max(amax, 1e-12) in fp64, then fp32; power_of_2
// rounds it down to a power of 2. amax: any shape, any float dtype.
at::Tensor amax_to_scale(const at::Tensor& amax, at::ScalarType float8_dtype, bool power_of_2);
// torchao's to_fp8_saturated(x * scale): x * scale in fp32, clamped to +-float8_max, cast.
at::Tensor to_float8_saturated(const at::Tensor& x, const at::Tensor& scale,
                               at::ScalarType float8_dtype);

struct Quantized {
  at::Tensor data;   // float8, x's shape and strides
  at::Tensor scale;  // fp32
};
Quantized quantize(const at::Tensor& x, at::ScalarType float8_dtype, bool rowwise, int64_t dim,
                   bool power_of_2);

}  // namespace titan::float8
