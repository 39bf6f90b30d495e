#include "moe/experts.h"

#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/kernels/weight_grad_store.h"
#include "core/train/recompute.h"
#include "moe/float8_grouped_gemm.h"

// The device query needs the CUDA runtime headers; the wheel's libtorch_cuda provides the
// symbol. Without them (a CPU-only LibTorch) every device reports capability 0.
#if __has_include(<ATen/cuda/CUDAContextLight.h>) && __has_include(<cuda_runtime_api.h>)
#include <ATen/cuda/CUDAContextLight.h>
#define TITAN_MOE_CUDA_QUERY 1
#endif

namespace titan {

const char* experts_backend_name(ExpertsBackend b) {
  switch (b) {
    case ExpertsBackend::GroupedMM:
      return "grouped_mm";
    case ExpertsBackend::Cutlass:
      return "cutlass";
    case ExpertsBackend::Loop:
      return "loop";
  }
  return "?";
}

GroupedKernel grouped_kernel(ExpertsBackend b, at::Device device) {
  if (!device.is_cuda()) return GroupedKernel::Cpu;
  return b == ExpertsBackend::Cutlass ? GroupedKernel::Cutlass : GroupedKernel::GroupedMM;
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

namespace {

// Which grouped backends can run sync-free on a device of compute capability cc (0: not
// CUDA), for these GEMM shapes and compute dtype, and why not when one cannot.
struct GroupedSupport {
  bool grouped_mm = false, cutlass = false;
  std::string no_grouped_mm, no_cutlass;  // the reason, when false
  std::string allowed() const {
    std::string a = "auto";
    if (grouped_mm) a += ", grouped_mm";
    if (cutlass) a += ", cutlass";
    return a + ", loop";
  }
};

GroupedSupport grouped_support(int cc, const ExpertsGemmShape& shape, bool cutlass_built) {
  GroupedSupport s;
  // Both grouped kernels read 16-byte vectors of bf16 rows: the GEMMs' N and K (the model
  // dim and the expert hidden size) must be multiples of 8 elements; both are bf16-only
  // (ATen's _grouped_mm falls back to a loop that copies the offsets to the host for any
  // other dtype, and the CUTLASS instantiation is bf16).
  std::string shape_why;
  if (shape.dim % 8 != 0 || shape.hidden % 8 != 0)
    shape_why = "the experts' GEMM sizes (dim " + std::to_string(shape.dim) + ", hidden " +
                std::to_string(shape.hidden) + ") are not multiples of 8";
  else if (shape.dtype != at::kBFloat16)
    shape_why = std::string("the experts compute in ") + c10::toString(shape.dtype) +
                ", and the sync-free grouped kernels are bf16-only (training."
                "mixed_precision_param = \"bfloat16\" gives bf16)";
  // at::_grouped_mm is sync-free (its CUTLASS 3.x kernel) on 9.x and 10.x only.
  if (!(cc >= 90 && cc < 110))
    s.no_grouped_mm =
        "at::_grouped_mm is sync-free only on a CUDA device of compute "
        "capability 9.0 to 10.x";
  else
    s.no_grouped_mm = shape_why;
  if (!cutlass_built)
    s.no_cutlass = "this build has no CUTLASS kernel (nvcc and the nvidia-cutlass headers)";
  else if (cc < 80)
    s.no_cutlass = "the CUTLASS grouped GEMM needs a CUDA device of compute capability >= 8.0";
  else
    s.no_cutlass = shape_why;
  s.grouped_mm = s.no_grouped_mm.empty();
  s.cutlass = s.no_cutlass.empty();
  return s;
}

// A device that could run the kernel, refused only for the shapes or dtype: the choice falls
// back to a path that works instead of failing inside the run.
bool device_could(int cc, bool cutlass_built, ExpertsBackend b) {
  if (b == ExpertsBackend::GroupedMM) return cc >= 90 && cc < 110;
  return cutlass_built && cc >= 80;
}

ExpertsChoice auto_backend(const GroupedSupport& s, int cc, bool cutlass_built) {
  if (s.grouped_mm) return {ExpertsBackend::GroupedMM, "auto: compute capability 9.x/10.x"};
  if (s.cutlass) return {ExpertsBackend::Cutlass, "auto: CUDA from compute capability 8.0"};
  if (cc == 0) return {ExpertsBackend::Loop, "auto: on the CPU reading the counts is no sync"};
  ExpertsChoice c{ExpertsBackend::Loop, ""};
  if (device_could(cc, cutlass_built, ExpertsBackend::GroupedMM) ||
      device_could(cc, cutlass_built, ExpertsBackend::Cutlass)) {
    // The reason of the kernel this device has (the shapes or the dtype).
    c.reason = "auto: " +
               (device_could(cc, cutlass_built, ExpertsBackend::GroupedMM) ? s.no_grouped_mm
                                                                           : s.no_cutlass) +
               "; the loop syncs once per layer and forward";
    c.fell_back = true;
  } else if (cc >= 80) {
    c.reason = "auto: this build has no CUTLASS kernel; the loop syncs once per layer and forward";
  } else {
    c.reason = "auto: below compute capability 8.0; the loop syncs once per layer and forward";
  }
  return c;
}

}  // namespace

ExpertsChoice choose_experts_backend(const std::string& requested, int cc, bool static_step,
                                     const ExpertsGemmShape& shape, bool cutlass_built) {
  const GroupedSupport s = grouped_support(cc, shape, cutlass_built);
  const std::string where = cc > 0 ? "a CUDA device of compute capability " +
                                         std::to_string(cc / 10) + "." + std::to_string(cc % 10)
                                   : "the CPU";
  auto refuse = [&](const std::string& why) {
    throw UserError("moe.experts_backend = \"" + requested + "\" cannot run on " + where + ": " +
                    why + "; allowed here: " + s.allowed());
  };
  // Asked for a kernel the device has but these shapes or this dtype cannot use: the other
  // grouped kernel if it can, else the loop; said in the log line (never a failed check in
  // the middle of the run).
  auto fall_back = [&](const std::string& why) {
    ExpertsChoice c;
    c.fell_back = true;
    if (requested != "grouped_mm" && s.grouped_mm)
      c = {ExpertsBackend::GroupedMM,
           "asked for " + requested + ", but " + why + "; grouped_mm can", true};
    else if (requested != "cutlass" && s.cutlass)
      c = {ExpertsBackend::Cutlass, "asked for " + requested + ", but " + why + "; cutlass can",
           true};
    else
      c = {
          ExpertsBackend::Loop,
          "asked for " + requested + ", but " + why + "; the loop syncs once per layer and forward",
          true};
    return c;
  };
  if (requested == "grouped_mm") {
    if (s.grouped_mm) return {ExpertsBackend::GroupedMM, "asked for"};
    if (!device_could(cc, cutlass_built, ExpertsBackend::GroupedMM)) refuse(s.no_grouped_mm);
    return fall_back(s.no_grouped_mm);
  }
  if (requested == "cutlass") {
    if (s.cutlass) return {ExpertsBackend::Cutlass, "asked for"};
    if (!device_could(cc, cutlass_built, ExpertsBackend::Cutlass)) refuse(s.no_cutlass);
    return fall_back(s.no_cutlass);
  }
  if (requested == "loop")
    return {ExpertsBackend::Loop, "asked for; syncs once per layer and forward on CUDA"};
  if (requested == "auto" && static_step && cc == 0)
    return {ExpertsBackend::GroupedMM,
            "auto with compile.enable: the grouped layout with the CPU kernel, no host read"};
  if (requested == "auto") return auto_backend(s, cc, cutlass_built);
  throw UserError("moe.experts_backend = \"" + requested +
                  "\" is not a backend; allowed: auto, grouped_mm, cutlass, loop");
}

ExpertsBackend select_experts_backend(const std::string& requested, at::Device device,
                                      bool static_step, const ExpertsGemmShape& shape) {
  const int cc = cuda_compute_capability(device);
  ExpertsChoice c =
      choose_experts_backend(requested, cc, static_step, shape, cutlass_grouped_gemm_built());
  const std::string where =
      device.is_cuda() ? "CUDA device " + std::to_string(device.index()) + " (compute capability " +
                             std::to_string(cc / 10) + "." + std::to_string(cc % 10) + ")"
                       : "the CPU";
  const std::string line = std::string("=> MoE experts backend = ") +
                           experts_backend_name(c.backend) + " on " + where + " (" + c.reason + ")";
  if (c.fell_back)
    log_warn(line);
  else
    log_info(line);
  return c.backend;
}

int64_t experts_alignment(ExpertsBackend b) {
  return b == ExpertsBackend::Loop ? 0 : 8;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// No float8: the grouped experts op's GEMMs in high precision.
constexpr int64_t kNoFloat8 = -1;

// One GEMM of the grouped experts op: high precision, or float8 when f8 holds a
// Float8GroupedKernel (each GEMM then quantizes its own operands, as torchao's
// _Float8GroupedMM does for each of its three).
at::Tensor expert_gemm(GemmForm form, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& offs, GroupedKernel k, int64_t f8) {
  if (f8 == kNoFloat8) return grouped_gemm(form, a, b, offs, k);
  return float8_grouped_gemm(form, a, b, offs, k, static_cast<Float8GroupedKernel>(f8));
}

// y, h1, h3 of the grouped SwiGLU: h1 = x w1^T, h3 = x w3^T, y = (silu(h1) * h3) w2^T.
std::vector<at::Tensor> grouped_swiglu_outputs(const at::Tensor& x, const at::Tensor& w1,
                                               const at::Tensor& w2, const at::Tensor& w3,
                                               const at::Tensor& offs, GroupedKernel k,
                                               int64_t f8) {
  at::Tensor h1 = expert_gemm(GemmForm::NT, x, w1, offs, k, f8);  // (M, H)
  at::Tensor h3 = expert_gemm(GemmForm::NT, x, w3, offs, k, f8);
  at::Tensor y = expert_gemm(GemmForm::NT, at::silu(h1) * h3, w2, offs, k, f8);  // (M, D)
  return {y, h1, h3};
}

// The grouped SwiGLU with a hand-written backward, every GEMM a grouped GEMM of one kernel.
// `saved` holds y, h1, h3 of an op-level checkpoint's forward (then nothing is computed
// again), or nothing. f8: kNoFloat8, or the Float8GroupedKernel of all eight GEMMs (the
// backward's too: torchao's recipe takes both gradients in float8).
struct GroupedSwiGLU : public torch::autograd::Function<GroupedSwiGLU> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                            const at::Tensor& w2, const at::Tensor& w3, const at::Tensor& offs,
                            int64_t kernel, int64_t f8, at::TensorList saved) {
    const auto k = static_cast<GroupedKernel>(kernel);
    std::vector<at::Tensor> o =
        saved.empty() ? grouped_swiglu_outputs(x, w1, w2, w3, offs, k, f8) : saved.vec();
    ctx->saved_data["kernel"] = kernel;
    ctx->saved_data["f8"] = f8;
    ctx->save_for_backward({x, w1, w2, w3, offs, o[1], o[2]});
    return saved.empty() ? o[0] : o[0].detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto k = static_cast<GroupedKernel>(ctx->saved_data["kernel"].toInt());
    const int64_t f8 = ctx->saved_data["f8"].toInt();
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w1 = s[1], &w2 = s[2], &w3 = s[3], &offs = s[4];
    const at::Tensor &h1 = s[5], &h3 = s[6];
    at::Tensor dy = grad_out[0].contiguous();
    at::Tensor a = at::silu(h1);
    at::Tensor dg = expert_gemm(GemmForm::NN, dy, w2, offs, k, f8);  // (M, H)
    at::Tensor dh1 = at::silu_backward(dg * h3, h1);
    at::Tensor dh3 = dg * a;
    at::Tensor ah3 = a * h3;
    at::Tensor dw1, dw2, dw3;
    // A zero-bubble I: the three weight-gradient grouped GEMMs wait for the W.
    if (WeightGradStore* store = weight_grad_deferral()) {
      auto defer = [&](int i, const at::Tensor& w, const at::Tensor& g, const at::Tensor& in) {
        if (ctx->needs_input_grad(i))
          store->add(
              w, [g, in, offs, k, f8] { return expert_gemm(GemmForm::TN, g, in, offs, k, f8); });
      };
      defer(2, w2, dy, ah3);
      defer(1, w1, dh1, x);
      defer(3, w3, dh3, x);
    } else {
      dw2 = expert_gemm(GemmForm::TN, dy, ah3, offs, k, f8);  // (E, D, H)
      dw1 = expert_gemm(GemmForm::TN, dh1, x, offs, k, f8);   // (E, H, D)
      dw3 = expert_gemm(GemmForm::TN, dh3, x, offs, k, f8);
    }
    at::Tensor dx = expert_gemm(GemmForm::NN, dh1, w1, offs, k, f8) +
                    expert_gemm(GemmForm::NN, dh3, w3, offs, k, f8);  // (M, D)
    // offs, kernel, f8 and up to three saved outputs get none (trailing undefined ones are
    // dropped when fewer were passed).
    variable_list g{dx, dw1, dw2, dw3};
    g.resize(10);
    return g;
  }
};

// y, h1, h3 of the per-expert SwiGLU, rows split by the host counts.
std::vector<at::Tensor> loop_outputs(const at::Tensor& x, const at::Tensor& w1,
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
  return {at::cat(ys), at::cat(h1s), at::cat(h3s)};
}

// Per-expert SwiGLU with a hand-written backward: forward saves the host counts, so the
// backward splits by them without reading the device again. `saved`: as GroupedSwiGLU's.
struct LoopExperts : public torch::autograd::Function<LoopExperts> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                               const at::Tensor& w2, const at::Tensor& w3,
                               const std::vector<int64_t>& counts, at::TensorList saved) {
    std::vector<at::Tensor> o = saved.empty() ? loop_outputs(x, w1, w2, w3, counts) : saved.vec();
    ctx->saved_data["counts"] = c10::IValue(counts);
    ctx->save_for_backward({x, w1, w2, w3, o[1], o[2]});
    return {saved.empty() ? o[0] : o[0].detach()};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w1 = s[1], &w2 = s[2], &w3 = s[3];
    auto xs = x.split_with_sizes(counts);
    auto h1s = s[4].split_with_sizes(counts);
    auto h3s = s[5].split_with_sizes(counts);
    auto dys = grad_out[0].contiguous().split_with_sizes(counts);
    std::vector<at::Tensor> dxs, dys_, ah3s, dh1s, dh3s;
    for (size_t e = 0; e < counts.size(); ++e) {
      const int64_t i = static_cast<int64_t>(e);
      const at::Tensor &h1 = h1s[e], &h3 = h3s[e], &dy = dys[e];
      at::Tensor a = at::silu(h1);
      at::Tensor dg = at::matmul(dy, w2[i]);            // (n_e, H)
      at::Tensor dh1 = at::silu_backward(dg * h3, h1);  // d silu(h1)
      at::Tensor dh3 = dg * a;
      dys_.push_back(dy);
      ah3s.push_back(a * h3);
      dh1s.push_back(dh1);
      dh3s.push_back(dh3);
      dxs.push_back(at::matmul(dh1, w1[i]) + at::matmul(dh3, w3[i]));  // (n_e, D)
    }
    // Per expert g^T in: dw2 (D, H) from dy and a*h3, dw1 and dw3 (H, D) from dh1, dh3 and x.
    using Rows = std::vector<at::Tensor>;
    auto gemms = [](const Rows& g, const Rows& in) {
      Rows out;
      for (size_t e = 0; e < g.size(); ++e) out.push_back(at::matmul(g[e].t(), in[e]));
      return at::stack(out);
    };
    const Rows xv(xs.begin(), xs.end());
    at::Tensor dw1, dw2, dw3;
    if (WeightGradStore* store = weight_grad_deferral()) {  // a zero-bubble I: W runs them
      auto defer = [&](int i, const at::Tensor& w, const Rows& g, const Rows& in) {
        if (ctx->needs_input_grad(i)) store->add(w, [gemms, g, in] { return gemms(g, in); });
      };
      defer(2, w2, dys_, ah3s);
      defer(1, w1, dh1s, xv);
      defer(3, w3, dh3s, xv);
    } else {
      dw2 = gemms(dys_, ah3s);
      dw1 = gemms(dh1s, xv);
      dw3 = gemms(dh3s, xv);
    }
    variable_list g{at::cat(dxs), dw1, dw2, dw3};
    g.resize(8);  // counts and up to three saved outputs: none
    return g;
  }
};

