// The entry points main() dispatches to.
#pragma once

#include "core/config/config.h"
#include "parallel/launch_env.h"

namespace CLI {
class App;
}

namespace titan {

// Parses a subcommand's flags. Prints the help and returns false for --help; a bad flag is
// a UserError prefixed with the subcommand's name.
bool parse_subcommand(CLI::App& app, int argc, char** argv, const char* name);

// `titan-train <subcommand> ...` (tokenize, ...). argv[0] is the subcommand name.
int run_subcommand(int argc, char** argv);

// A training run with a validated config. Returns the process exit status.
int run_train_command(const JobConfig& cfg, const LaunchEnv& launch);

}  // namespace titan
