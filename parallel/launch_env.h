// Where this process's rank comes from: torchrun, Slurm srun, OpenMPI, or a plain process.
#pragma once

#include <cstdint>
#include <string>

namespace titan {

struct LaunchEnv {
  std::string source = "single";  // torchrun | slurm | openmpi | single
  int64_t rank = 0;
  int64_t local_rank = 0;
  int64_t world_size = 1;
  int64_t local_world_size = 1;
  std::string master_addr;  // empty for a single process
  int64_t master_port = 0;
  int64_t restart_count = 0;  // TORCHELASTIC_RESTART_COUNT
  bool agent_store = false;   // TORCHELASTIC_USE_AGENT_STORE=True: every rank is a client

  bool is_rank0() const { return rank == 0; }
};

// Reads the environment. Throws UserError for an incomplete launcher environment, such as
// Slurm without MASTER_ADDR when SLURM_NTASKS > 1.
LaunchEnv detect_launch_env();

}  // namespace titan
