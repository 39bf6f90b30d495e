// The command line: --section.key=value and --section.key value forms, checked against the
// option registry like a TOML key (default < config file < command line).
#include "core/config/config.h"

#include <cstring>
#include <map>

#include "core/base/errors.h"
#include "core/config/config_detail.h"

namespace titan {

using namespace config_detail;

// ---- public: command line ------------------------------------------------------------------

namespace {

bool is_option_arg(const char* a) {
  return std::strncmp(a, "--", 2) == 0;
}

// The values of `--name` given without '=': the arguments after argv[*i] that the option
// takes. A bool takes the next argument only when it is a bool word (a bare flag is true);
// a scalar takes exactly the next one; a list takes every following non-option argument.
std::vector<std::string> take_values(const Option& o, int argc, const char* const* argv, int* i) {
  const std::string flag = "--" + o.name();
  std::vector<std::string> texts;
  bool b;
  if (o.type == OptType::Bool) {
    if (*i + 1 < argc && parse_bool_text(argv[*i + 1], b)) texts.push_back(argv[++*i]);
    return texts;
  }
  const bool list = o.type == OptType::StringList || o.type == OptType::FloatList;
  while (*i + 1 < argc && !is_option_arg(argv[*i + 1])) {
    texts.push_back(argv[++*i]);
    if (!list) break;
  }
  if (texts.empty()) {
    std::string found = *i + 1 < argc ? std::string("the option ") + argv[*i + 1] : "the end";
    throw UserError("command line: " + flag + " expects a " + opt_type_name(o.type) +
                    " value but found " + found + "; allowed: " + flag + " VALUE, " + flag +
                    "=VALUE, or " + flag + "= for an empty value");
  }
  return texts;
}

}  // namespace

CliResult parse_command_line(int argc, const char* const* argv) {
  CliResult r;
  r.cfg = default_config();
  std::vector<std::pair<const Option*, std::vector<std::string>>> given;  // in argv order
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      r.show_help = true;
      continue;
    }
    if (a == "--dump-config") {
      r.dump_config = true;
      continue;
    }
    if (a == "--dump-schedule") {
      r.dump_schedule = true;
      continue;
    }
    if (!is_option_arg(argv[i]))
      throw UserError("command line: unexpected argument '" + a +
                      "'; allowed: --section.key=value options (see --help)");
    const size_t eq = a.find('=');
    std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    if (name == "config") name = "job.config_file";
    bool old = false;
    const Option* o = lookup(name, &old);
    if (!o) {
      if (!is_ignored_torchtitan_key(name))
        throw UserError("command line: unknown option --" + name + "; nearest valid option: --" +
                        nearest_option_name(name));
      warn_ignored(r.warnings, "command line", name);
      if (eq == std::string::npos && i + 1 < argc && !is_option_arg(argv[i + 1])) ++i;  // its value
      continue;
    }
    if (old) warn_renamed(r.warnings, "command line", name, *o);
    std::vector<std::string> texts;
    if (eq != std::string::npos)
      texts.push_back(a.substr(eq + 1));
    else
      texts = take_values(*o, argc, argv, &i);
    given.emplace_back(o, std::move(texts));
  }

  // defaults < TOML < command line. A repeated option: the last wins; lists add up.
  r.cfg.job.config_file.clear();
  for (auto& [o, texts] : given)
    if (o->name() == "job.config_file") r.cfg.job.config_file = texts.back();
  if (!r.cfg.job.config_file.empty()) apply_toml_file(r.cfg, r.cfg.job.config_file, r.warnings);
  std::map<const Option*, std::vector<std::string>> merged;
  for (auto& [o, texts] : given) {
    const bool list = o->type == OptType::StringList || o->type == OptType::FloatList;
    auto& m = merged[o];
    if (!list) m.clear();
    m.insert(m.end(), texts.begin(), texts.end());
  }
  for (auto& [o, texts] : merged) o->set(r.cfg, parse_option_text(*o, texts, "command line"));
  return r;
}

}  // namespace titan
