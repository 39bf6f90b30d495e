// Pipeline schedules as data (docs/distributed.md, "Pipeline parallel"): per-rank lists of
// actions in execution order, in the vocabulary of torch.distributed.pipelining's _Action
// (`0F1` = stage 0 forward of micro-batch 1; B full backward, I backward-input, W
// backward-weight; SEND_F, RECV_F, SEND_B, RECV_B the point-to-point transfers).
//
// A schedule here is an order, not a timing: there are no idle slots in the lists. The
// check simulates the order (each compute action takes a fixed number of ticks, a transfer
// none) to find deadlocks and to draw the ticks a person reads, with the bubble fraction.
//
// Generators follow PyTorch 2.11's schedules (torchtitan 0.2.2 uses them unchanged):
// GPipe and 1F1B as their single-stage runtimes execute them, LoopedBFS, Interleaved1F1B,
// InterleavedZeroBubble and ZBVZeroBubble as their _calculate_single_rank_operations
// order them. DualPipeV's overlapped forward + backward pairs are written as the forward,
// marked `paired`, then the full backward.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace titan {

enum class ScheduleKind {
  kGPipe,
  k1F1B,
  kLoopedBFS,
  kInterleaved1F1B,
  kInterleavedZeroBubble,
  kZBVZeroBubble,
  kDualPipeV,
};

struct ScheduleInfo {
  ScheduleKind kind = ScheduleKind::k1F1B;
  std::string name;             // torchtitan's spelling: "1F1B", "ZBVZeroBubble", ...
  bool single_stage = false;    // one stage per rank (PipelineScheduleSingle)
  bool v_style = false;         // rank r holds stages r and 2p-1-r (ZBVZeroBubble, DualPipeV)
  bool split_backward = false;  // backward as I (input) and W (weight) actions
};

// torchtitan's schedule names, matched case-insensitively as get_schedule_class does.
// A name it does not know is a UserError naming parallelism.pipeline_parallel_schedule.
ScheduleInfo schedule_info(const std::string& name);

enum class ActionType : uint8_t {
  kForward,         // F
  kBackward,        // B: input and weight gradients together
  kBackwardInput,   // I
  kBackwardWeight,  // W
  kSendF,           // activations of (stage, micro-batch) to the next stage's rank
  kRecvF,           // activations for (stage, micro-batch) from the previous stage's rank
  kSendB,           // input gradient of (stage, micro-batch) to the previous stage's rank
  kRecvB,           // output gradient for (stage, micro-batch) from the next stage's rank
};

struct Action {
  int64_t stage = 0;
  ActionType type = ActionType::kForward;
  int64_t microbatch = 0;
  // DualPipeV's OVERLAP_F_B: this forward and the next compute action, a full backward of
  // another stage, form one pair. Lowering receives both inputs before the pair and sends
  // both results after it; the runner may run the two overlapped (parallel/overlap_pair.h).
  // Not part of the action's identity (==, str) nor of the CSV form.
  bool paired = false;

