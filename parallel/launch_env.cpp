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

}  // namespace

LaunchEnv detect_launch_env() {
  LaunchEnv e;
  if (env("RANK") && env("WORLD_SIZE")) {  // torchrun (or anything torch.distributed-like)
    e.source = "torchrun";
    e.rank = env_int("RANK", 0);
    e.world_size = env_int("WORLD_SIZE", 1);
    e.local_rank = env_int("LOCAL_RANK", 0);
    e.local_world_size = env_int("LOCAL_WORLD_SIZE", e.world_size);
    e.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0);
    const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
    e.agent_store = agent && (std::string(agent) == "True" || std::string(agent) == "true" ||
                              std::string(agent) == "1");
    read_master(e, "torchrun");
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    e.source = "slurm";
    e.rank = env_int("SLURM_PROCID", 0);
    e.world_size = env_int("SLURM_NTASKS", 1);
    e.local_rank = env_int("SLURM_LOCALID", 0);
    e.local_world_size = env_int("SLURM_NTASKS_PER_NODE", e.world_size);
    e.restart_count = env_int("SLURM_RESTART_COUNT", 0);
    read_master(e, "Slurm");
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    e.source = "openmpi";
    e.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    e.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    e.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    e.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", e.world_size);
    read_master(e, "OpenMPI");
  }
  if (e.world_size < 1 || e.rank < 0 || e.rank >= e.world_size)
    throw UserError(e.source + " launch: rank " + std::to_string(e.rank) +
                    " is outside world size " + std::to_string(e.world_size));
  return e;
}

}  // namespace titan
