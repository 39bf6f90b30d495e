#include "core/config/param_groups.h"

#include <regex>

#include "core/base/errors.h"

namespace titan {

std::vector<ParamGroupRule> parse_param_groups(const std::vector<std::string>& entries) {
  std::vector<ParamGroupRule> out;
  for (const std::string& e : entries) {
    const auto eq = e.rfind('=');  // the regex may hold '=' itself, the optimizer cannot
    const std::string name = eq == std::string::npos ? "" : e.substr(eq + 1);
    if (eq == std::string::npos || eq == 0 || (name != "AdamW" && name != "Muon"))
      throw UserError("optimizer.param_groups: entry \"" + e +
                      "\" is not REGEX=OPTIMIZER; allowed: \"REGEX=AdamW\" or \"REGEX=Muon\"");
    const std::string pattern = e.substr(0, eq);
    try {
      std::regex re(pattern);
    } catch (const std::regex_error& err) {
      throw UserError("optimizer.param_groups: entry \"" + e + "\": \"" + pattern +
                      "\" is not a valid regular expression (ECMAScript): " + err.what());
    }
    out.push_back({pattern, name == "Muon" ? OptimizerKind::Muon : OptimizerKind::AdamW});
  }
  return out;
}

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

}  // namespace

std::vector<OptimizerKind> route_params(const std::vector<std::string>& names,
                                        const std::vector<std::vector<int64_t>>& shapes, bool muon,
                                        const std::vector<ParamGroupRule>& rules) {
  std::vector<OptimizerKind> out(names.size(), OptimizerKind::AdamW);
  if (!muon) return out;
  std::vector<std::regex> res;
  for (auto& r : rules) res.emplace_back(r.pattern);
  std::vector<bool> used(rules.size(), false);
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& n = names[i];
    const size_t dims = shapes[i].size();
    bool decided = false;
    for (size_t k = 0; k < rules.size(); ++k) {
      if (!std::regex_search(n, res[k])) continue;
      used[k] = true;  // a later entry that also matches counts as used, though not deciding
      if (decided) continue;
      decided = true;
      out[i] = rules[k].kind;
      if (out[i] == OptimizerKind::Muon && dims != 2 && dims != 3)
        throw UserError("optimizer.param_groups: \"" + rules[k].pattern + "=Muon\" gives Muon " +
                        n + " of shape " + shape_text(shapes[i]) +
                        "; Muon takes matrices only (2-D, or 3-D as E matrices)");
    }
    if (decided) continue;
    // The default: the embedding table and the output head are lookups and a classifier whose
    // rows are updated unevenly (Moonlight keeps them on AdamW); 1-D gains and biases have no
    // matrix to orthogonalize.
    const bool table = starts_with(n, "tok_embeddings.") || starts_with(n, "output.");
    out[i] = (!table && (dims == 2 || dims == 3)) ? OptimizerKind::Muon : OptimizerKind::AdamW;
  }
  for (size_t k = 0; k < rules.size(); ++k)
    if (!used[k])
      throw UserError("optimizer.param_groups: \"" + rules[k].pattern +
                      "\" matches no parameter name of this model (e.g. " +
                      (names.empty() ? std::string("none") : names.front()) +
                      "); allowed: a regex found in at least one name, first match wins");
  return out;
}

}  // namespace titan
