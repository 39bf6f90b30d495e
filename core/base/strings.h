// Small string helpers shared by every layer (one definition, not one per file).
#pragma once

#include <cctype>
#include <string>
#include <string_view>

namespace titan {

// Whether `s` ends with `suffix` (an empty suffix ends every string).
inline bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// `s` with ASCII letters in lower case (names and keywords, not text).
inline std::string ascii_lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace titan