// One grouped GEMM y = x w^T per group (NT) with its backward: dx = dy w (NN), dw = dy^T x
// (TN), the same kernel. The building block of the composed experts with extras.
struct GroupedLinear : public torch::autograd::Function<GroupedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& offs, int64_t kernel) {
    ctx->saved_data["kernel"] = kernel;
    ctx->save_for_backward({x, w, offs});
    return grouped_gemm(GemmForm::NT, x, w, offs, static_cast<GroupedKernel>(kernel));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto k = static_cast<GroupedKernel>(ctx->saved_data["kernel"].toInt());
    auto s = ctx->get_saved_variables();
    at::Tensor dy = grad_out[0].contiguous();
    at::Tensor dx = grouped_gemm(GemmForm::NN, dy, s[1], s[2], k);
    at::Tensor dw = grouped_gemm(GemmForm::TN, dy, s[0], s[2], k);
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor grouped_swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                          const at::Tensor& w3, const at::Tensor& offs, GroupedKernel k,
                          std::optional<Float8GroupedKernel> float8) {
  const int64_t f8 = float8 ? static_cast<int64_t>(*float8) : kNoFloat8;
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.size(0) == w1.size(0),
              "grouped_swiglu: one int32 offset per expert");
  // Op-level checkpointing saves the three GEMM outputs and hands them back in the recompute.
  if (op_tape_recording()) {
    std::vector<at::Tensor> o = grouped_swiglu_outputs(x, w1, w2, w3, offs, k, f8);
    op_tape_save(o);
    return o[0];
  }
  std::vector<at::Tensor> saved;
  if (op_tape_replaying()) saved = op_tape_restore(3);
  return GroupedSwiGLU::apply(x, w1, w2, w3, offs, static_cast<int64_t>(k), f8,
                              at::TensorList(saved));
}

