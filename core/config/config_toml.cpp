// TOML config files: each section.key converted and checked against the option registry,
// torchtitan's keys that we ignore or renamed warned once, unknown sections and keys refused
// with the nearest option named.
#include "core/config/config.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>

#include <toml++/toml.h>

#include "core/base/errors.h"
#include "core/config/config_detail.h"

namespace titan {

using namespace config_detail;

namespace {

// ---- TOML ----------------------------------------------------------------------------------

std::string describe_toml_node(const toml::node& n) {
  std::ostringstream os;
  switch (n.type()) {
    case toml::node_type::string:
      os << "string " << quote_toml(*n.value<std::string>());
      break;
    case toml::node_type::integer:
      os << "integer " << *n.value<int64_t>();
      break;
    case toml::node_type::floating_point:
      os << "float " << format_double(*n.value<double>());
      break;
    case toml::node_type::boolean:
      os << "boolean " << (*n.value<bool>() ? "true" : "false");
      break;
    case toml::node_type::array:
      os << "an array";
      break;
    case toml::node_type::table:
      os << "a table";
      break;
    default:
      os << "a date/time";
      break;
  }
  return os.str();
}

[[noreturn]] void wrong_type(const Option& opt, const std::string& where,
                             const std::string& found) {
  throw UserError(where + ": " + opt.name() + ": expected " + opt_type_name(opt.type) + ", found " +
                  found);
}

std::optional<double> toml_number(const toml::node& n) {
  if (n.is_integer()) return static_cast<double>(*n.value<int64_t>());
  if (auto f = n.value_exact<double>()) return *f;
  return std::nullopt;
}

// The items of a TOML array, each converted by `item`; nullopt when `n` is no array.
template <class T, class F>
std::optional<std::vector<T>> toml_list(const Option& opt, const toml::node& n,
                                        const std::string& where, F item) {
  std::vector<T> out;
  if (auto* arr = n.as_array()) {
    for (auto& e : *arr) {
      std::optional<T> v = item(e);
      if (!v) wrong_type(opt, where, "an array holding " + describe_toml_node(e));
      out.push_back(*v);
    }
    return out;
  }
  return std::nullopt;
}

OptValue toml_to_value(const Option& opt, const toml::node& n, const std::string& where) {
  switch (opt.type) {
    case OptType::Bool:
      if (auto b = n.value_exact<bool>()) return *b;
      break;
    case OptType::Int:
      if (auto i = n.value_exact<int64_t>()) return *i;
      break;
    case OptType::Float:
      if (auto x = toml_number(n)) return *x;
      break;
    case OptType::String:
      if (auto s = n.value_exact<std::string>()) return *s;
      // torchtitan writes selective_ac_option = '2' but users write 2.
      if (n.is_integer()) return std::to_string(*n.value<int64_t>());
      break;
    case OptType::StringList: {
      if (auto s = n.value_exact<std::string>()) return split_commas(*s);
      auto l = toml_list<std::string>(opt, n, where,
                                      [&opt](const toml::node& e) -> std::optional<std::string> {
                                        if (auto s = e.value_exact<std::string>()) return *s;
                                        auto* inner = opt.string_groups ? e.as_array() : nullptr;
                                        if (!inner) return std::nullopt;
                                        std::string joined;  // [["a", "b"], ["c"]] -> "a b", "c"
                                        for (auto& x : *inner) {
                                          auto s = x.value_exact<std::string>();
                                          if (!s) return std::nullopt;
                                          joined += (joined.empty() ? "" : " ") + *s;
                                        }
                                        return joined;
                                      });
      if (l) return *l;
      break;
    }
    case OptType::FloatList: {
      if (auto x = toml_number(n)) return std::vector<double>{*x};
      auto l = toml_list<double>(opt, n, where, toml_number);
      if (l) return *l;
      break;
    }
  }
  wrong_type(opt, where, describe_toml_node(n));
}

// A top-level table that holds options, directly or in sub-tables ([quantize] holds
// [quantize.linear.float8]), under their names or aliases ([float8]), or ignored keys.
bool section_known(const std::string& section) {
  auto covers = [&](const std::string& name) { return name.rfind(section + ".", 0) == 0; };
  for (auto& o : registry()) {
    if (covers(o.name())) return true;
    for (auto& a : o.aliases)
      if (covers(a)) return true;
  }
  for (auto& k : ignored_torchtitan_keys())
    if (covers(k)) return true;
  return false;
}

void check_section(const std::string& section, const std::string& where) {
  if (section_known(section)) return;
  std::string near;
  size_t best = std::numeric_limits<size_t>::max();
  for (auto& o : registry()) {
    size_t dd = edit_distance(section, o.section);
    if (dd < best) best = dd, near = o.section;
  }
  throw UserError(where + ": unknown section [" + section + "]; nearest valid section: [" + near +
                  "] (see --help)");
}

struct TomlEntry {
  std::string name;  // "section.key"
  const toml::node* node;
  toml::source_position pos;
};

// Every "section.key" of the file in file order, so the first problem reported is the first
// in the file. Tables below a section stay one entry (a key or an ignored torchtitan table).
std::vector<TomlEntry> toml_entries(const toml::table& root, const std::string& source) {
  std::vector<TomlEntry> out;
  for (auto&& [sec_key, sec_node] : root) {
    std::string section(sec_key.str());
    std::string where = source + ":" + std::to_string(sec_node.source().begin.line);
    const toml::table* tbl = sec_node.as_table();
    if (!tbl)
      throw UserError(where + ": top-level key '" + section +
                      "': expected a [section] table, found " + describe_toml_node(sec_node) +
                      "; allowed: sections such as [training] (see --help)");
    check_section(section, where);
    // Sub-tables that hold options of their own ([quantize.linear.float8]) are walked; other
    // tables stay one entry (an ignored torchtitan table, or an unknown key).
    std::function<void(const std::string&, const toml::table&)> walk =
        [&](const std::string& prefix, const toml::table& t) {
          for (auto&& [k, node] : t) {
            const std::string name = prefix + "." + std::string(k.str());
            const toml::table* sub = node.as_table();
            if (sub && !find_option(name) && !is_ignored_torchtitan_key(name) &&
                section_known(name))
              walk(name, *sub);
            else
              out.push_back({name, &node, node.source().begin});
          }
        };
    walk(section, *tbl);
  }
  std::stable_sort(out.begin(), out.end(), [](const TomlEntry& a, const TomlEntry& b) {
    return a.pos.line != b.pos.line ? a.pos.line < b.pos.line : a.pos.column < b.pos.column;
  });
  return out;
}

void apply_toml_table(JobConfig& cfg, const toml::table& root, const std::string& source,
                      std::vector<std::string>& warnings) {
  for (const TomlEntry& e : toml_entries(root, source)) {
    const std::string where = source + ":" + std::to_string(e.pos.line);
    bool old = false;
    const Option* opt = lookup(e.name, &old);
    if (!opt) {
      if (!is_ignored_torchtitan_key(e.name))
        throw UserError(where + ": unknown key " + e.name +
                        "; nearest valid key: " + nearest_option_name(e.name));
      warn_ignored(warnings, where, e.name);
      continue;
    }
    if (old) warn_renamed(warnings, where, e.name, *opt);
    OptValue v = toml_to_value(*opt, *e.node, where);
    check_option_value(*opt, v, where);
    opt->set(cfg, v);
  }
}

// toml++ 3.3 (Debian 12's) reaches __builtin_unreachable, undefined behaviour, when it asks
// whether some non-ASCII characters are whitespace (U+00A1..U+0499 among them): that happens
// for such a character outside a string or comment, and in a multi-line basic string right
// after a backslash or after a line-ending backslash. TOML 1.0 allows none outside strings and
// comments, so those are refused here first, with the place named; the multi-line cases are
// legal TOML that this parser cannot take, and the message says so. (Found by
// test/fuzz/fuzz_config.)
class NonAsciiGuard {
 public:
  NonAsciiGuard(const std::string& text, const std::string& source) : t_(text), src_(source) {}

