// The option registry's queries, values (format, check, parse) and validation, plus the text
// helpers the other config files share (core/config/config_detail.h). The registry itself is
// core/config/config_options.cpp; TOML loading is config_toml.cpp, the command line
// config_cli.cpp, the text forms (--help, --dump-config, the README reference, the startup
// table) config_text.cpp.
#include "core/config/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cctype>
#include <limits>
#include <optional>
#include <sstream>
#include <tuple>

#include <toml++/toml.h>

#include "core/base/errors.h"
#include "core/base/strings.h"
#include "core/config/config_detail.h"
#include "core/config/param_groups.h"

namespace titan {
namespace config_detail {

// ---- text helpers --------------------------------------------------------------------------

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string format_double(double x) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (std::isnan(x)) return "nan";
  // Shortest text that parses back to the same double, always with a '.' or exponent so
  // that TOML reads it as a float.
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string quote_toml(const std::string& s) {
  std::ostringstream os;
  os << toml::value<std::string>(s);
  return os.str();
}

bool parse_bool_text(const std::string& t, bool& out) {
  const std::string l = ascii_lower(t);
  if (l == "true" || l == "1" || l == "yes" || l == "on") return out = true, true;
  if (l == "false" || l == "0" || l == "no" || l == "off") return out = false, true;
  return false;
}

bool infinity_allowed(const Option& opt) {
  const double* d = std::get_if<double>(&opt.default_value);
  return opt.allow_inf || (d && std::isinf(*d));
}

std::string allowed_text(const Option& opt) {
  if (!opt.later.empty()) return "only " + format_option_value(opt.default_value);
  if (!opt.choices.empty()) return "one of " + join(opt.choices, ", ");
  std::ostringstream os;
  auto num = [&](double x) {
    return opt.type == OptType::Int ? std::to_string(static_cast<int64_t>(x)) : format_double(x);
  };
  if (opt.min && opt.max && std::isfinite(*opt.max)) {
    if (*opt.min == *opt.max) return "only " + num(*opt.min);
    os << num(*opt.min) << " <= value <= " << num(*opt.max);
  } else if (opt.min) {
    os << "value >= " << num(*opt.min);
  }
  const bool floats = opt.type == OptType::Float || opt.type == OptType::FloatList;
  if (floats && !infinity_allowed(opt) && !(opt.max && std::isfinite(*opt.max)))
    os << (os.tellp() > 0 ? ", finite" : "finite");
  std::string r = os.str();
  if (opt.type == OptType::FloatList) return "a list of floats" + (r.empty() ? "" : ", each " + r);
  if (opt.type == OptType::StringList) return "a list of strings";
  return r;
}

// ---- lookup and warnings -------------------------------------------------------------------

// The option called `name`, directly or by an old spelling (then `*old` is set).
const Option* lookup(const std::string& name, bool* old) {
  *old = false;
  for (auto& o : registry()) {
    if (o.name() == name) return &o;
    for (auto& a : o.aliases)
      if (a == name) return *old = true, &o;
  }
  return nullptr;
}

// Adds "<where>: <body>" unless a warning with the same body is already there, so each
// ignored or renamed key warns once however often and wherever it appears.
void warn_once(std::vector<std::string>& warnings, const std::string& where,
               const std::string& body) {
  const std::string tail = ": " + body;
  for (auto& w : warnings)
    if (w.size() >= tail.size() && w.compare(w.size() - tail.size(), tail.size(), tail) == 0)
      return;
  warnings.push_back(where + tail);
}

void warn_ignored(std::vector<std::string>& warnings, const std::string& where,
                  const std::string& name) {
  std::string entry = ignored_torchtitan_entry(name);
  std::string what = entry.size() > 2 && entry.compare(entry.size() - 2, 2, ".*") == 0
                         ? "keys " + entry
                         : "key " + entry;
  warn_once(warnings, where, "ignoring torchtitan " + what + " (not used by titan-train)");
}

void warn_renamed(std::vector<std::string>& warnings, const std::string& where,
                  const std::string& old_name, const Option& opt) {
  warn_once(warnings, where,
            old_name + " is an older torchtitan name; the current name is " + opt.name());
}

}  // namespace config_detail

using namespace config_detail;

namespace {

// ---- validation ----------------------------------------------------------------------------

void validate_activation_checkpoint(const ActivationCheckpointSection& ac) {
  if (ac.mode != "selective") return;
  const std::string& s = ac.selective_ac_option;
  bool ok = s == "op" || (!s.empty() && s.size() < 10 &&
                          std::all_of(s.begin(), s.end(), ::isdigit) && std::stoll(s) > 0);
  if (!ok)
    throw UserError("activation_checkpoint.selective_ac_option = " + quote_toml(s) +
                    " is not allowed; allowed: op, or a positive integer N (recompute every Nth "
                    "block)");
}

void validate_datasets(const TrainingSection& t) {
  const auto& w = t.dataset_weights;
  if (w.empty()) return;
  if (w.size() != t.dataset_path.size())
    throw UserError("training.dataset_weights has " + std::to_string(w.size()) +
                    " weights but training.dataset_path has " +
                    std::to_string(t.dataset_path.size()) +
                    " entries; allowed: one weight per path, or none (weights by tokens)");
  if (std::all_of(w.begin(), w.end(), [](double x) { return x == 0; }))
    throw UserError(
        "training.dataset_weights are all 0; allowed: non-negative weights, at least one "
        "positive");
}

// Batch shapes whose token counts cannot be real, refused before anything is allocated (a
// TOML local_batch_size of 2^63-1 otherwise ends in "vector::reserve" deep in the loader).
// One micro-batch's token ids are int64: 2^32 tokens are 32 GiB of ids alone, before any
// activation (>= 8 x model dim bytes per token), beyond the memory of any one device or host.
// An optimizer step of 2^40 tokens (a trillion) is far beyond any pre-training batch
// (Llama-3 405B: 16M tokens), and keeps global_batch_size x seq_len far from int64 overflow.
constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 32;
constexpr int64_t kMaxStepTokens = int64_t{1} << 40;

void validate_batch_tokens(const char* section, int64_t batch, const char* batch_key,
                           int64_t seq_len, int64_t max_tokens) {
  if (batch <= 0 || seq_len <= 0 || batch <= max_tokens / seq_len) return;
  throw UserError(std::string(section) + "." + batch_key + " = " + std::to_string(batch) +
                  " with " + section + ".seq_len = " + std::to_string(seq_len) + " is more than " +
                  std::to_string(max_tokens) + " tokens, which no device can hold; allowed: " +
                  batch_key + " x seq_len <= " + std::to_string(max_tokens));
}

// Keys that would be silently ignored: checkpoint.enable = false turns off saving and
// resuming, so a load_step or a final HF export asked for cannot happen. The initial_load_*
// keys act without it (they only read). interval, keep_latest_k, async_mode and the like
// are not refused: torchtitan's own configs set them beside enable = false.
void validate_checkpoint_keys(const CheckpointSection& c) {
  if (!c.enable && c.load_step >= 0)
    throw UserError("checkpoint.load_step = " + std::to_string(c.load_step) +
                    " has no effect: checkpoint.enable = false turns resuming off; allowed: "
                    "checkpoint.enable = true, or load_step = -1 (to start from a checkpoint "
                    "without saving, use checkpoint.initial_load_path)");
  if (!c.enable && c.last_save_in_hf)
    throw UserError(
        "checkpoint.last_save_in_hf = true has no effect: checkpoint.enable = false "
        "turns the final save off; allowed: checkpoint.enable = true, or "
        "last_save_in_hf = false");
  if (c.initial_load_in_hf && c.initial_load_path.empty())
    throw UserError(
        "checkpoint.initial_load_in_hf = true has no effect: "
        "checkpoint.initial_load_path is empty; allowed: a Hugging Face folder in "
        "initial_load_path, or initial_load_in_hf = false");
}

// moe.ep_capacity_factor sizes the static exchange's buffers only (docs/moe.md): with the exact
// exchange or without expert parallelism it would be ignored while the start-up line printed
// a capacity as if it applied. Only a finite (non-default) factor is refused.
void validate_capacity_factor(const JobConfig& cfg) {
  // The default (a finite factor since the dropless static exchange) applies wherever the
  // static exchange runs; only a value the user changed can be one that "has no effect".
  const double f = cfg.moe.ep_capacity_factor;
  if (!std::isfinite(f) || f == default_config().moe.ep_capacity_factor) return;
  const std::string& x = cfg.moe.ep_exchange;
  std::string why;
  if (cfg.parallelism.expert_parallel_degree == 1)
    why = "parallelism.expert_parallel_degree = 1 (no expert-parallel exchange)";
  else if (x == "exact" || (x == "auto" && !cfg.compile.enable))
    why = "moe.ep_exchange = \"" + x + "\"" +
          (x == "auto" ? " without compile.enable (the exact exchange, which never drops)"
                       : " (the exact exchange never drops)");
  if (!why.empty())
    throw UserError("moe.ep_capacity_factor = " + format_double(f) + " has no effect with " + why +
                    "; allowed: moe.ep_exchange = \"static\" with expert_parallel_degree > 1, "
                    "or ep_capacity_factor = inf");
}

// Keys that act only where their feature runs: set away from their default without it they
// would be accepted and ignored (issue 45), so each exits 2 naming the key, the feature
// missing and what is allowed. Only a changed value is refused: torchtitan's own configs
// leave these at their defaults where the feature is off (pipeline keys at degree 1, the
// float8 recipe without the converter), and `filter_fqns`, which they do set without the
// converter, is not among them.
void validate_inactive_keys(const JobConfig& cfg) {
  auto lower = [](std::string x) {
    std::transform(x.begin(), x.end(), x.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return x;
  };
  auto changed = [&](const std::string& name) -> std::optional<std::string> {
    const Option* o = find_option(name);
    if (!o || !o->get) return std::nullopt;
    OptValue v = o->get(cfg), d = o->default_value;
    // The schedule's name is read in any case: "1f1b" is the default.
    if (name == "parallelism.pipeline_parallel_schedule")
      if (lower(std::get<std::string>(v)) == lower(std::get<std::string>(d))) return std::nullopt;
    if (v == d) return std::nullopt;
    return format_option_value(v) + " has no effect";
  };
  const auto& p = cfg.parallelism;
  if (p.pipeline_parallel_degree == 1)
    for (const char* key :
         {"pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
          "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage",
          "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
          "pipeline_parallel_expert_parallel_overlap", "module_fqns_per_model_part"}) {
      const std::string name = std::string("parallelism.") + key;
      if (auto what = changed(name))
        throw UserError(name + " = " + *what +
                        " with parallelism.pipeline_parallel_degree = 1 (no pipeline); allowed: "
                        "pipeline_parallel_degree > 1, or " +
                        key + " at its default (" +
                        format_option_value(find_option(name)->default_value) + ")");
    }
  if (p.expert_parallel_degree == 1)
    if (auto what = changed("moe.ep_drop_policy"))
      throw UserError("moe.ep_drop_policy = " + *what +
                      " with parallelism.expert_parallel_degree = 1 (no expert-parallel "
                      "exchange, nothing is dropped); allowed: ep_drop_policy = \"none\", or "
                      "expert_parallel_degree > 1 with moe.ep_exchange = \"static\"");
  if (!float8_linear_enabled(cfg))
    if (auto what = changed("quantize.linear.float8.recipe_name"))
      throw UserError("quantize.linear.float8.recipe_name = " + *what +
                      " without the float8 converter (model.converters has no \"float8\" or "
                      "\"quantize.linear.float8\"); allowed: add the converter, or recipe_name "
                      "at its default (\"tensorwise\")");
}

}  // namespace

// ---- public: registry queries --------------------------------------------------------------

const char* opt_type_name(OptType t) {
  switch (t) {
    case OptType::Bool:
      return "bool";
    case OptType::Int:
      return "int";
    case OptType::Float:
      return "float";
    case OptType::String:
      return "string";
    case OptType::StringList:
      return "list[string]";
    case OptType::FloatList:
      return "list[float]";
  }
  return "?";
}

const Option* find_option(const std::string& full_name) {
  bool old = false;
  return lookup(full_name, &old);
}

std::string ignored_torchtitan_entry(const std::string& full_name) {
  for (auto& k : ignored_torchtitan_keys()) {
    if (k == full_name) return k;
    if (k.size() > 2 && k.compare(k.size() - 2, 2, ".*") == 0) {
      const std::string stem = k.substr(0, k.size() - 2);  // "a.b.*" covers a.b and a.b.x
      if (full_name == stem || full_name.rfind(stem + ".", 0) == 0) return k;
    }
  }
  return "";
}

bool is_ignored_torchtitan_key(const std::string& full_name) {
  return !ignored_torchtitan_entry(full_name).empty();
}

std::string nearest_option_name(const std::string& name) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (auto& o : registry()) {
    size_t dd = edit_distance(name, o.name());
    if (dd < best_d) best_d = dd, best = o.name();
  }
  return best;
}

JobConfig default_config() {
  JobConfig c;
  for (auto& o : registry()) o.set(c, o.default_value);
  return c;
}

// ---- public: values ------------------------------------------------------------------------

std::string format_option_value(const OptValue& v) {
  struct V {
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return format_double(d); }
    std::string operator()(const std::string& s) const { return quote_toml(s); }
    std::string operator()(const std::vector<std::string>& l) const {
      std::vector<std::string> q;
      for (auto& s : l) q.push_back(quote_toml(s));
      return "[" + join(q, ", ") + "]";
    }
    std::string operator()(const std::vector<double>& l) const {
      std::vector<std::string> q;
      for (double x : l) q.push_back(format_double(x));
      return "[" + join(q, ", ") + "]";
    }
  };
  return std::visit(V{}, v);
}

