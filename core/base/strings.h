// Small string helpers shared by every layer (one definition, not one per file).
#pragma once

#include <string_view>

namespace titan {

// Whether `s` ends with `suffix` (an empty suffix ends every string).
inline bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace titan
