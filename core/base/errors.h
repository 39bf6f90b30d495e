// Errors the user can cause (bad config, flag or file). main() prints the message and
// exits with status 2. Internal invariants use TORCH_CHECK instead.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace titan {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& msg) : std::runtime_error(msg) {}
};

// Exit status for UserError.
constexpr int kExitUserError = 2;

// "[2, 3]": a tensor shape in messages (a std::vector<int64_t> or an at::IntArrayRef).
template <class Shape>
std::string shape_str(const Shape& shape) {
  std::string r = "[";
  for (auto d : shape) r += (r.size() > 1 ? ", " : "") + std::to_string(d);
  return r + "]";
}

}  // namespace titan