void check_option_value(const Option& opt, const OptValue& v, const std::string& where) {
  if (!opt.later.empty()) {
    if (v == opt.default_value) return;
    throw UserError(where + ": " + opt.name() + " = " + format_option_value(v) + " needs " +
                    opt.later +
                    ", which titan-train does not support yet; allowed: " + allowed_text(opt));
  }
  auto fail = [&] {
    throw UserError(where + ": " + opt.name() + " = " + format_option_value(v) +
                    " is not allowed; allowed: " + allowed_text(opt));
  };
  // An infinite float means something only where the default is one (moe.ep_capacity_factor:
  // the no-drop worst case); elsewhere (optimizer.lr = inf) it only turns the loss into nan.
  auto in_range = [&](double x) {
    return !std::isnan(x) && (std::isfinite(x) || infinity_allowed(opt)) &&
           !(opt.min && x < *opt.min) && !(opt.max && x > *opt.max);
  };
  auto chosen = [&](const std::string& s) {
    return opt.choices.empty() ||
           std::find(opt.choices.begin(), opt.choices.end(), s) != opt.choices.end();
  };
  switch (opt.type) {
    case OptType::Int:
      if (!in_range(static_cast<double>(std::get<int64_t>(v)))) fail();
      break;
    case OptType::Float:
      if (!in_range(std::get<double>(v))) fail();
      break;
    case OptType::String:
      if (!chosen(std::get<std::string>(v))) fail();
      break;
    case OptType::StringList:
      for (auto& s : std::get<std::vector<std::string>>(v))
        if (!chosen(s)) fail();
      break;
    case OptType::FloatList:
      for (double x : std::get<std::vector<double>>(v))
        if (!in_range(x)) fail();
      break;
    case OptType::Bool:
      break;
  }
}

