// What the pipeline_schedule*.cpp files share: the config keys their messages name and the
// number of action types. Internal to parallel/pipeline_schedule*.
#pragma once

namespace titan::pipeline_detail {

inline constexpr const char* kScheduleKey = "parallelism.pipeline_parallel_schedule";
inline constexpr const char* kCsvKey = "parallelism.pipeline_parallel_schedule_csv";
inline constexpr const char* kMicrobatchKey =
    "parallelism.pipeline_parallel_microbatch_size (micro-batches = training.local_batch_size / "
    "pipeline_parallel_microbatch_size)";
inline constexpr const char* kLayersPerStageKey = "parallelism.pipeline_parallel_layers_per_stage";
inline constexpr int kNumTypes = 8;  // ActionType's values

}  // namespace titan::pipeline_detail
