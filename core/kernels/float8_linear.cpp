#include "core/kernels/float8_linear.h"

#include "core/kernels/float8_tp.h"
#include "core/kernels/weight_grad_store.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <chrono>
#include <cstdio>
#include <limits>
#include <thread>

// The capability query needs the CUDA runtime headers; without them (a CPU-only LibTorch)
// every device reports capability 0 and gets the emulated kernel.
#if __has_include(<ATen/cuda/CUDAContextLight.h>) && __has_include(<cuda_runtime_api.h>)
#include <ATen/cuda/CUDAContextLight.h>
#define TITAN_FLOAT8_CUDA_QUERY 1
#endif

namespace titan::float8 {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// torchao's EPS: the amax floor, so an all-zero tensor (or row) gets a finite scale.
constexpr double kAmaxFloor = 1e-12;

double float8_max(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn:
      return 448.0;
    case at::kFloat8_e5m2:
      return 57344.0;
    default:
      TORCH_CHECK(false, "float8: unsupported float8 dtype ", t);
  }
}

// How one operand of one GEMM is cast (torchao's CastConfig). hp: left in high precision
// (both operands of that GEMM then are).
struct Cast {
  bool hp = false;
  bool rowwise = false;
  at::ScalarType dtype = at::kFloat8_e4m3fn;
};

// The six casts of a linear's three GEMMs, as torchao's Float8LinearConfig.from_recipe_name
// sets them (the *_gw / *_gi ones default to the forward cast of the same tensor).
struct Plan {
  Cast x, w, go;  // output GEMM (x, w); go for the input gradient
  Cast w_gi;      // w for the input gradient
  Cast x_gw, go_gw;
  bool power_of_2 = false;
};

Plan plan_of(Recipe r) {
  const Cast e4m3_tw{false, false, at::kFloat8_e4m3fn};
  const Cast e4m3_rw{false, true, at::kFloat8_e4m3fn};
  const Cast hp{true, false, at::kFloat8_e4m3fn};
  switch (r) {
    case Recipe::Tensorwise: {
      const Cast e5m2_tw{false, false, at::kFloat8_e5m2};
      return {e4m3_tw, e4m3_tw, e5m2_tw, e4m3_tw, e4m3_tw, e5m2_tw, false};
    }
    case Recipe::Rowwise:
      return {e4m3_rw, e4m3_rw, e4m3_rw, e4m3_rw, e4m3_rw, e4m3_rw, true};
    case Recipe::RowwiseWithGwHp:
      return {e4m3_rw, e4m3_rw, e4m3_rw, e4m3_tw, hp, hp, true};
  }
  TORCH_CHECK(false, "float8: unknown recipe");
}

int cuda_capability(const c10::Device& device) {
#ifdef TITAN_FLOAT8_CUDA_QUERY
  if (!device.is_cuda() || !at::hasCUDA()) return 0;
  const auto* p = at::cuda::getDeviceProperties(device.has_index() ? device.index() : 0);
  return p->major * 10 + p->minor;
#else
  (void)device;
  return 0;
#endif
}

// A float8 GEMM operand: data (rows, cols) and its scale: () tensorwise, (rows, 1) or
// (1, cols) rowwise. rowwise says which, as torchao's axiswise_dim does.
struct Operand {
  at::Tensor data, scale;
  bool rowwise = false;
  Operand t() const { return {data.t(), scale.dim() > 1 ? scale.t() : scale, rowwise}; }
};

// `reduce`: the amax is all-reduced (max) over the tp group first (a tp slice's operand whose
// amax spans the cut dimension), so the scale is the whole tensor's.
Operand cast(const at::Tensor& x, const Cast& c, int64_t dim, bool power_of_2,
             const AmaxAllReduce* reduce = nullptr) {
  if (!reduce) {
    Quantized q = quantize(x, c.dtype, c.rowwise, dim, power_of_2);
    return {q.data, q.scale, c.rowwise};
  }
  // fp32: exact for every input dtype, and what every backend reduces.
  at::Tensor amax =
      (c.rowwise ? at::amax(at::abs(x), {dim}, /*keepdim=*/true) : at::amax(at::abs(x)))
          .to(at::kFloat);
  reduce->max_(amax);
  const at::Tensor scale = amax_to_scale(amax, c.dtype, power_of_2);
  return {to_float8_saturated(x, scale, c.dtype), scale, c.rowwise};
}

// The operands of y = x w^T and the dimensions they hold: x (M, K), w (N, K), go (M, N).
enum class Dim { M, N, K };

