// The op-level capture check (core/train/capture_check.h) around a test's own step, for the
// kernel tests: 4 steps, 1 of warm-up, the same inputs key each time.
#pragma once

#include <functional>
#include <string>

#include "core/base/errors.h"
#include "core/train/capture_check.h"

namespace titan::test {

struct CaptureResult {
  std::string error;  // the check's UserError, "" when every step passed
  int64_t compared = 0;
};

// Runs `step` (forward and backward inside its ModuleScope) 4 times under one CaptureCheck.
inline CaptureResult capture_check_steps(const std::function<void()>& step) {
  CaptureCheck check(/*warmup_steps=*/1);
  CaptureResult r;
  try {
    for (int i = 0; i < 4; ++i) {
      check.begin_step("same");
      step();
      check.end_step();
    }
  } catch (const UserError& e) {
    r.error = e.what();
  }
  r.compared = check.steps_compared();
  return r;
}

}  // namespace titan::test