at::Tensor grouped_experts(const at::Tensor& x_padded, const at::Tensor& w1, const at::Tensor& w2,
                           const at::Tensor& w3, const Dispatch& d, ExpertsBackend b,
                           std::optional<Float8GroupedKernel> float8) {
  TORCH_CHECK(d.align > 0 && x_padded.size(0) == d.padded_rows,
              "grouped_experts: x must be in the dispatch's aligned layout");
  return grouped_experts(x_padded, w1, w2, w3, d.offs, b, float8);
}

at::Tensor grouped_experts(const at::Tensor& x_padded, const at::Tensor& w1, const at::Tensor& w2,
                           const at::Tensor& w3, const at::Tensor& offs, ExpertsBackend b,
                           std::optional<Float8GroupedKernel> float8) {
  TORCH_CHECK(b != ExpertsBackend::Loop, "grouped_experts: the loop is no grouped backend");
  // titan-train estimate's meta-device step: ATen has no meta kernel for the casts (abs.out),
  // and the float8 temporaries are not counted (nor are the float8 linears'), so the experts
  // are measured in high precision there.
  if (x_padded.is_meta()) float8.reset();
  // bf16 on CUDA: the form both CUDA kernels take (and torchtitan's).
  const at::ScalarType t = x_padded.is_cuda() ? at::kBFloat16 : x_padded.scalar_type();
  at::Tensor y = grouped_swiglu(x_padded.to(t), w1.to(t), w2.to(t), w3.to(t), offs,
                                grouped_kernel(b, x_padded.device()), float8);
  return y.to(x_padded.scalar_type());
}