// Whether a cast of an operand holding dims (a, b) needs the tp all-reduce: it does when the
// operand holds the cut dimension and its amax spans it (tensorwise: every dim; rowwise: the
// GEMM's reduction dim `over`).
bool spans_cut(TpSplit split, Dim a, Dim b, const Cast& c, Dim over) {
  if (split == TpSplit::None) return false;
  const Dim cut = split == TpSplit::Column ? Dim::N : Dim::K;
  if (a != cut && b != cut) return false;
  return !c.rowwise || over == cut;
}

bool row_major(const at::Tensor& t) {
  return t.stride(0) > t.stride(1) && t.stride(1) == 1;
}

// torchao's float8_mm with emulate = true: dequantize (float8 / scale in fp32), fp32 matmul,
// round to the output dtype.
at::Tensor gemm_emulated(const Operand& a, const Operand& b, at::ScalarType out_dtype) {
  return at::mm(a.data.to(at::kFloat).div(a.scale), b.data.to(at::kFloat).div(b.scale))
      .to(out_dtype);
}

// torchao's float8_mm without emulation (preprocess_addmm + addmm_float8_unwrapped):
// at::_scaled_mm takes inverse scales, a row-major and b column-major. A tensorwise scale
// meeting a rowwise one is repeated to rowwise. Rowwise without fast accumulation runs the
// tensorwise kernel with unit scales and applies the scales after, and rowwise output is
// bf16 (then converted) because the rowwise kernel has no fp32/fp16 output.
at::Tensor gemm_scaled(const Operand& a, const Operand& b, at::ScalarType out_dtype,
                       bool fast_accum) {
  at::Tensor ad = row_major(a.data) ? a.data : a.data.contiguous();
  at::Tensor bd = row_major(b.data) ? b.data.t().contiguous().t() : b.data;
  at::Tensor as = a.scale, bs = b.scale;
  if (!a.rowwise && b.rowwise) as = as.repeat({ad.size(0)}).reshape({-1, 1});
  if (a.rowwise && !b.rowwise) bs = bs.repeat({bd.size(1)}).reshape({1, -1});
  at::Tensor a_inv = as.reciprocal(), b_inv = bs.reciprocal();
  const bool rowwise = as.dim() == 2 && as.size(0) == ad.size(0) && as.size(1) == 1 &&
                       bs.dim() == 2 && bs.size(0) == 1 && bs.size(1) == bd.size(1);
  at::Tensor post;
  if (rowwise && !fast_accum) {
    post = a_inv * b_inv;  // (M, N)
    a_inv = at::ones({}, a_inv.options());
    b_inv = at::ones({}, a_inv.options());
  }
  const bool via_bf16 = rowwise && (out_dtype == at::kFloat || out_dtype == at::kHalf);
  at::Tensor out = at::_scaled_mm(ad, bd, a_inv, b_inv, std::nullopt, std::nullopt,
                                  via_bf16 ? at::kBFloat16 : out_dtype, fast_accum);
  if (post.defined()) out.mul_(post);
  return via_bf16 ? out.to(out_dtype) : out;
}

// Both operands float8 (or both hp: the plain matmul in the operands' dtype).
at::Tensor gemm(const Operand& a, const Operand& b, at::ScalarType out_dtype, Kernel k,
                bool fast_accum) {
  return k == Kernel::Emulated ? gemm_emulated(a, b, out_dtype)
                               : gemm_scaled(a, b, out_dtype, fast_accum);
}

// torchao's per-GEMM use_fast_accum defaults: on for the output, off for the gradients.
constexpr bool kFastAccumOutput = true;
constexpr bool kFastAccumGrads = false;

