// Errors the user can cause (bad config, flag or file). main() prints the message and
// exits with status 2. Internal invariants use TORCH_CHECK instead.
#pragma once

#include <stdexcept>
#include <string>

namespace titan {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& msg) : std::runtime_error(msg) {}
};

// Exit status for UserError.
constexpr int kExitUserError = 2;

}  // namespace titan
