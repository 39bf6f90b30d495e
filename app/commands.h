// The entry points main() dispatches to.
#pragma once

#include "core/config/config.h"
#include "parallel/launch_env.h"

namespace titan {

// `titan-train <subcommand> ...` (tokenize, ...). argv[0] is the subcommand name.
int run_subcommand(int argc, char** argv);

// A training run with a validated config. Returns the process exit status.
int run_train_command(const JobConfig& cfg, const LaunchEnv& launch);

}  // namespace titan