struct Float8LinearFn : torch::autograd::Function<Float8LinearFn> {
  // x2: (M, K), w: (N, K). Returns (M, N). w8_data (N, K) e4m3 and w8_scale () fp32, when
  // defined, are w already cast (tensorwise only): both GEMMs that take w use them as they are
  // (torchao's Float8TrainingTensor weight), and w itself is not read, only its gradient given.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x2, const at::Tensor& w,
                            const std::optional<at::Tensor>& w8_data_opt,
                            const std::optional<at::Tensor>& w8_scale_opt, int64_t recipe,
                            bool emulated, const TpSlice& tp) {
    // Optionals: autograd records an undefined tensor argument as an input it cannot describe.
    const at::Tensor w8_data = w8_data_opt.value_or(at::Tensor());
    const at::Tensor w8_scale = w8_scale_opt.value_or(at::Tensor());
    const bool pre = w8_data.defined();
    // The weight as received (not unpacked from a saved variable): a deferred W
    // (core/kernels/weight_grad_store.h) backpropagates its gradient from it.
    ctx->saved_data["w"] = w;
    ctx->saved_data["recipe"] = recipe;
    ctx->saved_data["emulated"] = emulated;
    ctx->saved_data["tp_split"] = static_cast<int64_t>(tp.split);
    if (tp.reduce) ctx->saved_data["tp_reduce"] = at::IValue::make_capsule(tp.reduce);
    const Plan p = plan_of(static_cast<Recipe>(recipe));
    const Kernel k = emulated ? Kernel::Emulated : Kernel::ScaledMm;
    const AmaxAllReduce* r = tp.reduce.get();
    auto red = [&](Dim a, Dim b, const Cast& c, Dim over) {
      return spans_cut(tp.split, a, b, c, over) ? r : nullptr;
    };
    // The amax of x is over K per row (dim -1); of w^T (K, N) over K per column (dim 0). A
    // pre-cast w carries its whole weight's scale already (FSDP's float8 all-gather).
    const Operand xq = cast(x2, p.x, -1, p.power_of_2, red(Dim::M, Dim::K, p.x, Dim::K));
    const Operand wq = pre ? Operand{w8_data.t(), w8_scale, false}
                           : cast(w.t(), p.w, 0, p.power_of_2, red(Dim::N, Dim::K, p.w, Dim::K));
    // The pre-cast weight is saved instead of w: w may be a stand-in without values. A
    // tensorwise w's scale is the input-gradient GEMM's too (same dtype, same amax): saved,
    // so the backward casts w without another amax (and, under TP, all-reduce).
    const bool same_w = !pre && !p.w.rowwise && !p.w_gi.rowwise && p.w.dtype == p.w_gi.dtype;
    ctx->save_for_backward({x2, pre ? w8_data : w, w8_scale, same_w ? wq.scale : at::Tensor()});
    return gemm(xq, wq, x2.scalar_type(), k, kFastAccumOutput);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x2 = saved[0];  // (M, K)
    const at::Tensor& w = saved[1];   // (N, K): high precision, or e4m3 with saved[2] its scale
    const bool pre = saved[2].defined();
    const Plan p = plan_of(static_cast<Recipe>(ctx->saved_data["recipe"].toInt()));
    const Kernel k = ctx->saved_data["emulated"].toBool() ? Kernel::Emulated : Kernel::ScaledMm;
    const auto split = static_cast<TpSplit>(ctx->saved_data["tp_split"].toInt());
    c10::intrusive_ptr<AmaxAllReduce> reduce;
    if (ctx->saved_data.count("tp_reduce"))
      reduce = c10::static_intrusive_pointer_cast<AmaxAllReduce>(
          ctx->saved_data["tp_reduce"].toCapsule());
    auto red = [&](Dim a, Dim b, const Cast& c, Dim over) {
      return spans_cut(split, a, b, c, over) ? reduce.get() : nullptr;
    };
    const at::Tensor go = grads[0].reshape({-1, grads[0].size(-1)});  // (M, N)

    at::Tensor dx, dw;
    // Tensorwise go is cast the same way for both GEMMs (one e5m2 scale): once, as torchao
    // casts it once (its TP styles' NoopFwToFloat8BwDynamic); under TP one amax all-reduce.
    Operand go_tw;
    if (ctx->needs_input_grad(0)) {
      // dx = go w: go's amax over N per row; w^T (K, N)'s over N per row, then transposed.
      const Operand goq = cast(go, p.go, -1, p.power_of_2, red(Dim::M, Dim::N, p.go, Dim::N));
      if (!p.go.rowwise) go_tw = goq;
      // Pre-cast (tensorwise): the forward's cast of w, which is this GEMM's cast too.
      const at::Tensor& w_scale = saved[3];  // the forward's tensorwise scale of w, or none
      const Operand wq =
          pre ? Operand{w, saved[2], false}
          : w_scale.defined()
              ? Operand{to_float8_saturated(w, w_scale, p.w_gi.dtype), w_scale, false}
              : cast(w.t(), p.w_gi, -1, p.power_of_2, red(Dim::N, Dim::K, p.w_gi, Dim::N)).t();
      dx = gemm(goq, wq, go.scalar_type(), k, kFastAccumGrads);
    }
    if (ctx->needs_input_grad(1)) {
      // dw = go^T x: both amaxes over M (dim 0). A zero-bubble I leaves it to the W
      // (core/kernels/weight_grad_store.h), with go and x (high precision) stashed; under TP
      // its amax all-reduces then run in the W, which every tp rank runs in the same order.
      auto grad_w = [go, x2, p, k, go_tw, reduce, split] {
        if (p.go_gw.hp) return at::mm(go.t(), x2);
        auto red = [&](Dim a, Dim b, const Cast& c, Dim over) {
          return spans_cut(split, a, b, c, over) ? reduce.get() : nullptr;
        };
        const bool same = go_tw.data.defined() && !p.go_gw.rowwise && p.go_gw.dtype == p.go.dtype;
        const Operand goq =
            same ? go_tw.t()
                 : cast(go, p.go_gw, 0, p.power_of_2, red(Dim::M, Dim::N, p.go_gw, Dim::M)).t();
        const Operand xq = cast(x2, p.x_gw, 0, p.power_of_2, red(Dim::M, Dim::K, p.x_gw, Dim::M));
        return gemm(goq, xq, go.scalar_type(), k, kFastAccumGrads);
      };
      if (WeightGradStore* store = weight_grad_deferral())
        store->add(ctx->saved_data["w"].toTensor(), grad_w);
      else
        dw = grad_w();
    }
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

const char* recipe_name(Recipe r) {
  switch (r) {
    case Recipe::Tensorwise:
      return "tensorwise";
    case Recipe::Rowwise:
      return "rowwise";
    case Recipe::RowwiseWithGwHp:
      return "rowwise_with_gw_hp";
  }
  return "?";
}

std::optional<Recipe> parse_recipe(const std::string& name) {
  for (Recipe r : {Recipe::Tensorwise, Recipe::Rowwise, Recipe::RowwiseWithGwHp})
    if (name == recipe_name(r)) return r;
  return std::nullopt;
}

const char* recipe_names() {
  return "tensorwise, rowwise, rowwise_with_gw_hp";
}

Kernel kernel_for(const Options& opts, const c10::Device& device) {
  if (opts.emulate) return Kernel::Emulated;
  const bool rowwise = opts.recipe != Recipe::Tensorwise;
  if (device.is_cpu()) return rowwise || !opts.cpu_scaled_mm ? Kernel::Emulated : Kernel::ScaledMm;
  const int cc = cuda_capability(device);
  return cc >= (rowwise ? 90 : 89) ? Kernel::ScaledMm : Kernel::Emulated;
}

const char* kernel_name(Kernel k) {
  return k == Kernel::ScaledMm ? "scaled_mm" : "emulated";
}

std::string describe(const Options& opts, const c10::Device& device) {
  const Kernel k = kernel_for(opts, device);
  std::string why;
  if (opts.emulate)
    why = "emulate = true";
  else if (k == Kernel::ScaledMm)
    why = device.is_cpu() ? "ATen's CPU _scaled_mm (per-tensor scales)" : "ATen's _scaled_mm";
  else if (device.is_cpu() && opts.recipe == Recipe::Tensorwise)
    why = "ATen's CPU _scaled_mm measured slow on this processor at start";
  else if (device.is_cpu())
    why = "ATen's CPU _scaled_mm takes per-tensor scales only";
  else
    why = std::string("the GPU has no float8 ") +
          (opts.recipe == Recipe::Tensorwise ? "GEMM (SM89+)" : "rowwise GEMM (SM90+)");
  return std::string("float8: recipe ") + recipe_name(opts.recipe) + ", " + kernel_name(k) +
         " GEMMs on " + device.str() + " (" + why + ")";
}

Quantized quantize(const at::Tensor& x, at::ScalarType float8_dtype, bool rowwise, int64_t dim,
                   bool power_of_2) {
  // at::amax over every dim, not at::max: the CPU kernel of a full max fills its result with
  // the host value it reduced (aten::fill_ with a changing scalar, a capture break), while
  // amax reduces into the tensor. The same value: a max is exact.
  at::Tensor amax = rowwise ? at::amax(at::abs(x), {dim}, /*keepdim=*/true) : at::amax(at::abs(x));
  at::Tensor scale = amax_to_scale(amax, float8_dtype, power_of_2);
  return {to_float8_saturated(x, scale, float8_dtype), scale};
}

at::Tensor amax_to_scale(const at::Tensor& amax, at::ScalarType float8_dtype, bool power_of_2) {
  // torchao computes fmax / amax as amax.reciprocal() * fmax in fp64 (Python's float / tensor).
  at::Tensor scale = amax.to(at::kDouble)
                         .clamp_min(kAmaxFloor)
                         .reciprocal()
                         .mul(float8_max(float8_dtype))
                         .to(at::kFloat);
  return power_of_2 ? at::exp2(at::floor(at::log2(scale))) : scale;
}

at::Tensor to_float8_saturated(const at::Tensor& x, const at::Tensor& scale,
                               at::ScalarType float8_dtype) {
  // The clamp is torchao's (eager casts in torch 2.11 do not saturate).
  const double fmax = float8_max(float8_dtype);
  return x.to(at::kFloat).mul(scale).clamp(-fmax, fmax).to(float8_dtype);
}

at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                         const Options& opts, const Quantized* w8) {
  return float8_linear(x, w, bias, opts, w8, TpSlice{});
}