OptValue parse_option_text(const Option& opt, const std::vector<std::string>& texts,
                           const std::string& where) {
  auto single = [&]() -> const std::string& {
    if (texts.size() != 1)
      throw UserError(where + ": --" + opt.name() + ": expected one " + opt_type_name(opt.type) +
                      " value, found " + std::to_string(texts.size()));
    return texts[0];
  };
  auto bad = [&](const char* expected, const std::string& t) {
    return UserError(where + ": --" + opt.name() + ": expected " + expected + ", found '" + t +
                     "'");
  };
  OptValue v;
  switch (opt.type) {
    case OptType::Bool: {
      bool b = true;  // a bare flag, or --key=
      if (!texts.empty() && !(texts.size() == 1 && texts[0].empty()) &&
          !parse_bool_text(single(), b))
        throw bad("bool (true/false)", single());
      v = b;
      break;
    }
    case OptType::Int: {
      const std::string& t = single();
      char* end = nullptr;
      errno = 0;
      long long x = std::strtoll(t.c_str(), &end, 10);
      if (t.empty() || *end || errno) throw bad("int", t);
      v = static_cast<int64_t>(x);
      break;
    }
    case OptType::Float: {
      const std::string& t = single();
      char* end = nullptr;
      double x = std::strtod(t.c_str(), &end);
      if (t.empty() || *end) throw bad("float", t);
      v = x;
      break;
    }
    case OptType::String:
      v = single();
      break;
    case OptType::StringList: {
      std::vector<std::string> out;
      for (auto& t : texts)
        for (auto& item : split_commas(t)) out.push_back(item);
      v = out;
      break;
    }
    case OptType::FloatList: {
      std::vector<double> out;
      for (auto& t : texts)
        for (auto& item : split_commas(t)) {
          char* end = nullptr;
          double x = std::strtod(item.c_str(), &end);
          if (*end) throw bad("a comma-separated list of floats", t);
          out.push_back(x);
        }
      v = out;
      break;
    }
  }
  check_option_value(opt, v, where);
  return v;
}

