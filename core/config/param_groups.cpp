#include "core/config/param_groups.h"

#include <cmath>
#include <regex>

#include "core/base/errors.h"

namespace titan {

namespace {

[[noreturn]] void bad_entry(const std::string& e, const std::string& why) {
  throw UserError("optimizer.param_groups: entry \"" + e + "\" " + why +
                  "; allowed: \"REGEX=AdamW\" or \"REGEX=Muon\", optionally followed by "
                  "\":lr=X\" (X > 0) and/or \":weight_decay=Y\" (Y >= 0)");
}

// One ":key=value" option of an entry into `set`.
void parse_option(const std::string& e, const std::string& opt, ParamOverride& set) {
  const auto eq = opt.find('=');
  const std::string key = opt.substr(0, eq);
  if (eq == std::string::npos || (key != "lr" && key != "weight_decay"))
    bad_entry(e, "has option \"" + opt + "\", not lr=X or weight_decay=Y");
  const std::string text = opt.substr(eq + 1);
  double v = 0;
  size_t used = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || !std::isfinite(v))
    bad_entry(e, "sets " + key + " to \"" + text + "\", not a number");
  double& slot = key == "lr" ? set.lr : set.weight_decay;
  if (slot >= 0) bad_entry(e, "sets " + key + " twice");
  if (key == "lr" ? v <= 0 : v < 0)
    bad_entry(e, "sets " + key + " = " + text + (key == "lr" ? ", not > 0" : ", not >= 0"));
  slot = v;
}

}  // namespace

std::vector<ParamGroupRule> parse_param_groups(const std::vector<std::string>& entries) {
  std::vector<ParamGroupRule> out;
  for (const std::string& e : entries) {
    // The optimizer: the last '=' followed by AdamW or Muon and then the end or ':'.
    size_t eq = std::string::npos, opts = std::string::npos;
    std::string name;
    for (size_t p = e.rfind('='); p != std::string::npos && p > 0; p = e.rfind('=', p - 1)) {
      const size_t end = e.find(':', p + 1);
      const std::string n = e.substr(p + 1, end == std::string::npos ? end : end - p - 1);
      if (n == "AdamW" || n == "Muon") {
        eq = p;
        opts = end;
        name = n;
        break;
      }
    }
    if (eq == std::string::npos) bad_entry(e, "is not REGEX=OPTIMIZER");
    const std::string pattern = e.substr(0, eq);
    try {
      std::regex re(pattern);
    } catch (const std::regex_error& err) {
      throw UserError("optimizer.param_groups: entry \"" + e + "\": \"" + pattern +
                      "\" is not a valid regular expression (ECMAScript): " + err.what());
    }
    ParamGroupRule r{pattern, name == "Muon" ? OptimizerKind::Muon : OptimizerKind::AdamW, {}};
    while (opts != std::string::npos) {
      const size_t next = e.find(':', opts + 1);
      parse_option(e, e.substr(opts + 1, next == std::string::npos ? next : next - opts - 1),
                   r.set);
      opts = next;
    }
    out.push_back(r);
  }
  return out;
}

ParamOverride param_override(const std::string& name, const std::vector<ParamGroupRule>& rules) {
  for (const ParamGroupRule& r : rules)
    if (std::regex_search(name, std::regex(r.pattern))) return r.set;
  return {};
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