at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                         const Options& opts, const Quantized* w8, const TpSlice& tp) {
  TORCH_CHECK(tp.split == TpSplit::None || tp.reduce,
              "float8_linear: a tensor-parallel slice needs its amax all-reduce");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1),
              "float8_linear: x (..., K) and w (N, K) expected, got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "float8_linear: x is ", x.scalar_type(),
              " and w is ", w.scalar_type(), "; the same dtype is expected");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && x.element_size() >= 2,
              "float8_linear: x must be fp32, bf16 or fp16, got ", x.scalar_type());
  TORCH_CHECK(x.device() == w.device(), "float8_linear: x and w on different devices");
  if (w8) {
    TORCH_CHECK(opts.recipe == Recipe::Tensorwise,
                "float8_linear: a pre-cast weight takes the tensorwise recipe, not ",
                recipe_name(opts.recipe));
    TORCH_CHECK(w8->data.scalar_type() == at::kFloat8_e4m3fn && w8->data.sizes() == w.sizes() &&
                    w8->scale.dim() == 0 && w8->scale.scalar_type() == at::kFloat,
                "float8_linear: a pre-cast weight is e4m3 data of w's shape ", w.sizes(),
                " and a 0-d fp32 scale, got ", w8->data.scalar_type(), w8->data.sizes(), " and ",
                w8->scale.scalar_type(), w8->scale.sizes());
  }
  const Kernel k = kernel_for(opts, x.device());
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  std::optional<at::Tensor> w8_data, w8_scale;
  if (w8) {
    w8_data = w8->data;
    w8_scale = w8->scale;
  }
  at::Tensor y = Float8LinearFn::apply(x2, w, w8_data, w8_scale, static_cast<int64_t>(opts.recipe),
                                       k == Kernel::Emulated, tp);
  auto shape = x.sizes().vec();
  shape.back() = w.size(0);
  y = y.reshape(shape);
  return bias.defined() ? y + bias.to(y.scalar_type()) : y;
}