  void run() {
    while (i_ < t_.size()) {
      const char c = t_[i_];
      if (c == '#') {
        skip_until('\n');
      } else if (starts("\"\"\"")) {
        i_ += 3;
        multi_line_basic();
      } else if (starts("'''")) {
        i_ += 3;
        skip_past("'''");
      } else if (c == '"') {
        ++i_;
        single_line_basic();
      } else if (c == '\'') {  // a literal string ends at its quote or the line's end
        ++i_;
        while (i_ < t_.size() && t_[i_] != '\'' && t_[i_] != '\n') ++i_;
        ++i_;
      } else {
        if (high(i_))
          fail("outside a string or comment",
               "non-ASCII text only inside quoted strings and comments (TOML 1.0)");
        ++i_;
      }
    }
  }

 private:
  bool high(size_t k) const { return k < t_.size() && static_cast<unsigned char>(t_[k]) >= 0x80; }
  bool blank(size_t k) const { return k < t_.size() && std::strchr(" \t\r\n", t_[k]) != nullptr; }
  bool starts(const char* s) const { return t_.compare(i_, std::strlen(s), s) == 0; }
  void skip_until(char end) {
    while (i_ < t_.size() && t_[i_] != end) ++i_;
  }
  void skip_past(const char* end) {
    while (i_ < t_.size() && !starts(end)) ++i_;
    i_ += std::strlen(end);
    while (i_ < t_.size() && t_[i_] == end[0]) ++i_;  // up to two quotes of the content
  }
  void single_line_basic() {
    while (i_ < t_.size() && t_[i_] != '"' && t_[i_] != '\n') i_ += t_[i_] == '\\' ? 2 : 1;
    ++i_;
  }
  void multi_line_basic() {
    const char* why = "in a multi-line string right after a backslash";
    const char* fix = "write it as \\uXXXX there";
    while (i_ < t_.size() && !starts("\"\"\"")) {
      if (t_[i_++] != '\\') continue;
      if (high(i_)) fail(why, fix);
      if (!blank(i_)) {
        ++i_;  // an escape
        continue;
      }
      while (blank(i_)) ++i_;  // a line-ending backslash: the parser skips these
      if (high(i_)) fail(why, fix);
    }
    skip_past("\"\"\"");
  }
  [[noreturn]] void fail(const char* where, const char* allowed) const {
    size_t line = 1, col = 1;
    for (size_t k = 0; k < i_; ++k) {
      col = t_[k] == '\n' ? 1 : col + 1;
      line += t_[k] == '\n';
    }
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(t_[i_]));
    throw UserError(src_ + ":" + std::to_string(line) + ":" + std::to_string(col) +
                    ": TOML syntax error: a non-ASCII byte (" + hex + ") " + where +
                    "; allowed: " + allowed);
  }

