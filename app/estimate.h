// titan-train estimate: per-rank memory, FLOPs, communication and step time of a config at
// a world size, from the model's parameter shapes (built on the meta device: nothing is
// allocated) and the parallel plan the trainer would apply (docs/distributed.md).
#pragma once

namespace titan {

// argv[0] is "estimate". Returns the exit status.
int run_estimate_command(int argc, char** argv);

}  // namespace titan
