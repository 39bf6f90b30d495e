// Token-choice top-k routing: every token picks its top_k experts from a learned gate.
// Semantics follow torchtitan's TokenChoiceTopKRouter (../shared/REFERENCE.md, docs/moe.md):
// scores in fp32, selection over scores + expert_bias, gate weights from the unbiased scores.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace titan {

enum class ScoreFunc { Softmax, Sigmoid };

struct RouterArgs {
  int64_t num_experts = 8;
  int64_t top_k = 1;
  ScoreFunc score_func = ScoreFunc::Sigmoid;
  bool route_norm = false;   // divide the chosen gate weights by their sum (+1e-20)
  double route_scale = 1.0;  // then multiply them by this
  // Group-limited routing: 0 groups turns it off. Otherwise the experts form
  // num_expert_groups equal groups and each token chooses within its best num_limited_groups.
  int64_t num_expert_groups = 0;
  int64_t num_limited_groups = 0;
};

// Throws UserError naming the field when these numbers cannot route (top_k larger than the
// experts, groups that do not divide the experts, more limited groups than groups, ...).
// `where` names the model in the message, e.g. "deepseek_v3/debugmodel".
void validate_router_args(const RouterArgs& a, const std::string& where);

struct Routing {
  at::Tensor scores;      // (T, E) fp32: softmax or sigmoid of the gate logits
  at::Tensor top_scores;  // (T, K) fp32: gate weights of the chosen experts
  at::Tensor experts;     // (T, K) int64: the chosen experts, in topk's (unsorted) order
};

// x: (T, D); gate_w: (E, D); gate_b: (E) or undefined; expert_bias: (E) fp32 or undefined.
// The bias only changes which experts are chosen, never the gate weights.
Routing route_tokens(const at::Tensor& x, const at::Tensor& gate_w, const at::Tensor& gate_b,
                     const at::Tensor& expert_bias, const RouterArgs& a);

}  // namespace titan