// ---- public: validation --------------------------------------------------------------------

DerivedConfig derive_config(const JobConfig& cfg, int64_t world_size) {
  DerivedConfig d;
  const auto& p = cfg.parallelism;
  d.dp_shard =
      p.data_parallel_shard_degree == -1
          ? world_size /
                std::max<int64_t>(1, p.data_parallel_replicate_degree * p.context_parallel_degree *
                                         p.tensor_parallel_degree * p.pipeline_parallel_degree)
          : p.data_parallel_shard_degree;
  d.dp_degree = p.data_parallel_replicate_degree * d.dp_shard;
  const int64_t per_micro = cfg.training.local_batch_size * d.dp_degree;
  d.global_batch =
      cfg.training.global_batch_size == -1 ? per_micro : cfg.training.global_batch_size;
  d.grad_accum_steps = per_micro > 0 ? d.global_batch / per_micro : 1;
  d.tokens_per_step = d.global_batch * cfg.training.seq_len;
  return d;
}

// Tensor parallelism splits each sequence over the tp ranks (sequence parallel), and the
// experts are either whole (etp 1) or split like everything else (etp = tp, torchtitan 0.2.2;
// with expert parallelism too: each tp index's ep group exchanges the rows for its slices).
static void validate_tensor_parallel(const JobConfig& cfg) {
  const auto& p = cfg.parallelism;
  const int64_t tp = p.tensor_parallel_degree;
  // torchtitan ignores the key without tp; here no key is silently ignored.
  if (p.enable_async_tensor_parallel && tp == 1)
    throw UserError(
        "parallelism.enable_async_tensor_parallel = true with tensor_parallel_degree = 1 is "
        "not allowed: there are no tensor-parallel collectives to overlap; allowed: false, or "
        "tensor_parallel_degree > 1");
  if (p.expert_tensor_parallel_degree != 1 && p.expert_tensor_parallel_degree != tp)
    throw UserError("parallelism.expert_tensor_parallel_degree = " +
                    std::to_string(p.expert_tensor_parallel_degree) +
                    " is not allowed; allowed: 1 or tensor_parallel_degree (" + std::to_string(tp) +
                    ")");
  struct SeqLen {
    const char* key;
    int64_t len;
    bool used;
  };
  for (const SeqLen& s :
       {SeqLen{"training.seq_len", cfg.training.seq_len, true},
        SeqLen{"validation.seq_len", cfg.validation.seq_len, cfg.validation.enable}})
    if (tp > 1 && s.used && s.len % tp != 0)
      throw UserError(
          std::string(s.key) + " = " + std::to_string(s.len) +
          " does not split over parallelism.tensor_parallel_degree = " + std::to_string(tp) +
          " (sequence parallel); allowed: a multiple of " + std::to_string(tp));
}

