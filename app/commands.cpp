#include "app/commands.h"

#include <string>

#include "core/errors.h"
#include "core/log.h"

namespace titan {

int run_subcommand(int argc, char** argv) {
  std::string name = argv[0];
  throw UserError("unknown subcommand '" + name + "'; allowed: none yet (see --help)");
  (void)argc;
}

int run_train_command(const JobConfig& cfg, const LaunchEnv& launch) {
  log_info("resolved config:\n" + config_table(cfg));
  DerivedConfig d = derive_config(cfg, launch.world_size);
  log_info("=> world_size = " + std::to_string(launch.world_size) + " (" + launch.source + ")");
  log_info("=> grad_accum_steps = " + std::to_string(d.grad_accum_steps));
  log_info("=> tokens_per_step = " + std::to_string(d.tokens_per_step));
  log_info("training is not implemented yet; nothing was trained");
  return 1;
}

}  // namespace titan
