// Which optimizer each parameter gets under optimizer.name = "Muon".
//
// The Kimi/Moonlight recipe (docs/training.md): Muon for the weight matrices of the blocks
// (attention, dense and shared-expert feed-forward, routed experts as E matrices each, the
// router), AdamW for the token embedding, the output head, norms and biases. Entries of
// optimizer.param_groups ("REGEX=AdamW" or "REGEX=Muon", optionally followed by
// ":lr=X" and/or ":weight_decay=Y", the group's own peak lr and weight decay) come first: the
// first whose regex is found in a parameter's name (std::regex_search, ECMAScript) decides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace titan {

enum class OptimizerKind { AdamW, Muon };

// A group's own settings; negative: not set (the optimizer's keys apply).
struct ParamOverride {
  double lr = -1;            // peak lr, scaled by the schedule as optimizer.lr / muon_lr are
  double weight_decay = -1;  // replaces optimizer.weight_decay / muon_weight_decay
};

struct ParamGroupRule {
  std::string pattern;  // as written, for messages
  OptimizerKind kind;
  ParamOverride set;
};

// Parses optimizer.param_groups; a malformed entry (no '=', an optimizer other than AdamW or
// Muon, a regex that does not compile, an option other than lr > 0 or weight_decay >= 0)
// throws UserError naming the key. The optimizer is the last "=AdamW" or "=Muon" that ends
// the entry or is followed by ':' (a regex may hold '=' and ':' itself).
std::vector<ParamGroupRule> parse_param_groups(const std::vector<std::string>& entries);

// The settings of the rule that decides `name` (the first whose regex is found in it); none
// when no rule matches.
ParamOverride param_override(const std::string& name, const std::vector<ParamGroupRule>& rules);

// Routes each parameter (name, its whole shape before any parallelism cuts it). `muon`
// false: everything AdamW. A rule matching no parameter, or one that gives Muon a tensor
// that is not 2-D (one matrix) or 3-D (E matrices), throws UserError naming the key.
std::vector<OptimizerKind> route_params(const std::vector<std::string>& names,
                                        const std::vector<std::vector<int64_t>>& shapes, bool muon,
                                        const std::vector<ParamGroupRule>& rules);

}  // namespace titan