  const std::string& t_;
  const std::string& src_;
  size_t i_ = 0;
};

}  // namespace

// ---- public: TOML --------------------------------------------------------------------------

void apply_toml_string(JobConfig& cfg, const std::string& text_in, const std::string& source_name,
                       std::vector<std::string>& warnings) {
  // A UTF-8 byte-order mark (some Windows editors write one) is not content: skipped.
  const std::string_view bom = "\xEF\xBB\xBF";
  const std::string text =
      text_in.compare(0, bom.size(), bom) == 0 ? text_in.substr(bom.size()) : text_in;
  NonAsciiGuard(text, source_name).run();
  toml::table root;
  try {
    root = toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    auto& b = e.source().begin;
    throw UserError(source_name + ":" + std::to_string(b.line) + ":" + std::to_string(b.column) +
                    ": TOML syntax error: " + std::string(e.description()));
  }
  apply_toml_table(cfg, root, source_name, warnings);
}

void apply_toml_file(JobConfig& cfg, const std::string& path, std::vector<std::string>& warnings) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UserError("config file '" + path +
                    "': cannot be read (it is a folder); give a TOML file with --config FILE");
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw UserError("config file '" + path + "': cannot be read (" + std::strerror(errno) +
                    "); give an existing TOML file with --config FILE");
  std::stringstream ss;
  ss << f.rdbuf();
  apply_toml_string(cfg, ss.str(), path, warnings);
}

}  // namespace titan