at::Tensor loop_experts(const at::Tensor& x_sorted, const at::Tensor& w1, const at::Tensor& w2,
                        const at::Tensor& w3, const std::vector<int64_t>& host_counts) {
  TORCH_CHECK(static_cast<int64_t>(host_counts.size()) == w1.size(0),
              "loop_experts: one count per expert");
  if (op_tape_recording()) {  // as grouped_swiglu
    std::vector<at::Tensor> o = loop_outputs(x_sorted, w1, w2, w3, host_counts);
    op_tape_save(o);
    return o[0];
  }
  std::vector<at::Tensor> saved;
  if (op_tape_replaying()) saved = op_tape_restore(3);
  return LoopExperts::apply(x_sorted, w1, w2, w3, host_counts, at::TensorList(saved))[0];
}

at::Tensor clamped_swiglu(const at::Tensor& h1, const at::Tensor& h3, double limit, double alpha) {
  if (limit <= 0) return at::silu(h1) * h3;
  at::Tensor g = h1.clamp_max(limit);
  // clamp_min then clamp_max, not clamp: the same values and gradients (both bounds
  // inclusive), and their backward has meta kernels (clamp's uses logical_and: estimate).
  return g * at::sigmoid(g * alpha) * (h3.clamp_min(-limit).clamp_max(limit) + 1);
}

