// Looking up a model flavor by name, with one error message for every family.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/base/errors.h"

namespace titan {

// `names` lists the flavors in the order the error message shows them.
template <class Args>
const Args& find_flavor(const std::map<std::string, Args>& table,
                        const std::vector<std::string>& names, const std::string& family,
                        const std::string& flavor) {
  auto it = table.find(flavor);
  if (it == table.end()) {
    std::string allowed;
    for (auto& n : names) allowed += (allowed.empty() ? "" : ", ") + n;
    throw UserError("model.flavor = \"" + flavor + "\" is not a " + family +
                    " flavor; allowed: " + allowed);
  }
  return it->second;
}

}  // namespace titan
