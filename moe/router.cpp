#include "moe/router.h"

#include <limits>

#include "core/base/errors.h"

namespace titan {

void validate_router_args(const RouterArgs& a, const std::string& where) {
  auto fail = [&](const std::string& what) {
    throw UserError("MoE router of " + where + ": " + what);
  };
  if (a.num_experts < 1) fail("num_experts = " + std::to_string(a.num_experts) + "; allowed: >= 1");
  if (a.top_k < 1 || a.top_k > a.num_experts)
    fail("top_k = " + std::to_string(a.top_k) + " with num_experts = " +
         std::to_string(a.num_experts) + "; allowed: 1 <= top_k <= num_experts");
  if (a.route_scale <= 0) fail("route_scale = " + std::to_string(a.route_scale) + "; allowed: > 0");
  if (a.num_expert_groups == 0) {
    if (a.num_limited_groups != 0)
      fail("num_limited_groups = " + std::to_string(a.num_limited_groups) +
           " without num_expert_groups; allowed: 0 when num_expert_groups = 0");
    return;
  }
  if (a.num_expert_groups < 0 || a.num_experts % a.num_expert_groups != 0)
    fail("num_expert_groups = " + std::to_string(a.num_expert_groups) +
         " does not divide num_experts = " + std::to_string(a.num_experts) +
         "; allowed: a divisor of num_experts");
  const int64_t per_group = a.num_experts / a.num_expert_groups;
  if (per_group < 2)
    fail("num_expert_groups = " + std::to_string(a.num_expert_groups) + " leaves " +
         std::to_string(per_group) +
         " expert per group; allowed: at least 2 experts per group (a group scores its top 2)");
  if (a.num_limited_groups < 1 || a.num_limited_groups > a.num_expert_groups)
    fail("num_limited_groups = " + std::to_string(a.num_limited_groups) +
         " with num_expert_groups = " + std::to_string(a.num_expert_groups) +
         "; allowed: 1 <= num_limited_groups <= num_expert_groups");
  if (a.top_k > a.num_limited_groups * per_group)
    fail("top_k = " + std::to_string(a.top_k) + " exceeds the " +
         std::to_string(a.num_limited_groups * per_group) +
         " experts of num_limited_groups = " + std::to_string(a.num_limited_groups) +
         " groups; allowed: top_k <= num_limited_groups * num_experts / num_expert_groups");
}

Routing route_tokens(const at::Tensor& x, const at::Tensor& gate_w, const at::Tensor& gate_b,
                     const at::Tensor& expert_bias, const RouterArgs& a) {
  const int64_t E = a.num_experts;
  TORCH_CHECK(x.dim() == 2 && gate_w.size(0) == E, "route_tokens: x (T, D), gate_w (E, D)");
  at::Tensor logits = at::linear(x, gate_w, gate_b);  // (T, E), compute dtype
  // fp32 scores: bf16 softmax/sigmoid here is known to make training unstable.
  at::Tensor scores = a.score_func == ScoreFunc::Sigmoid ? at::sigmoid(logits.to(at::kFloat))
                                                         : at::softmax(logits.to(at::kFloat), 1);
  at::Tensor choice = expert_bias.defined() ? scores + expert_bias : scores;  // (T, E)
  if (a.num_expert_groups > 0) {
    const int64_t G = a.num_expert_groups;
    at::Tensor grouped = choice.view({-1, G, E / G});                    // (T, G, E/G)
    at::Tensor group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);  // (T, G)
    at::Tensor keep = std::get<1>(group_scores.topk(a.num_limited_groups, -1, true, false));
    at::Tensor drop = at::ones_like(group_scores, at::kBool).scatter_(1, keep, false);  // (T, G)
    choice = grouped.masked_fill(drop.unsqueeze(-1), -std::numeric_limits<double>::infinity())
                 .view({-1, E});
  }
  at::Tensor experts = std::get<1>(choice.topk(a.top_k, -1, /*largest=*/true, /*sorted=*/false));
  at::Tensor top = scores.gather(1, experts);  // (T, K): unbiased
  if (a.route_norm) top = top / (top.sum(-1, true) + 1e-20);
  if (a.route_scale != 1.0) top = top * a.route_scale;
  return {scores, top, experts};
}

}  // namespace titan
