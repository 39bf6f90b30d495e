// Wall-clock intervals for logs and metrics (steady_clock: never jumps with the system clock).
#pragma once

#include <chrono>

namespace titan {

// Milliseconds from `t` to now.
inline double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace titan
