// Context parallelism over the cp ranks of each data-parallel rank (docs/distributed.md,
// "Context parallel"): each rank runs its slice of every sequence (head-tail balanced by
// default), attention all-gathers keys and values over the cp group. The mesh folds cp into
// FSDP's shard dimension (parallel/mesh.h), so parameters are sharded and their gradients
// summed over dp_shard x cp; the step's loss is each rank's token share over the global token
// count, so the summed gradients are those of one rank. This file knows no model: it checks
// what does not compose and installs core/train/context_parallel.h's ContextParallel.
#pragma once

#include <memory>
#include <string>

#include "core/config/config.h"
#include "core/train/context_parallel.h"
#include "core/train/model.h"
#include "parallel/process_group.h"

namespace titan {

// parallelism.context_parallel_load_balancer -> the balancer (validated by the registry).
CpBalancer cp_balancer(const std::string& name);

// Throws UserError (exit 2, naming the keys) for what context parallelism does not compose
// with on this model, then installs the cp collectives over `cp_group` in the model.
// Returns the startup log line.
std::string apply_context_parallel(Model& model, ProcessGroup& cp_group, const JobConfig& cfg);

}  // namespace titan