// Context parallelism: the balancer and exchange built, and sequences that split into the
// balancer's chunks (and each rank's slice over the tp ranks).
static void validate_context_parallel(const JobConfig& cfg) {
  const auto& p = cfg.parallelism;
  const int64_t cp = p.context_parallel_degree;
  if (p.context_parallel_load_balancer == "ptrr")
    throw UserError(
        "parallelism.context_parallel_load_balancer = \"ptrr\" is not implemented "
        "yet (it balances flex-attention document masks); allowed: headtail, none");
  if (p.context_parallel_rotate_method == "alltoall")
    throw UserError(
        "parallelism.context_parallel_rotate_method = \"alltoall\" is not "
        "implemented yet; allowed: allgather");
  if (cp == 1) return;
  const bool headtail = p.context_parallel_load_balancer == "headtail";
  const int64_t unit = (headtail ? 2 * cp : cp) * p.tensor_parallel_degree;
  for (const auto& [key, len, used] :
       {std::make_tuple("training.seq_len", cfg.training.seq_len, true),
        std::make_tuple("validation.seq_len", cfg.validation.seq_len, cfg.validation.enable)})
    if (used && len % unit != 0)
      throw UserError(
          std::string(key) + " = " + std::to_string(len) +
          " does not split over parallelism.context_parallel_degree = " + std::to_string(cp) +
          " (" + (headtail ? "2 x cp head-tail chunks" : "cp chunks") +
          (p.tensor_parallel_degree > 1 ? ", each over tensor_parallel_degree" : "") +
          "); allowed: a multiple of " + std::to_string(unit));
}

