// Which optimizer each parameter gets under optimizer.name = "Muon".
//
// The Kimi/Moonlight recipe (docs/training.md): Muon for the weight matrices of the blocks
// (attention, dense and shared-expert feed-forward, routed experts as E matrices each, the
// router), AdamW for the token embedding, the output head, norms and biases. Entries of
// optimizer.param_groups ("REGEX=AdamW" or "REGEX=Muon") come first: the first whose regex
// is found in a parameter's name (std::regex_search, ECMAScript) decides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace titan {

enum class OptimizerKind { AdamW, Muon };

struct ParamGroupRule {
  std::string pattern;  // as written, for messages
  OptimizerKind kind;
};

// Parses optimizer.param_groups; a malformed entry (no '=', an optimizer other than AdamW or
// Muon, a regex that does not compile) throws UserError naming the key.
std::vector<ParamGroupRule> parse_param_groups(const std::vector<std::string>& entries);

// Routes each parameter (name, its whole shape before any parallelism cuts it). `muon`
// false: everything AdamW. A rule matching no parameter, or one that gives Muon a tensor
// that is not 2-D (one matrix) or 3-D (E matrices), throws UserError naming the key.
std::vector<OptimizerKind> route_params(const std::vector<std::string>& names,
                                        const std::vector<std::vector<int64_t>>& shapes, bool muon,
                                        const std::vector<ParamGroupRule>& rules);

}  // namespace titan