  bool is_compute() const;
  // PyTorch's _Action.__repr__: stage, type code, micro-batch ("1B0", "2SEND_F3").
  std::string str() const;
  bool operator==(const Action& o) const {
    return stage == o.stage && type == o.type && microbatch == o.microbatch;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

// The reverse of Action::str. Action strings without a micro-batch (UNSHARD, RESHARD,
// REDUCE_GRAD) and OVERLAP_F_B groups are refused: this runtime has no such actions yet.
// `where` prefixes the message ("schedule.csv row 2 column 5").
Action parse_action(const std::string& text, const std::string& where);
std::ostream& operator<<(std::ostream& os, const Action& a);  // as str()

struct PipelineSchedule {
  std::string name;  // the generator's schedule name, or the CSV file it was read from
  int64_t num_ranks = 0;
  int64_t num_stages = 0;
  int64_t num_microbatches = 0;
  std::vector<int64_t> stage_to_rank;      // by stage index
  std::vector<std::vector<Action>> ranks;  // per rank, in execution order
  // Forwards only (evaluation): no backward and no gradient transfer is expected.
  bool forward_only = false;

  bool has_comms() const;  // any SEND_* or RECV_* action
};

// The rank of each of `num_stages` stages: generate_stage_to_rank_mapping's "loop" style
// (stage s on rank s % p) or its "v" style (down the ranks, then back up).
std::vector<int64_t> pipeline_stage_ranks(int64_t pp_degree, int64_t num_stages, bool v_style);

// The compute-only schedule (no transfers) that PyTorch's `name` schedule runs for
// `num_ranks` ranks holding `stages_per_rank` stages each over `num_microbatches`
// micro-batches. Bad combinations are UserErrors naming the key at fault: fewer micro-batches
// than stages for 1F1B, a V schedule or a single-stage schedule with the wrong number of
// stages per rank, micro-batches that are not a multiple of the rounds of an interleaved one.
PipelineSchedule make_schedule(const std::string& name, int64_t num_ranks, int64_t stages_per_rank,
                               int64_t num_microbatches);

// The forwards alone, for evaluation: each rank runs its stages in order, every micro-batch
// of a stage before the next stage (GPipe's forward half), `stage_to_rank` as training's.
PipelineSchedule make_forward_schedule(const std::vector<int64_t>& stage_to_rank, int64_t num_ranks,
                                       int64_t num_microbatches);

// Lowers a compute-only schedule: a SEND right after each compute whose consumer lives on
// another rank, the matching RECV right before that consumer. Stages adjacent on one rank
// (the V's turn) pass tensors locally and get no transfer. A paired forward and its backward
// get their RECVs together before the pair and their SENDs together after it (PyTorch's
// OVERLAP_F_B runtime does the same).
PipelineSchedule add_transfers(const PipelineSchedule& compute_only);

// torchtitan's pipeline_parallel_schedule_csv format: one row per rank, one action string
// per cell; empty cells (PyTorch's idle slots) are skipped. Transfers may be present (the
// compute_comms format) or not. Stage ranks are inferred from the rows; a stage found on two
// ranks, an unreadable cell or an empty file is a UserError naming
// parallelism.pipeline_parallel_schedule_csv and the file.
std::string schedule_to_csv(const PipelineSchedule& schedule);
PipelineSchedule schedule_from_csv(const std::string& text, const std::string& source);
PipelineSchedule load_schedule_csv(const std::string& path);
void save_schedule_csv(const PipelineSchedule& schedule, const std::string& path);

// Ticks per compute action. The default makes a full backward as long as its two halves and
// twice a forward, the usual cost model for comparing schedules.
struct ScheduleCosts {
  int64_t forward = 1;
  int64_t backward = 2;
  int64_t backward_input = 1;
  int64_t backward_weight = 1;
  int64_t of(ActionType type) const;
};

struct TimedAction {
  Action action;
  int64_t start = 0, end = 0;  // ticks; a transfer has start == end
};

struct ScheduleTimeline {
  std::vector<std::vector<TimedAction>> ranks;  // every action, in each rank's order
  int64_t makespan = 0;                         // ticks until the last rank finishes
  std::vector<int64_t> busy;                    // compute ticks per rank
  // Idle share of ranks x makespan; (p-1)/(m+p-1) for GPipe and 1F1B.
  double bubble_fraction = 0.0;
  ScheduleCosts costs;  // the ticks it was simulated with
};

// Checks a schedule before it runs and simulates it. A compute-only schedule is lowered
// with add_transfers first; one with transfers is checked as given. Throws a UserError that
// lists what is wrong, with the ticks reached, for: a stage on two ranks, a stage or
// micro-batch out of range, a forward or backward missing or repeated, W before its I, a
// SEND without its RECV (or the reverse), a transfer between stages of one rank, a compute
// whose input never arrives on its rank, and a deadlock (no rank can move).
//
// The model of the runtime: a SEND is posted without waiting (isend, or batched with the
// receives of the same tick, as PyTorch does); a RECV completes once its SEND was posted; a
// compute starts when its rank is free and its inputs are there.
ScheduleTimeline check_schedule(const PipelineSchedule& schedule, const ScheduleCosts& costs = {});

// Ranks as rows, ticks as columns: each compute action fills its ticks with its string
// ("0F1", continued as "----"), idle ticks are ".", and a legend names the schedule,
// its size and the bubble. Transfers are not drawn (they take no ticks).
std::string render_schedule_grid(const PipelineSchedule& schedule,
                                 const ScheduleTimeline& timeline);

}  // namespace titan