namespace {

// Float8 grouped GEMMs (model.converters "quantize.grouped_mm.float8") with what they cannot
// run with. The fqns are matched against the model when it is built (models/moe_model.h).
void validate_float8_grouped(const JobConfig& cfg) {
  if (!float8_grouped_enabled(cfg)) return;
  const std::string conv = "model.converters = \"quantize.grouped_mm.float8\"";
  if (cfg.model.name == "llama3")
    throw UserError(conv +
                    " with model.name = \"llama3\": a dense model has no routed "
                    "experts; allowed: model.name = llama4 or deepseek_v3, or drop the converter");
  if (cfg.float8.grouped_mm_fqns.empty())
    throw UserError("quantize.grouped_mm.float8.fqns = [] converts nothing while " + conv +
                    " is on; allowed: MoE module names to convert, e.g. [\"experts\"]");
  if (cfg.moe.experts_backend == "loop")
    throw UserError("moe.experts_backend = \"loop\" cannot run " + conv +
                    " (float8 grouped GEMMs need the grouped layout); allowed: auto, "
                    "grouped_mm, cutlass");
  const auto& p = cfg.parallelism;
  // A tp rank holds a hidden slice of each expert: the rowwise amax over the hidden dim (w2's
  // scales, the activations' rows) would be the slice's, not the expert's.
  if (p.expert_tensor_parallel_degree > 1)
    throw UserError("parallelism.expert_tensor_parallel_degree = " +
                    std::to_string(p.expert_tensor_parallel_degree) + " with " + conv +
                    " is not implemented yet (the scales would be per hidden slice); "
                    "allowed: 1");
  // torchtitan v0.2.2 refuses PP and CP for its float8 MoE prototype. Under PP a stage's
  // grouped GEMMs see one micro-batch, so the per-group scales of the weight-gradient GEMMs
  // are those of one process accumulating the same micro-batches (the [pp] float8 test). A
  // cp rank would hold part of each group's tokens: refused.
  if (p.context_parallel_degree > 1)
    throw UserError(
        "parallelism.context_parallel_degree = " + std::to_string(p.context_parallel_degree) +
        " with " + conv + " is not implemented (torchtitan refuses it too); allowed: 1");
}

// Float8 combinations that have no meaning or are not built yet (the keys alone are checked
// by the registry).
void validate_float8(const JobConfig& cfg) {
  const auto& f = cfg.float8;
  validate_float8_grouped(cfg);
  if (!float8_linear_enabled(cfg)) return;  // torchtitan reads the section only then
  // torchao's FSDP float8 all-gather casts each weight with one tensorwise scale (its
  // Float8LinearConfig asserts it); torchtitan refuses a recipe_name with the flag.
  if (f.enable_fsdp_float8_all_gather && f.recipe_name != "tensorwise")
    throw UserError(
        "quantize.linear.float8.enable_fsdp_float8_all_gather = true with recipe_name = \"" +
        f.recipe_name +
        "\" is not allowed: the float8 all-gather takes tensorwise scales only (as in torchao); "
        "allowed: false, or recipe_name = \"tensorwise\"");
  // torchtitan ignores it without the all-gather; here nothing float8 is accepted and ignored.
  if (f.precompute_float8_dynamic_scale_for_fsdp && !f.enable_fsdp_float8_all_gather)
    throw UserError(
        "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp = true without "
        "enable_fsdp_float8_all_gather is not allowed: the scales it precomputes are the float8 "
        "all-gather's; allowed: false, or enable_fsdp_float8_all_gather = true");
  const auto& ff = f.filter_fqns;
  if (f.recipe_name == "rowwise_with_gw_hp" &&
      std::find(ff.begin(), ff.end(), "auto_filter_small_kn") != ff.end())
    throw UserError(
        "quantize.linear.float8.filter_fqns = \"auto_filter_small_kn\" has no size rule for "
        "recipe_name = \"rowwise_with_gw_hp\" (torchao defines it for tensorwise and rowwise "
        "only); allowed: list the linears to skip by name, or another recipe");
  const auto& ac = cfg.activation_checkpoint;
  if (ac.mode == "selective" && ac.selective_ac_option == "op")
    throw UserError(
        "activation_checkpoint.selective_ac_option = \"op\" with model.converters = "
        "[\"float8\"] is not implemented yet; allowed: a block interval (\"2\"), or mode = "
        "full or none");
}

}  // namespace

bool float8_grouped_enabled(const JobConfig& cfg) {
  const auto& c = cfg.model.converters;
  return std::find(c.begin(), c.end(), "quantize.grouped_mm.float8") != c.end();
}

bool float8_linear_enabled(const JobConfig& cfg) {
  const auto& c = cfg.model.converters;
  return std::find(c.begin(), c.end(), "float8") != c.end() ||
         std::find(c.begin(), c.end(), "quantize.linear.float8") != c.end();
}

// Muon's keys: three Newton-Schulz coefficients, well-formed param_groups, and no Muon key
// changed while another optimizer runs (it would be silently ignored).
static void validate_optimizer(const OptimizerSection& o) {
  if (o.muon_ns_coefficients.size() != 3)
    throw UserError("optimizer.muon_ns_coefficients has " +
                    std::to_string(o.muon_ns_coefficients.size()) +
                    " values; allowed: exactly 3, (a, b, c) of the quintic Newton-Schulz step, "
                    "e.g. [3.4445, -4.7750, 2.0315]");
  // Throws on a malformed entry. An entry's own lr is relative to its member's peak (the
  // schedule's factor), so a zero peak would silently ignore it.
  for (const ParamGroupRule& r : parse_param_groups(o.param_groups)) {
    const bool muon = r.kind == OptimizerKind::Muon;
    if (r.set.lr > 0 && (muon ? o.muon_lr : o.lr) <= 0)
      throw UserError("optimizer.param_groups: entry for \"" + r.pattern + "\" sets lr but " +
                      (muon ? "optimizer.muon_lr" : "optimizer.lr") +
                      " = 0; allowed: a group lr with a positive peak lr of its optimizer");
  }
  if (o.name == "Muon") return;
  const OptimizerSection d = default_config().optimizer;
  auto refuse = [&](const char* key, bool changed) {
    if (changed)
      throw UserError(std::string("optimizer.") + key + " is set but optimizer.name = \"" + o.name +
                      "\"; allowed: Muon's keys with optimizer.name = \"Muon\" only");
  };
  refuse("param_groups", !o.param_groups.empty());
  refuse("muon_lr", o.muon_lr != d.muon_lr);
  refuse("muon_weight_decay", o.muon_weight_decay != d.muon_weight_decay);
  refuse("muon_momentum", o.muon_momentum != d.muon_momentum);
  refuse("muon_enable_nesterov", o.muon_enable_nesterov != d.muon_enable_nesterov);
  refuse("muon_ns_coefficients", o.muon_ns_coefficients != d.muon_ns_coefficients);
  refuse("muon_ns_steps", o.muon_ns_steps != d.muon_ns_steps);
  refuse("muon_eps", o.muon_eps != d.muon_eps);
  refuse("muon_adjust_lr_fn", o.muon_adjust_lr_fn != d.muon_adjust_lr_fn);
}

