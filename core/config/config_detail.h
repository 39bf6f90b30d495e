// Helpers the config files (config.cpp, config_toml.cpp, config_cli.cpp, config_text.cpp)
// share; defined in config.cpp. Not for use outside core/config/.
#pragma once

#include <string>
#include <vector>

#include "core/config/config.h"

namespace titan::config_detail {

std::string join(const std::vector<std::string>& v, const std::string& sep);
// "a,,b" -> {"a", "b"}: empty items dropped.
std::vector<std::string> split_commas(const std::string& s);
// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);
// Shortest text that parses back to `x`, always TOML-readable as a float ("1.0", "inf").
std::string format_double(double x);
// `s` as a TOML basic string, quoted and escaped.
std::string quote_toml(const std::string& s);
// true/1/yes/on and false/0/no/off, any case; false when `t` is none of them.
bool parse_bool_text(const std::string& t, bool& out);
// Whether `opt` takes inf: only a float whose default is infinite, where inf has a meaning.
bool infinity_allowed(const Option& opt);
// The values `opt` allows, as messages and --help say them.
std::string allowed_text(const Option& opt);

// The option called `name`, directly or by an old spelling (then `*old` is set).
const Option* lookup(const std::string& name, bool* old);
// Adds "<where>: <body>" unless a warning with the same body is already there.
void warn_once(std::vector<std::string>& warnings, const std::string& where,
               const std::string& body);
// A torchtitan key we ignore, or one under an older name: each warns once.
void warn_ignored(std::vector<std::string>& warnings, const std::string& where,
                  const std::string& name);
void warn_renamed(std::vector<std::string>& warnings, const std::string& where,
                  const std::string& old_name, const Option& opt);

}  // namespace titan::config_detail
