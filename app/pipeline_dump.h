// `titan-train --config FILE --dump-schedule`: the pipeline a config asks for, on one
// process and without training: the stage split (stage -> rank, modules), the schedule's
// per-rank actions with their transfers, and the simulated grid with its bubble fraction,
// after the same checks training would run before its first step (docs/distributed.md,
// "Pipeline parallel").
#pragma once

#include <string>

#include "core/config/config.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/pipeline_stages.h"

namespace titan {

struct PipelinePlan {
  PipelineStagePlan stages;
  PipelineSchedule schedule;  // with transfers
  ScheduleTimeline timeline;
  int64_t n_layers = 0;
  int64_t microbatches = 0;
  bool has_pairs = false;      // the schedule has DualPipeV's forward + backward pairs
  bool overlap_pairs = false;  // which run overlapped (else they were lowered as plain actions)
};

// The stage split and the checked schedule of cfg's [parallelism] pipeline keys for a model
// of `n_layers` layers. Bad input (layers that do not split, a schedule that does not fit,
// tied embeddings under PP, an unreadable or mismatched CSV) is a UserError naming the key.
PipelinePlan plan_pipeline(const JobConfig& cfg, int64_t n_layers, bool tied_embeddings);

// The plan as text: the header, the stage table, the actions per rank and the grid.
std::string describe_pipeline(const JobConfig& cfg, const PipelinePlan& plan);

// Builds cfg's model on the meta device for its layer count and tying, prints the plan.
// Returns the exit status (0); bad input throws a UserError (exit 2).
int run_dump_schedule(const JobConfig& cfg);

}  // namespace titan