void validate_config(const JobConfig& cfg) {
  validate_float8(cfg);
  validate_optimizer(cfg.optimizer);
  const auto& p = cfg.parallelism;
  if (p.data_parallel_shard_degree == 0)
    throw UserError(
        "parallelism.data_parallel_shard_degree = 0 is not allowed; allowed: -1 (the rest of "
        "the world) or a positive degree");
  // Experts borrow ranks from FSDP's shard dimension, dp_shard x cp (parallel/mesh.h).
  const int64_t shard_cp = p.data_parallel_shard_degree * p.context_parallel_degree;
  if (p.data_parallel_shard_degree > 0 && shard_cp % p.expert_parallel_degree)
    throw UserError(
        "parallelism.expert_parallel_degree = " + std::to_string(p.expert_parallel_degree) +
        " must divide the shard degree " + std::to_string(shard_cp) +
        " (experts borrow ranks from data_parallel_shard_degree x context_parallel_degree)");
  const auto& t = cfg.training;
  validate_tensor_parallel(cfg);
  validate_context_parallel(cfg);
  if (t.global_batch_size != -1 && t.global_batch_size % t.local_batch_size != 0)
    throw UserError("training.global_batch_size = " + std::to_string(t.global_batch_size) +
                    " is not a multiple of local_batch_size (" +
                    std::to_string(t.local_batch_size) + "); allowed: -1 or a multiple of " +
                    std::to_string(t.local_batch_size) + " x the data-parallel degree");
  validate_batch_tokens("training", t.local_batch_size, "local_batch_size", t.seq_len,
                        kMaxMicroBatchTokens);
  validate_batch_tokens("training", t.global_batch_size, "global_batch_size", t.seq_len,
                        kMaxStepTokens);
  if (cfg.validation.enable)
    validate_batch_tokens("validation", cfg.validation.local_batch_size, "local_batch_size",
                          cfg.validation.seq_len, kMaxMicroBatchTokens);
  validate_datasets(t);
  validate_activation_checkpoint(cfg.activation_checkpoint);
  const auto& pr = cfg.profiling;
  if (pr.enable_profiling && pr.profile_freq < pr.profiler_active + pr.profiler_warmup)
    throw UserError("profiling.profile_freq = " + std::to_string(pr.profile_freq) +
                    " is less than profiler_warmup + profiler_active = " +
                    std::to_string(pr.profiler_warmup + pr.profiler_active) +
                    "; allowed: profile_freq >= profiler_warmup + profiler_active");
  if (cfg.checkpoint.last_save_in_hf && cfg.model.name == "llama4")
    throw UserError(
        "checkpoint.last_save_in_hf = true is not supported for model.name = \"llama4\"; "
        "allowed: llama3, deepseek_v3, qwen3, gpt_oss");
  if (!(cfg.moe.ep_capacity_factor > 0))
    throw UserError("moe.ep_capacity_factor = " + std::to_string(cfg.moe.ep_capacity_factor) +
                    " is not allowed; allowed: a factor > 0 (e.g. 2, the default), or inf (the "
                    "worst case, which never overflows)");
  validate_checkpoint_keys(cfg.checkpoint);
  validate_capacity_factor(cfg);
  validate_inactive_keys(cfg);
  if (cfg.checkpoint.create_seed_checkpoint && !cfg.checkpoint.enable)
    throw UserError(
        "checkpoint.create_seed_checkpoint = true with checkpoint.enable = false; allowed: "
        "checkpoint.enable = true (the seed is written to the checkpoint folder)");
}

