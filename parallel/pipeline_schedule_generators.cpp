// The schedule generators (one per torchtitan schedule), the stage-to-rank layout and the
// lowering of compute actions into sends and receives (add_transfers).
#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <ostream>
#include <sstream>

#include <c10/util/Exception.h>

#include "core/base/errors.h"
#include "core/base/strings.h"
#include "parallel/pipeline_schedule_detail.h"

namespace titan {

using namespace pipeline_detail;

// ---- generators -----------------------------------------------------------------------------

namespace {

using Ops = std::vector<Action>;

Action act(int64_t stage, ActionType type, int64_t mb) {
  return Action{stage, type, mb};
}

// As Schedule{GPipe,1F1B}._step_microbatches run them: GPipe forwards every micro-batch,
// then runs every backward in order; 1F1B forwards min(m, p - stage) micro-batches, then
// alternates one backward and one forward, then drains the backwards.
Ops gpipe_ops(int64_t rank, int64_t m) {
  Ops ops;
  for (int64_t j = 0; j < m; ++j) ops.push_back(act(rank, ActionType::kForward, j));
  for (int64_t j = 0; j < m; ++j) ops.push_back(act(rank, ActionType::kBackward, j));
  return ops;
}

Ops one_f_one_b_ops(int64_t rank, int64_t p, int64_t m) {
  Ops ops;
  const int64_t warmup = std::min(m, p - rank);
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back(act(rank, ActionType::kForward, f));
  while (true) {
    ops.push_back(act(rank, ActionType::kBackward, b++));
    if (f == m) break;
    ops.push_back(act(rank, ActionType::kForward, f++));
  }
  while (b < m) ops.push_back(act(rank, ActionType::kBackward, b++));
  return ops;
}

// ScheduleLoopedBFS: every micro-batch through each local stage in turn, then the backwards
// of the local stages in reverse, micro-batches last to first.
Ops looped_bfs_ops(int64_t rank, int64_t p, int64_t v, int64_t m) {
  Ops ops;
  for (int64_t l = 0; l < v; ++l)
    for (int64_t j = 0; j < m; ++j) ops.push_back(act(l * p + rank, ActionType::kForward, j));
  for (int64_t l = v - 1; l >= 0; --l)
    for (int64_t j = m - 1; j >= 0; --j) ops.push_back(act(l * p + rank, ActionType::kBackward, j));
  return ops;
}

// PyTorch's _get_warmup_ops and _get_1f1b_rank_ops, without the idle slots: Interleaved1F1B
// (factor 2, full backwards) and InterleavedZeroBubble (factor 1, I now and W later: the first
// `rank` steady-state backwards keep their W for the end, so W fills the bubble).
Ops interleaved_ops(int64_t rank, int64_t p, int64_t v, int64_t m, bool zero_bubble) {
  const int64_t rounds = std::max<int64_t>(1, m / p);
  const int64_t per_round = m / rounds;
  const int64_t factor = zero_bubble ? 1 : 2;
  const int64_t warmup = std::min((v - 1) * per_round + factor * (p - 1 - rank), m * v);
  const int64_t fwd_bwd = m * v - warmup;
  const int64_t total = warmup + fwd_bwd + warmup;
  const int64_t one_f_one_b_without_w = rank;
  auto fwd_stage = [&](int64_t step) { return ((step / per_round) % v) * p + rank; };
  auto bwd_stage = [&](int64_t step) {
    return (v - 1 - ((step - warmup) / per_round) % v) * p + rank;
  };
  const ActionType backward = zero_bubble ? ActionType::kBackwardInput : ActionType::kBackward;
  std::map<int64_t, int64_t> next_f, next_b, next_w;  // per stage: the next micro-batch
  std::vector<int64_t> backward_steps;
  size_t weights_done = 0;
  Ops ops;
  auto add_weight = [&]() {
    const int64_t s = bwd_stage(backward_steps[weights_done++]);
    ops.push_back(act(s, ActionType::kBackwardWeight, next_w[s]++));
  };
  for (int64_t op = 0; op < total; ++op) {
    if (op < warmup + fwd_bwd) {
      const int64_t s = fwd_stage(op);
      ops.push_back(act(s, ActionType::kForward, next_f[s]++));
    }
    if (op >= warmup) {
      const int64_t s = bwd_stage(op);
      ops.push_back(act(s, backward, next_b[s]++));
      backward_steps.push_back(op);
      if (zero_bubble && op - warmup >= one_f_one_b_without_w) add_weight();
    }
  }
  while (zero_bubble && weights_done < backward_steps.size()) add_weight();
  return ops;
}

// ScheduleZBVZeroBubble._calculate_single_rank_operations: rank r holds chunk 0 (stage r) and
// chunk 1 (stage 2p-1-r). It plans for at least 2p-1 micro-batches and drops the actions of
// micro-batches that do not exist.
Ops zbv_ops(int64_t rank, int64_t p, int64_t m) {
  const int64_t n = std::max(2 * p - 1, m);
  const int64_t c0 = rank, c1 = 2 * p - 1 - rank;
  int64_t f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  Ops ops;
  auto add = [&](int64_t s, ActionType t, int64_t j) { ops.push_back(act(s, t, j)); };
  for (int64_t i = 0; i < 2 * (p - rank) - 1; ++i) add(c0, ActionType::kForward, f0++);
  for (int64_t i = 0; i < rank; ++i) {
    add(c1, ActionType::kForward, f1++);
    add(c0, ActionType::kForward, f0++);
  }
  for (int64_t i = 0; i < p - rank; ++i) {
    add(c1, ActionType::kForward, f1++);
    add(c1, ActionType::kBackwardInput, b1);
    add(c1, ActionType::kBackwardWeight, b1++);
  }
  while (f1 < f0 || f0 < n) {
    if (f0 < n) add(c0, ActionType::kForward, f0++);
    add(c0, ActionType::kBackwardInput, b0);
    add(c0, ActionType::kBackwardWeight, b0++);
    add(c1, ActionType::kForward, f1++);
    add(c1, ActionType::kBackwardInput, b1);
    add(c1, ActionType::kBackwardWeight, b1++);
  }
  int64_t w0 = b0, w1 = b1;
  for (int64_t i = 0; i < rank; ++i) {
    add(c0, ActionType::kBackwardInput, b0++);
    add(c1, ActionType::kBackwardInput, b1++);
  }
  for (int64_t i = 0; i < p - rank; ++i) {
    add(c0, ActionType::kBackwardInput, b0++);
    add(c0, ActionType::kBackwardWeight, w0++);
  }
  while (w1 < b1) add(c1, ActionType::kBackwardWeight, w1++);
  while (w0 < b0) add(c0, ActionType::kBackwardWeight, w0++);
  TORCH_CHECK(f0 == b0 && b0 == w0 && f1 == b1 && b1 == w1, "ZBV generator lost an action");
  Ops kept;
  for (const auto& a : ops)
    if (a.microbatch < m) kept.push_back(a);
  return kept;
}

// ScheduleDualPipeV._calculate_single_rank_operations (PyTorch 2.11), on the V layout: rank r
// holds chunk 0 (stage r) and chunk 1 (stage 2p-1-r), m >= 2p micro-batches. Its overlapped
// "forward of one chunk + full backward of the other" pairs are written as the forward then
// the full backward (B): the runner runs them one after the other on one stream, and a B
// here stands for an I and a W of the same micro-batch. The I's of the ramp-up and ramp-down
// phases queue their W, which later slots take oldest first.
Ops dualpipev_ops(int64_t rank, int64_t p, int64_t m) {
  const int64_t c0 = rank, c1 = 2 * p - 1 - rank;
  std::map<int64_t, int64_t> next_f, next_b, next_w;  // per stage: the next micro-batch
  std::deque<std::pair<int64_t, int64_t>> pending_w;  // (stage, micro-batch) of queued W's
  Ops ops;
  auto forward = [&](int64_t s) { ops.push_back(act(s, ActionType::kForward, next_f[s]++)); };
  auto full = [&](int64_t s) {
    ops.push_back(act(s, ActionType::kBackward, next_b[s]++));
    ++next_w[s];
  };
  auto input = [&](int64_t s) {
    pending_w.emplace_back(s, next_b[s]);
    ops.push_back(act(s, ActionType::kBackwardInput, next_b[s]++));
  };
  auto weight = [&]() {
    if (pending_w.empty()) return;
    const auto [s, j] = pending_w.front();
    pending_w.pop_front();
    ops.push_back(act(s, ActionType::kBackwardWeight, j));
    ++next_w[s];
  };
  for (int64_t i = 0; i < 2 * (p - rank - 1); ++i) forward(c0);  // 1: F0
  for (int64_t i = 0; i < rank + 1; ++i) {                       // 2: F0 F1
    forward(c0);
    forward(c1);
  }
  for (int64_t i = 0; i < p - rank - 1; ++i) {  // 3: I1 W F1
    input(c1);
    weight();
    forward(c1);
  }
  auto pair = [&](int64_t f, int64_t b) {  // OVERLAP_F_B
    forward(f);
    ops.back().paired = true;
    full(b);
  };
  for (int64_t i = 0; i < m - 2 * p + rank + 1; ++i) {  // 4: (F0 B1) (F1 B0)
    pair(c0, c1);
    pair(c1, c0);
  }
  for (int64_t i = 0; i < p - rank - 1; ++i) {  // 5: B1 (F1 B0)
    full(c1);
    pair(c1, c0);
  }
  bool zero_bubble = false;  // 6: B1 B0, the second half as I's
  const int64_t step6 = rank + 1;
  for (int64_t i = 0; i < step6; ++i) {
    if (i == step6 / 2 && rank % 2 == 1) zero_bubble = true;
    zero_bubble ? input(c1) : full(c1);
    if (i == step6 / 2 && rank % 2 == 0) zero_bubble = true;
    zero_bubble ? input(c0) : full(c0);
  }
  for (int64_t i = 0; i < p - rank - 1; ++i) {  // 7: W B0
    weight();
    zero_bubble ? input(c0) : full(c0);
  }
  while (!pending_w.empty()) weight();  // 8: the W's left
  TORCH_CHECK(next_f[c0] == m && next_f[c1] == m && next_b[c0] == m && next_b[c1] == m &&
                  next_w[c0] == m && next_w[c1] == m,
              "DualPipeV generator lost an action");
  return ops;
}

void check_schedule_size(const ScheduleInfo& info, int64_t p, int64_t v, int64_t m) {
  const std::string name = std::string(kScheduleKey) + " = " + info.name;
  if (p < 1)
    throw UserError("parallelism.pipeline_parallel_degree = " + std::to_string(p) +
                    " must be at least 1");
  if (m < 1)
    throw UserError(std::string(kMicrobatchKey) + " gives " + std::to_string(m) +
                    " micro-batches; at least 1 is needed");
  if (info.single_stage && v != 1)
    throw UserError(name + " runs exactly 1 stage per rank, but the split gives " +
                    std::to_string(v) + " (" + kLayersPerStageKey +
                    " or parallelism.module_fqns_per_model_part)");
  if (info.v_style && v != 2)
    throw UserError(name + " needs exactly 2 stages per rank (the V: rank r holds stages r and " +
                    "2p-1-r), but the split gives " + std::to_string(v) + " (" +
                    kLayersPerStageKey + " or parallelism.module_fqns_per_model_part)");
  if (v < 1) throw UserError(name + ": every rank needs at least 1 stage");
  if (info.kind == ScheduleKind::k1F1B && m < p)
    throw UserError(name + " needs at least as many micro-batches as stages: " + std::to_string(m) +
                    " micro-batches for " + std::to_string(p) + " stages; lower " + kMicrobatchKey);
  if (info.kind == ScheduleKind::kInterleaved1F1B ||
      info.kind == ScheduleKind::kInterleavedZeroBubble) {
    const int64_t rounds = std::max<int64_t>(1, m / p);
    if (m % rounds != 0)
      throw UserError(
          name + " needs the micro-batches to be a multiple of the rounds " +
          "(max(1, micro-batches / pipeline_parallel_degree) = " + std::to_string(rounds) +
          "), but there are " + std::to_string(m) + "; change " + kMicrobatchKey);
  }
  if (info.kind == ScheduleKind::kDualPipeV && m < 2 * p)
    throw UserError(name + " needs at least as many micro-batches as stages: " + std::to_string(m) +
                    " micro-batches for " + std::to_string(2 * p) + " stages; lower " +
                    kMicrobatchKey);
}

}  // namespace

std::vector<int64_t> pipeline_stage_ranks(int64_t p, int64_t num_stages, bool v_style) {
  TORCH_CHECK(p >= 1 && num_stages % p == 0, "pipeline_stage_ranks: ", num_stages, " stages over ",
              p, " ranks");
  std::vector<int64_t> out(num_stages);
  for (int64_t s = 0; s < num_stages; ++s) {
    const int64_t r = s % p;
    out[s] = (!v_style || (s / p) % 2 == 0) ? r : p - 1 - r;
  }
  return out;
}

PipelineSchedule make_schedule(const std::string& name, int64_t num_ranks, int64_t stages_per_rank,
                               int64_t num_microbatches) {
  const ScheduleInfo info = schedule_info(name);
  const int64_t p = num_ranks, v = stages_per_rank, m = num_microbatches;
  check_schedule_size(info, p, v, m);
  PipelineSchedule s;
  s.name = info.name;
  s.num_ranks = p;
  s.num_stages = p * v;
  s.num_microbatches = m;
  s.stage_to_rank = pipeline_stage_ranks(p, s.num_stages, info.v_style);
  for (int64_t r = 0; r < p; ++r) {
    switch (info.kind) {
      case ScheduleKind::kGPipe:
        s.ranks.push_back(gpipe_ops(r, m));
        break;
      case ScheduleKind::k1F1B:
        s.ranks.push_back(one_f_one_b_ops(r, p, m));
        break;
      case ScheduleKind::kLoopedBFS:
        s.ranks.push_back(looped_bfs_ops(r, p, v, m));
        break;
      case ScheduleKind::kInterleaved1F1B:
        s.ranks.push_back(interleaved_ops(r, p, v, m, false));
        break;
      case ScheduleKind::kInterleavedZeroBubble:
        s.ranks.push_back(interleaved_ops(r, p, v, m, true));
        break;
      case ScheduleKind::kZBVZeroBubble:
        s.ranks.push_back(zbv_ops(r, p, m));
        break;
      case ScheduleKind::kDualPipeV:
        s.ranks.push_back(dualpipev_ops(r, p, m));
        break;
    }
  }
  return s;
}

PipelineSchedule make_forward_schedule(const std::vector<int64_t>& stage_to_rank, int64_t num_ranks,
                                       int64_t num_microbatches) {
  PipelineSchedule sc;
  sc.name = "forward-only";
  sc.num_ranks = num_ranks;
  sc.num_stages = static_cast<int64_t>(stage_to_rank.size());
  sc.num_microbatches = num_microbatches;
  sc.stage_to_rank = stage_to_rank;
  sc.forward_only = true;
  sc.ranks.resize(static_cast<size_t>(num_ranks));
  for (int64_t st = 0; st < sc.num_stages; ++st)
    for (int64_t j = 0; j < num_microbatches; ++j)
      sc.ranks.at(static_cast<size_t>(stage_to_rank[static_cast<size_t>(st)]))
          .push_back(act(st, ActionType::kForward, j));
  return sc;
}

PipelineSchedule add_transfers(const PipelineSchedule& in) {
  TORCH_CHECK(!in.has_comms(), "add_transfers: schedule ", in.name, " already has transfers");
  PipelineSchedule out = in;
  const auto& where = in.stage_to_rank;
  const int64_t last = in.num_stages - 1;
  auto remote = [&](int64_t a, int64_t b) { return where.at(a) != where.at(b); };
  for (size_t r = 0; r < in.ranks.size(); ++r) {
    Ops ops;
    auto recv = [&](const Action& a) {
      const int64_t s = a.stage, j = a.microbatch;
      if (a.type == ActionType::kForward && s > 0 && remote(s - 1, s))
        ops.push_back(act(s, ActionType::kRecvF, j));
      const bool bwd = a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput;
      if (bwd && s < last && remote(s + 1, s)) ops.push_back(act(s, ActionType::kRecvB, j));
    };
    auto send = [&](const Action& a) {
      const int64_t s = a.stage, j = a.microbatch;
      if (a.type == ActionType::kForward && s < last && remote(s + 1, s))
        ops.push_back(act(s, ActionType::kSendF, j));
      const bool bwd = a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput;
      if (bwd && s > 0 && remote(s - 1, s)) ops.push_back(act(s, ActionType::kSendB, j));
    };
    const Ops& acts = in.ranks[r];
    for (size_t i = 0; i < acts.size(); ++i) {
      const bool pair = acts[i].paired && i + 1 < acts.size();
      const Action& a = acts[i];
      const Action* b = pair ? &acts[i + 1] : nullptr;
      recv(a);
      if (b) recv(*b);
      ops.push_back(a);
      if (b) ops.push_back(*b);
      send(a);
      if (b) send(*b);
      i += b ? 1 : 0;
    }
    out.ranks[r] = std::move(ops);
  }
  return out;
}

}  // namespace titan
