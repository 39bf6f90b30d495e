// titan-train: parse, build, run; maps every error to one message and an exit status
// (app/fatal.h: 2 bad input, 3 out of memory, 1 internal).
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "app/commands.h"
#include "app/fatal.h"
#include "app/pipeline_dump.h"
#include "core/config/config.h"
#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/telemetry/memory_stats.h"
#include "parallel/launch_env.h"

int main(int argc, char** argv) {
  using namespace titan;
  // A file-size limit (or a full quota) then fails the write with EFBIG instead of killing
  // the process, so a checkpoint save can report it and keep the previous checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  // Before any tensor exists: CPU runs report allocated and peak memory (core/telemetry/memory_stats.h).
  install_cpu_memory_counter();
  std::optional<JobConfig> cfg;  // a copy for the out-of-memory hint, once read and checked
  try {
    if (argc == 1) {  // a bare `titan-train` would otherwise train 10,000 steps at seq 2048
      std::printf("%s", usage_text().c_str());
      return 0;
    }
    if (argv[1][0] != '-') return run_subcommand(argc - 1, argv + 1);
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "--print-config-reference") == 0) {
        std::printf("%s", config_reference_markdown().c_str());
        return 0;
      }
    }
    CliResult cli = parse_command_line(argc, argv);
    if (cli.show_help) {
      std::printf("%s", config_help_text().c_str());
      return 0;
    }
    LaunchEnv launch = detect_launch_env();
    log_set_rank(launch.rank);
    for (auto& w : cli.warnings) log_warn(w);
    validate_config(cli.cfg);
    if (cli.dump_schedule) return run_dump_schedule(cli.cfg);  // one process, no world
    if (cli.dump_config) {  // no world yet: degrees are checked at launch
      std::printf("%s", dump_config_toml(cli.cfg).c_str());
      return 0;
    }
    validate_for_world(cli.cfg, launch.world_size);
    cfg = cli.cfg;
    maybe_plant_error(cli.cfg);
    return run_train_command(cli.cfg, launch);
  } catch (...) {
    return report_current_exception(cfg ? &*cfg : nullptr);
  }
}