// Pipeline training: the pipeline is the outermost dimension (data parallelism inside it),
// and the features not yet carried through the stages are refused by name
// (docs/distributed.md).
static void validate_pipeline_for_world(const JobConfig& cfg, int64_t world_size) {
  const auto& p = cfg.parallelism;
  const int64_t pp = p.pipeline_parallel_degree;
  if (pp <= 1) return;
  const std::string head = "parallelism.pipeline_parallel_degree = " + std::to_string(pp);
  const std::string n = std::to_string(pp), world = std::to_string(world_size);
  if (world_size < pp)
    throw UserError(head + " needs " + n + " ranks but the world has " + world +
                    "; allowed: exactly " + n + " ranks (torchrun --nproc_per_node " + n +
                    "), or --dump-schedule to print the stages and the schedule without "
                    "training");
  if (world_size % pp != 0)
    throw UserError(head + " does not divide the world size " + world +
                    "; allowed: a divisor of the world size");
  // FSDP of the stages keeps a stage's weights gathered through the step (each micro-batch's
  // forward uses them): resharding after every forward would gather once per micro-batch.
  // Context parallelism folds into the shard dimension: cp > 1 alone shards the stages.
  if (derive_config(cfg, world_size).dp_shard * p.context_parallel_degree > 1 &&
      p.fsdp_reshard_after_forward == "always")
    throw UserError(head +
                    " with parallelism.fsdp_reshard_after_forward = \"always\" and a "
                    "sharded data-parallel dimension: not implemented (each stage's weights are "
                    "gathered once per step under pipeline parallelism); allowed: \"default\" "
                    "or \"never\"");
  const int64_t mbs = p.pipeline_parallel_microbatch_size;
  if (cfg.validation.enable && cfg.validation.local_batch_size % mbs != 0)
    throw UserError(
        "validation.local_batch_size = " + std::to_string(cfg.validation.local_batch_size) +
        " with " + head + " is not a multiple of parallelism.pipeline_parallel_microbatch_size = " +
        std::to_string(mbs) + "; allowed: a multiple of it");
}

void validate_for_world(const JobConfig& cfg, int64_t world_size) {
  validate_config(cfg);
  const auto& p = cfg.parallelism;
  const std::string world = std::to_string(world_size);
  validate_pipeline_for_world(cfg, world_size);
  if (p.data_parallel_shard_degree == -1 &&
      world_size % (p.data_parallel_replicate_degree * p.context_parallel_degree *
                    p.tensor_parallel_degree) !=
          0)
    throw UserError("parallelism.data_parallel_replicate_degree = " +
                    std::to_string(p.data_parallel_replicate_degree) +
                    (p.tensor_parallel_degree > 1
                         ? " x tensor_parallel_degree = " + std::to_string(p.tensor_parallel_degree)
                         : std::string()) +
                    " does not divide the world size " + world);
  if (cfg.checkpoint.create_seed_checkpoint && world_size != 1)
    throw UserError("checkpoint.create_seed_checkpoint = true with a world size of " + world +
                    "; allowed: a single process with every parallelism degree at 1 (as "
                    "torchtitan, the seed is written unsharded; any layout, pipeline parallel "
                    "included, loads it)");
  DerivedConfig d = derive_config(cfg, world_size);
  const int64_t tp = p.tensor_parallel_degree, cp = p.context_parallel_degree;
  const int64_t pp = p.pipeline_parallel_degree;
  if (d.dp_degree * cp * tp * pp != world_size)
    throw UserError(
        "parallelism: " +
        (pp > 1 ? "pipeline_parallel_degree (" + std::to_string(pp) + ") x " : std::string()) +
        "data_parallel_replicate_degree (" + std::to_string(p.data_parallel_replicate_degree) +
        ") x data_parallel_shard_degree (" + std::to_string(d.dp_shard) + ")" +
        (cp > 1 ? " x context_parallel_degree (" + std::to_string(cp) + ")" : "") +
        (tp > 1 ? " x tensor_parallel_degree (" + std::to_string(tp) + ")" : "") + " = " +
        std::to_string(d.dp_degree * cp * tp * pp) + ", but the world size is " + world +
        "; allowed: a product equal to the world size");
  if ((d.dp_shard * cp) % p.expert_parallel_degree != 0)
    throw UserError(
        "parallelism.expert_parallel_degree = " + std::to_string(p.expert_parallel_degree) +
        " must divide the shard degree " + std::to_string(d.dp_shard * cp) + " of the world size " +
        world +
        " (experts borrow ranks from data_parallel_shard_degree x context_parallel_degree)");
  const int64_t per_micro = cfg.training.local_batch_size * d.dp_degree;
  if (d.global_batch % per_micro != 0)
    throw UserError("training.global_batch_size = " + std::to_string(d.global_batch) +
                    " is not a multiple of local_batch_size (" +
                    std::to_string(cfg.training.local_batch_size) + ") x data-parallel degree (" +
                    std::to_string(d.dp_degree) + ") = " + std::to_string(per_micro) +
                    "; allowed: -1 or a multiple of " + std::to_string(per_micro));
}

}  // namespace titan
