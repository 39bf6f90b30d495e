// Every exception that reaches main() becomes one clear message and a documented exit status
// (README "Exit status"), never std::terminate's bare SIGABRT.
#pragma once

#include "core/config/config.h"

namespace titan {

// Exit statuses besides 0 (success) and kExitUserError (2, core/base/errors.h).
constexpr int kExitInternalError = 1;  // a failed invariant (TORCH_CHECK) or any other bug
constexpr int kExitOutOfMemory = 3;    // the device or the host ran out of memory
constexpr int kExitNonFiniteLoss = 4;  // the loss became nan or inf (training diverged)

// Call inside a catch block of main(): prints what went wrong to stderr and returns the exit
// status. `cfg` (null before the config is read) names the keys that lower memory use in the
// out-of-memory message.
int report_current_exception(const JobConfig* cfg);

// Test seam: debug.plant_error = internal|oom|std throws that kind of error where a run
// would start training, so tests can check each mapping without exhausting real memory
// (host_read acts inside the step: StepTestHooks).
void maybe_plant_error(const JobConfig& cfg);

}  // namespace titan