std::string CpuProbe::describe() const {
  char buf[160];
  std::snprintf(buf, sizeof buf, "CPU _scaled_mm %.3g ms against %.3g ms emulated (%.3gx)",
                scaled_mm_ms, emulated_ms, emulated_ms > 0 ? scaled_mm_ms / emulated_ms : 0.0);
  return buf;
}

CpuProbe probe_cpu_scaled_mm(at::ScalarType out_dtype, double planted_delay_ms) {
  // (128, 256) x (256, 256): a debug model's linear on a short batch, about 8 MFLOP, well
  // under a millisecond either way on a current core; the slow path takes tens of ms.
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x = at::randn({128, 256}, opts), w = at::randn({256, 256}, opts);
  const Quantized xq = quantize(x, at::kFloat8_e4m3fn, false, -1, false);
  const Quantized wq = quantize(w, at::kFloat8_e4m3fn, false, -1, false);
  const Operand a{xq.data, xq.scale, false}, b{wq.data.t(), wq.scale, false};
  using Clock = std::chrono::steady_clock;
  auto best_ms = [&](Kernel k, double delay_ms) {
    double best = std::numeric_limits<double>::infinity();
    for (int i = 0; i < 4; ++i) {  // the first call warms up (oneDNN primitive creation)
      const auto t0 = Clock::now();
      at::Tensor y = gemm(a, b, out_dtype, k, kFastAccumOutput);
      if (delay_ms > 0)
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(delay_ms));
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (i > 0) best = std::min(best, ms);
    }
    return best;
  };
  CpuProbe p;
  p.emulated_ms = best_ms(Kernel::Emulated, 0);
  p.scaled_mm_ms = best_ms(Kernel::ScaledMm, planted_delay_ms);
  // The 0.5 ms floor keeps a sub-millisecond hiccup of a loaded machine from switching.
  p.slow = p.scaled_mm_ms > kCpuSlowFactor * p.emulated_ms + 0.5;
  return p;
}

}  // namespace titan::float8
