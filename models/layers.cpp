#include "models/layers.h"

#include <cmath>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace titan {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  // ATen's kernel upcasts internally; one op instead of five keeps the autograd graph small.
  return at::rms_norm(x, {x.size(-1)}, w.to(x.scalar_type()), eps);
}

RopeTables rope_tables(int64_t head_dim, int64_t max_seq_len, double theta, const RopeScaling& s,
                       at::Device device) {
  // freqs_i = theta^(-2i/D), i < D/2, computed in double then stored as fp32.
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor freqs = at::pow(theta, -at::arange(0, head_dim, 2, opts).slice(0, 0, head_dim / 2) /
                                        static_cast<double>(head_dim));
  freqs = freqs.to(at::kFloat).to(at::kDouble);  // torchtitan builds freqs in fp32
  if (s.factor != 1.0) {
    // Llama-3.1 scaling: long wavelengths are divided by `factor`, short ones kept, and the
    // band in between is interpolated smoothly.
    const double low_wavelen = s.original_max_seq_len / s.low_freq_factor;
    const double high_wavelen = s.original_max_seq_len / s.high_freq_factor;
    auto acc = freqs.accessor<double, 1>();
    for (int64_t i = 0; i < freqs.size(0); ++i) {
      double f = acc[i];
      double wavelen = 2 * M_PI / f;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        acc[i] = f / s.factor;
      } else {
        double smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
        acc[i] = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  at::Tensor t = at::arange(max_seq_len, opts.dtype(at::kFloat));
  at::Tensor angles = at::outer(t, freqs.to(at::kFloat));  // (T, D/2), fp32 like torchtitan
  return {at::polar(at::ones_like(angles), angles).to(device)};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {
  // Adjacent pairs as complex numbers times e^(i * angle): one complex multiply.
  const int64_t T = x.size(1), D = x.size(3);
  at::Tensor xc =
      at::view_as_complex(x.to(at::kFloat).reshape({x.size(0), T, x.size(2), D / 2, 2}));
  at::Tensor f = rope.cis.slice(0, 0, T).view({1, T, 1, D / 2});
  return at::view_as_real(xc * f).flatten(3).to(x.scalar_type());
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Hkv = k.size(2);
  at::Tensor qt = q.transpose(1, 2);  // (B, H, T, D)
  at::Tensor kt = k.transpose(1, 2);
  at::Tensor vt = v.transpose(1, 2);
  if (Hkv != H) {  // repeat each kv head H/Hkv times
    const int64_t rep = H / Hkv;
    kt = kt.unsqueeze(2).expand({B, Hkv, rep, T, k.size(3)}).reshape({B, H, T, k.size(3)});
    vt = vt.unsqueeze(2).expand({B, Hkv, rep, T, v.size(3)}).reshape({B, H, T, v.size(3)});
  }
  at::Tensor o = at::scaled_dot_product_attention(qt, kt, vt, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                  /*is_causal=*/true, scale);
  return o.transpose(1, 2).reshape({B, T, H * v.size(3)});
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3) {
  return at::linear(at::silu(at::linear(x, w1)) * at::linear(x, w3), w2);
}

void trunc_normal_(at::Tensor& t, double mean, double std, double a, double b, at::Generator& gen) {
  // Sample U in [cdf(a), cdf(b)] and map through the inverse normal CDF.
  auto cdf = [](double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))); };
  const double lo = cdf((a - mean) / std), hi = cdf((b - mean) / std);
  at::NoGradGuard ng;
  t.uniform_(2 * lo - 1, 2 * hi - 1, gen);
  t.erfinv_();
  t.mul_(std * std::sqrt(2.0)).add_(mean);
  t.clamp_(a, b);
}

namespace {

thread_local int g_recompute_depth = 0;

struct CheckpointBlock : public torch::autograd::Function<CheckpointBlock> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                int64_t fn_ptr, const at::Tensor& x,
                                                at::TensorList weights) {
    ctx->saved_data["fn"] = fn_ptr;
    std::vector<at::Tensor> to_save{x};
    to_save.insert(to_save.end(), weights.begin(), weights.end());
    ctx->save_for_backward(to_save);
    const auto& fn = *reinterpret_cast<const BlockFn*>(fn_ptr);
    at::NoGradGuard no_grad;
    return {fn(x, weights.vec())};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto& fn = *reinterpret_cast<const BlockFn*>(ctx->saved_data["fn"].toInt());
    auto saved = ctx->get_saved_variables();
    // Recompute on detached inputs with grad enabled, then differentiate the local graph.
    std::vector<at::Tensor> inputs;
    for (auto& s : saved) inputs.push_back(s.detach().requires_grad_(s.requires_grad()));
    at::Tensor x = inputs[0];
    std::vector<at::Tensor> w(inputs.begin() + 1, inputs.end());
    at::Tensor y;
    {
      at::AutoGradMode grad(true);
      ++g_recompute_depth;
      try {
        y = fn(x, w);
      } catch (...) {
        --g_recompute_depth;
        throw;
      }
      --g_recompute_depth;
    }
    std::vector<at::Tensor> need;
    std::vector<size_t> where;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].requires_grad()) need.push_back(inputs[i]), where.push_back(i);
    auto grads = torch::autograd::grad({y}, need, {grad_out[0]}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    torch::autograd::variable_list out(inputs.size() + 1);  // [fn_ptr, x, w...]
    for (size_t j = 0; j < where.size(); ++j) out[where[j] + 1] = grads[j];
    return out;
  }
};

}  // namespace

at::Tensor checkpoint_block(const BlockFn& fn, const at::Tensor& x,
                            const std::vector<at::Tensor>& weights) {
  if (!at::GradMode::is_enabled()) return fn(x, weights);
  return CheckpointBlock::apply(reinterpret_cast<int64_t>(&fn), x, at::TensorList(weights))[0];
}

bool is_recomputing() {
  return g_recompute_depth > 0;
}

}  // namespace titan