at::Tensor grouped_experts_extras(const at::Tensor& x_padded, const at::Tensor& w1,
                                  const at::Tensor& w2, const at::Tensor& w3,
                                  const ExpertsExtras& ex, const at::Tensor& offs,
                                  ExpertsBackend b) {
  TORCH_CHECK(b != ExpertsBackend::Loop, "grouped_experts_extras: the loop is no grouped backend");
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.size(0) == w1.size(0),
              "grouped_experts_extras: one int32 offset per expert");
  const at::ScalarType t = x_padded.is_cuda() ? at::kBFloat16 : x_padded.scalar_type();
  const int64_t M = x_padded.size(0), E = w1.size(0);
  const auto k = static_cast<int64_t>(grouped_kernel(b, x_padded.device()));
  // Each row's group: the first end offset beyond it (M): rows past offs[E-1] (the static
  // exchange's empty slots) are masked to zero, so no unwritten GEMM row reaches a gradient.
  at::Tensor rows = at::arange(M, offs.options());
  at::Tensor gid = at::searchsorted(offs, rows, /*out_int32=*/false, /*right=*/true)
                       .clamp_max(E - 1);                             // (M) int64
  at::Tensor valid = rows.lt(offs.narrow(0, E - 1, 1)).unsqueeze(1);  // (M, 1)
  const at::Tensor x = x_padded.to(t);
  auto linear = [&](const at::Tensor& in, const at::Tensor& w, const at::Tensor& bias) {
    at::Tensor y = GroupedLinear::apply(in, w.to(t), offs, k);
    if (bias.defined()) y = y + bias.to(t).index_select(0, gid);
    return at::where(valid, y, at::zeros({}, y.options()));
  };
  at::Tensor a = clamped_swiglu(linear(x, w1, ex.b1), linear(x, w3, ex.b3), ex.limit, ex.alpha);
  return linear(a, w2, ex.b2).to(x_padded.scalar_type());  // (M, D)
}

