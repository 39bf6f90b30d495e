#include "parallel/launch_env.h"

#include <cstdlib>

#include "core/base/errors.h"

namespace titan {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  if (*end)
    throw UserError("environment variable " + std::string(name) + "='" + v + "' is not an integer");
  return x;
}

void read_master(LaunchEnv& e, const char* launcher) {
  if (const char* a = env("MASTER_ADDR")) e.master_addr = a;
  e.master_port = env_int("MASTER_PORT", 29500);
  if (e.world_size > 1 && e.master_addr.empty())
    throw UserError(
        std::string(launcher) + " launch with " + std::to_string(e.world_size) +
        " ranks but MASTER_ADDR is not set; allowed: the host name or address of "
        "rank 0 (export MASTER_ADDR in the batch script, see scripts/slurm_example.sbatch)");
}

// The variables one launcher sets for each process; `restarts` may be null.
struct LauncherVars {
  const char *source, *name, *rank, *world_size, *local_rank, *local_world_size, *restarts;
};

void read_launcher(LaunchEnv& e, const LauncherVars& v) {
  e.source = v.source;
  e.rank = env_int(v.rank, 0);
  e.world_size = env_int(v.world_size, 1);
  e.local_rank = env_int(v.local_rank, 0);
  e.local_world_size = env_int(v.local_world_size, e.world_size);
  if (v.restarts) e.restart_count = env_int(v.restarts, 0);
  read_master(e, v.name);
}

}  // namespace

LaunchEnv detect_launch_env() {
  LaunchEnv e;
  if (env("RANK") && env("WORLD_SIZE")) {  // torchrun (or anything torch.distributed-like)
    read_launcher(e, {"torchrun", "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                      "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"});
    const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
    e.agent_store = agent && (std::string(agent) == "True" || std::string(agent) == "true" ||
                              std::string(agent) == "1");
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    read_launcher(e, {"slurm", "Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                      "SLURM_NTASKS_PER_NODE", "SLURM_RESTART_COUNT"});
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    read_launcher(e, {"openmpi", "OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                      "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr});
  }
  if (e.world_size < 1 || e.rank < 0 || e.rank >= e.world_size)
    throw UserError(e.source + " launch: rank " + std::to_string(e.rank) +
                    " is outside world size " + std::to_string(e.world_size));
  return e;
}

}  // namespace titan