at::Tensor loop_experts_extras(const at::Tensor& x_sorted, const at::Tensor& w1,
                               const at::Tensor& w2, const at::Tensor& w3, const ExpertsExtras& ex,
                               const std::vector<int64_t>& host_counts) {
  TORCH_CHECK(static_cast<int64_t>(host_counts.size()) == w1.size(0),
              "loop_experts_extras: one count per expert");
  int64_t n = 0;
  for (int64_t c : host_counts) n += c;
  auto xs = x_sorted.narrow(0, 0, n).split_with_sizes(host_counts);
  std::vector<at::Tensor> ys;
  for (size_t e = 0; e < host_counts.size(); ++e) {
    const int64_t i = static_cast<int64_t>(e);
    auto linear = [&](const at::Tensor& in, const at::Tensor& w, const at::Tensor& bias) {
      at::Tensor y = at::matmul(in, w[i].t());
      return bias.defined() ? y + bias[i] : y;
    };
    at::Tensor a =
        clamped_swiglu(linear(xs[e], w1, ex.b1), linear(xs[e], w3, ex.b3), ex.limit, ex.alpha);
    ys.push_back(linear(a, w2, ex.b2));  // (n_e, D)
  }
  at::Tensor y = at::cat(ys);
  if (n < x_sorted.size(0))
    y = at::cat({y, at::zeros({x_sorted.size(0) - n, y.size(1)}, y.options())});
  return y;
}

}  // namespace titan
