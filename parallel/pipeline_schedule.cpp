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

namespace titan {

namespace {

constexpr const char* kScheduleKey = "parallelism.pipeline_parallel_schedule";
constexpr const char* kCsvKey = "parallelism.pipeline_parallel_schedule_csv";
constexpr const char* kMicrobatchKey =
    "parallelism.pipeline_parallel_microbatch_size (micro-batches = training.local_batch_size / "
    "pipeline_parallel_microbatch_size)";
constexpr const char* kLayersPerStageKey = "parallelism.pipeline_parallel_layers_per_stage";

const char* type_code(ActionType t) {
  switch (t) {
    case ActionType::kForward:
      return "F";
    case ActionType::kBackward:
      return "B";
    case ActionType::kBackwardInput:
      return "I";
    case ActionType::kBackwardWeight:
      return "W";
    case ActionType::kSendF:
      return "SEND_F";
    case ActionType::kRecvF:
      return "RECV_F";
    case ActionType::kSendB:
      return "SEND_B";
    case ActionType::kRecvB:
      return "RECV_B";
  }
  return "?";
}

constexpr int kNumTypes = 8;

}  // namespace

// ---- names and actions ----------------------------------------------------------------------

ScheduleInfo schedule_info(const std::string& name) {
  static const std::vector<ScheduleInfo> known = {
      {ScheduleKind::kGPipe, "GPipe", true, false, false},
      {ScheduleKind::k1F1B, "1F1B", true, false, false},
      {ScheduleKind::kLoopedBFS, "LoopedBFS", false, false, false},
      {ScheduleKind::kInterleaved1F1B, "Interleaved1F1B", false, false, false},
      {ScheduleKind::kInterleavedZeroBubble, "InterleavedZeroBubble", false, false, true},
      {ScheduleKind::kZBVZeroBubble, "ZBVZeroBubble", false, true, true},
      {ScheduleKind::kDualPipeV, "DualPipeV", false, true, true},
  };
  std::string allowed;
  for (const auto& k : known) {
    if (ascii_lower(k.name) == ascii_lower(name)) return k;
    allowed += (allowed.empty() ? "" : ", ") + k.name;
  }
  throw UserError(std::string(kScheduleKey) + " = '" + name +
                  "' is not a pipeline schedule; allowed (any case): " + allowed);
}

bool Action::is_compute() const {
  return type == ActionType::kForward || type == ActionType::kBackward ||
         type == ActionType::kBackwardInput || type == ActionType::kBackwardWeight;
}

std::string Action::str() const {
  return std::to_string(stage) + type_code(type) + std::to_string(microbatch);
}

Action parse_action(const std::string& text, const std::string& where) {
  auto bad = [&](const std::string& why) {
    return UserError(where + ": action '" + text + "' " + why +
                     "; expected <stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B><micro-batch>, "
                     "as in 0F1, 1B0, 2I3, 2W3, 0SEND_F1");
  };
  size_t i = 0;
  const size_t n = text.size();
  auto digits = [&](size_t from) {
    size_t j = from;
    while (j < n && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
    return j;
  };
  const size_t stage_end = digits(0);
  if (stage_end == 0) throw bad("does not start with a stage index");
  i = stage_end;
  size_t code_end = i;
  while (code_end < n &&
         (std::isupper(static_cast<unsigned char>(text[code_end])) || text[code_end] == '_'))
    ++code_end;
  const std::string code = text.substr(i, code_end - i);
  static const std::map<std::string, ActionType> codes = {
      {"F", ActionType::kForward},       {"B", ActionType::kBackward},
      {"I", ActionType::kBackwardInput}, {"W", ActionType::kBackwardWeight},
      {"SEND_F", ActionType::kSendF},    {"RECV_F", ActionType::kRecvF},
      {"SEND_B", ActionType::kSendB},    {"RECV_B", ActionType::kRecvB},
  };
  auto it = codes.find(code);
  if (it == codes.end()) {
    if (code == "UNSHARD" || code == "RESHARD" || code == "REDUCE_GRAD" || code == "OVERLAP_F_B")
      throw bad("is a PyTorch runtime action titan-train does not schedule yet");
    throw bad("has an unknown action type '" + code + "'");
  }
  const size_t mb_end = digits(code_end);
  if (mb_end == code_end) throw bad("has no micro-batch index");
  if (mb_end != n) throw bad("has trailing characters");
  if (stage_end > 9 || mb_end - code_end > 9) throw bad("has an index out of range");
  Action a;
  a.stage = std::stoll(text.substr(0, stage_end));
  a.type = it->second;
  a.microbatch = std::stoll(text.substr(code_end, mb_end - code_end));
  return a;
}

std::ostream& operator<<(std::ostream& os, const Action& a) {
  return os << a.str();
}

bool PipelineSchedule::has_comms() const {
  for (const auto& r : ranks)
    for (const auto& a : r)
      if (!a.is_compute()) return true;
  return false;
}

int64_t ScheduleCosts::of(ActionType type) const {
  switch (type) {
    case ActionType::kForward:
      return forward;
    case ActionType::kBackward:
      return backward;
    case ActionType::kBackwardInput:
      return backward_input;
    case ActionType::kBackwardWeight:
      return backward_weight;
    default:
      return 0;
  }
}

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

// ---- CSV ------------------------------------------------------------------------------------

std::string schedule_to_csv(const PipelineSchedule& schedule) {
  std::string out;
  for (const auto& rank : schedule.ranks) {
    for (size_t i = 0; i < rank.size(); ++i) out += (i ? "," : "") + rank[i].str();
    out += "\n";
  }
  return out;
}

PipelineSchedule schedule_from_csv(const std::string& text, const std::string& source) {
  const std::string who = std::string(kCsvKey) + " = " + source;
  std::vector<std::string> lines;
  {
    std::stringstream ss(text);
    for (std::string line; std::getline(ss, line);) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      lines.push_back(line);
    }
    while (!lines.empty() && lines.back().find_first_not_of(" \t,") == std::string::npos)
      lines.pop_back();
  }
  if (lines.empty()) throw UserError(who + ": the file holds no schedule (one row per rank)");
  PipelineSchedule s;
  s.name = source;
  s.num_ranks = static_cast<int64_t>(lines.size());
  s.ranks.resize(lines.size());
  std::map<int64_t, int64_t> rank_of_stage;
  for (size_t r = 0; r < lines.size(); ++r) {
    std::stringstream row(lines[r]);
    int64_t col = 0;
    for (std::string cell; std::getline(row, cell, ','); ++col) {
      const auto b = cell.find_first_not_of(" \t\"");
      if (b == std::string::npos) continue;  // an idle slot
      cell = cell.substr(b, cell.find_last_not_of(" \t\"") - b + 1);
      const std::string where =
          who + " row " + std::to_string(r + 1) + " column " + std::to_string(col + 1);
      const Action a = parse_action(cell, where);
      auto [it, fresh] = rank_of_stage.emplace(a.stage, static_cast<int64_t>(r));
      if (!fresh && it->second != static_cast<int64_t>(r))
        throw UserError(where + ": stage " + std::to_string(a.stage) + " is on rank " +
                        std::to_string(it->second) + " and on rank " + std::to_string(r) +
                        "; a stage lives on one rank");
      s.num_microbatches = std::max(s.num_microbatches, a.microbatch + 1);
      s.ranks[r].push_back(a);
    }
  }
  if (rank_of_stage.empty()) throw UserError(who + ": the file holds no actions");
  s.num_stages = rank_of_stage.rbegin()->first + 1;
  s.stage_to_rank.assign(s.num_stages, -1);
  for (const auto& [stage, rank] : rank_of_stage) s.stage_to_rank[stage] = rank;
  for (int64_t st = 0; st < s.num_stages; ++st)
    if (s.stage_to_rank[st] < 0)
      throw UserError(who + ": stage " + std::to_string(st) + " has no action on any rank (" +
                      std::to_string(s.num_stages) + " stages from the highest stage index)");
  return s;
}

PipelineSchedule load_schedule_csv(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError(std::string(kCsvKey) + " = " + path + ": cannot read the file");
  std::stringstream ss;
  ss << f.rdbuf();
  return schedule_from_csv(ss.str(), path);
}

void save_schedule_csv(const PipelineSchedule& schedule, const std::string& path) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << schedule_to_csv(schedule);
  if (!f) throw UserError("cannot write the pipeline schedule to " + path);
}

// ---- the check ------------------------------------------------------------------------------

namespace {

// Per (type, stage, micro-batch): a count, or the tick an action completed (-1: not yet).
struct ActionTable {
  int64_t stages = 0, mbs = 0;
  std::vector<int64_t> v;
  ActionTable(int64_t s, int64_t m, int64_t fill) : stages(s), mbs(m), v(kNumTypes * s * m, fill) {}
  int64_t& at(ActionType t, int64_t s, int64_t j) {
    return v[(static_cast<int64_t>(t) * stages + s) * mbs + j];
  }
};

struct Problems {
  std::vector<std::string> list;
  void add(const std::string& p) {
    if (list.size() < 12) list.push_back(p);
    ++count;
  }
  size_t count = 0;
};

std::string mb_str(int64_t s, int64_t j) {
  return "stage " + std::to_string(s) + " micro-batch " + std::to_string(j);
}

// Ranges, stage placement, and the number of times each action appears.
void check_structure(const PipelineSchedule& sc, Problems& pr) {
  const int64_t S = sc.num_stages, m = sc.num_microbatches;
  if (static_cast<int64_t>(sc.ranks.size()) != sc.num_ranks ||
      static_cast<int64_t>(sc.stage_to_rank.size()) != S || S < 1 || m < 1) {
    pr.add("the schedule's sizes disagree (ranks " + std::to_string(sc.ranks.size()) + " of " +
           std::to_string(sc.num_ranks) + ", stages " + std::to_string(S) + ", micro-batches " +
           std::to_string(m) + ")");
    return;
  }
  ActionTable count(S, m, 0);
  for (size_t r = 0; r < sc.ranks.size(); ++r) {
    for (const auto& a : sc.ranks[r]) {
      if (a.stage < 0 || a.stage >= S || a.microbatch < 0 || a.microbatch >= m) {
        pr.add("rank " + std::to_string(r) + ": " + a.str() + " is out of range (" +
               std::to_string(S) + " stages, " + std::to_string(m) + " micro-batches)");
        continue;
      }
      if (sc.stage_to_rank[a.stage] != static_cast<int64_t>(r))
        pr.add("rank " + std::to_string(r) + ": " + a.str() + " belongs to stage " +
               std::to_string(a.stage) + ", which lives on rank " +
               std::to_string(sc.stage_to_rank[a.stage]));
      ++count.at(a.type, a.stage, a.microbatch);
    }
  }
  auto remote = [&](int64_t a, int64_t b) { return sc.stage_to_rank[a] != sc.stage_to_rank[b]; };
  auto expect = [&](ActionType t, int64_t s, int64_t j, int64_t want, const std::string& why) {
    const int64_t got = count.at(t, s, j);
    if (got != want)
      pr.add(mb_str(s, j) + ": " + Action{s, t, j}.str() + " appears " + std::to_string(got) +
             " times on rank " + std::to_string(sc.stage_to_rank[s]) + ", expected " +
             std::to_string(want) + " (" + why + ")");
  };
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t j = 0; j < m; ++j) {
      expect(ActionType::kForward, s, j, 1, "one forward per micro-batch and stage");
      const int64_t full = count.at(ActionType::kBackward, s, j);
      const int64_t in = count.at(ActionType::kBackwardInput, s, j);
      const int64_t w = count.at(ActionType::kBackwardWeight, s, j);
      const bool none = full == 0 && in == 0 && w == 0;
      if (sc.forward_only ? !none
                          : !((full == 1 && in == 0 && w == 0) || (full == 0 && in == 1 && w == 1)))
        pr.add(mb_str(s, j) + ": backward as B " + std::to_string(full) + ", I " +
               std::to_string(in) + ", W " + std::to_string(w) + " times; expected " +
               (sc.forward_only ? "none (a forward-only schedule)" : "one B, or one I and one W"));
      const bool to_next = s + 1 < S && remote(s, s + 1);
      const bool to_prev = s > 0 && remote(s, s - 1);
      const std::string next = "stage " + std::to_string(s + 1) + " is on another rank";
      const std::string prev = "stage " + std::to_string(s - 1) + " is on another rank";
      const std::string local = "no transfer between stages of one rank or past the ends";
      const std::string fwd_only = "a forward-only schedule sends no gradient";
      expect(ActionType::kSendF, s, j, to_next, to_next ? next : local);
      expect(ActionType::kRecvB, s, j, to_next && !sc.forward_only,
             sc.forward_only ? fwd_only
             : to_next       ? next
                             : local);
      expect(ActionType::kRecvF, s, j, to_prev, to_prev ? prev : local);
      expect(ActionType::kSendB, s, j, to_prev && !sc.forward_only,
             sc.forward_only ? fwd_only
             : to_prev       ? prev
                             : local);
    }
  }
}

// What `a` waits for, as (type, stage, micro-batch) triples that must have completed; an
// alternative (the full backward or its input half) is the second triple of a pair.
struct Need {
  Action first;
  bool has_alt = false;
  Action alt;
};

std::vector<Need> needs_of(const Action& a, const PipelineSchedule& sc) {
  const int64_t s = a.stage, j = a.microbatch, last = sc.num_stages - 1;
  auto local = [&](int64_t o) { return sc.stage_to_rank[o] == sc.stage_to_rank[s]; };
  auto one = [&](ActionType t, int64_t st) { return Need{Action{st, t, j}, false, {}}; };
  auto grad = [&](int64_t st) {
    return Need{Action{st, ActionType::kBackward, j}, true,
                Action{st, ActionType::kBackwardInput, j}};
  };
  std::vector<Need> n;
  switch (a.type) {
    case ActionType::kForward:
      if (s > 0)
        n.push_back(local(s - 1) ? one(ActionType::kForward, s - 1) : one(ActionType::kRecvF, s));
      break;
    case ActionType::kBackward:
    case ActionType::kBackwardInput:
      n.push_back(one(ActionType::kForward, s));
      if (s < last) n.push_back(local(s + 1) ? grad(s + 1) : one(ActionType::kRecvB, s));
      break;
    case ActionType::kBackwardWeight:
      n.push_back(one(ActionType::kBackwardInput, s));
      break;
    case ActionType::kSendF:
      n.push_back(one(ActionType::kForward, s));
      break;
    case ActionType::kSendB:
      n.push_back(grad(s));
      break;
    case ActionType::kRecvF:
      n.push_back(one(ActionType::kSendF, s - 1));
      break;
    case ActionType::kRecvB:
      n.push_back(one(ActionType::kSendB, s + 1));
      break;
  }
  return n;
}

}  // namespace

ScheduleTimeline check_schedule(const PipelineSchedule& input, const ScheduleCosts& costs) {
  const PipelineSchedule sc = input.has_comms() ? input : add_transfers(input);
  const std::string who = "pipeline schedule " + sc.name + " (" + std::to_string(sc.num_ranks) +
                          " ranks, " + std::to_string(sc.num_stages) + " stages, " +
                          std::to_string(sc.num_microbatches) + " micro-batches)";
  Problems pr;
  check_structure(sc, pr);
  if (pr.count) {
    std::string msg = who + " is inconsistent (" + std::to_string(pr.count) + " problems):";
    for (const auto& p : pr.list) msg += "\n  " + p;
    if (pr.count > pr.list.size()) msg += "\n  ...";
    throw UserError(msg);
  }

  // Each rank runs its list in order; an action starts once its rank is free and what it
  // needs has completed. Completion ticks are final once known, so the order in which ranks
  // are visited does not change the result.
  ActionTable done(sc.num_stages, sc.num_microbatches, -1);
  ScheduleTimeline tl;
  tl.costs = costs;
  tl.ranks.resize(sc.ranks.size());
  tl.busy.assign(sc.ranks.size(), 0);
  std::vector<size_t> next(sc.ranks.size(), 0);
  std::vector<int64_t> clock(sc.ranks.size(), 0);
  auto completed = [&](const Action& a) { return done.at(a.type, a.stage, a.microbatch); };
  auto need_tick = [&](const Need& n) {
    const int64_t t = completed(n.first);
    return (t < 0 && n.has_alt) ? completed(n.alt) : t;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < sc.ranks.size(); ++r) {
      while (next[r] < sc.ranks[r].size()) {
        const Action& a = sc.ranks[r][next[r]];
        int64_t start = clock[r];
        bool ready = true;
        for (const auto& n : needs_of(a, sc)) {
          const int64_t t = need_tick(n);
          if (t < 0) ready = false;
          start = std::max(start, t);
        }
        if (!ready) break;
        const int64_t end = start + costs.of(a.type);
        done.at(a.type, a.stage, a.microbatch) = end;
        tl.ranks[r].push_back(TimedAction{a, start, end});
        if (a.is_compute()) tl.busy[r] += end - start;
        clock[r] = end;
        ++next[r];
        progress = true;
      }
    }
  }
  for (auto c : clock) tl.makespan = std::max(tl.makespan, c);
  std::string stuck;
  for (size_t r = 0; r < sc.ranks.size(); ++r) {
    if (next[r] == sc.ranks[r].size()) continue;
    const Action& a = sc.ranks[r][next[r]];
    std::string waits;
    for (const auto& n : needs_of(a, sc))
      if (need_tick(n) < 0)
        waits += (waits.empty() ? "" : " and ") + n.first.str() + " (rank " +
                 std::to_string(sc.stage_to_rank[n.first.stage]) + ")";
    stuck += "\n  rank " + std::to_string(r) + " waits at " + a.str() + " (action " +
             std::to_string(next[r] + 1) + " of " + std::to_string(sc.ranks[r].size()) + ") for " +
             waits;
  }
  if (!stuck.empty())
    throw UserError(who + " deadlocks after tick " + std::to_string(tl.makespan) + ":" + stuck +
                    "\nWhat ran:\n" + render_schedule_grid(sc, tl));
  int64_t busy = 0;
  for (auto b : tl.busy) busy += b;
  const double capacity = static_cast<double>(sc.num_ranks) * static_cast<double>(tl.makespan);
  tl.bubble_fraction = capacity > 0 ? 1.0 - static_cast<double>(busy) / capacity : 0.0;
  return tl;
}

std::string render_schedule_grid(const PipelineSchedule& sc, const ScheduleTimeline& tl) {
  size_t width = 1;
  for (const auto& rank : tl.ranks)
    for (const auto& t : rank)
      if (t.action.is_compute()) width = std::max(width, t.action.str().size());
  const int64_t ticks = tl.makespan;
  const std::string label = "rank " + std::to_string(std::max<int64_t>(0, sc.num_ranks - 1));
  std::ostringstream os;
  char bubble[32];
  std::snprintf(bubble, sizeof(bubble), "%.4f", tl.bubble_fraction);
  os << sc.name << ": " << sc.num_ranks << " ranks, " << sc.num_stages << " stages, "
     << sc.num_microbatches << " micro-batches; " << ticks << " ticks, bubble " << bubble
     << " (ticks: F " << tl.costs.forward << ", B " << tl.costs.backward << ", I "
     << tl.costs.backward_input << ", W " << tl.costs.backward_weight
     << "; '-' continues an action, '.' is idle)\n";
  // Tick ruler: every 5th column numbered.
  std::string ruler(label.size() + 2, ' ');
  for (int64_t t = 0; t < ticks; ++t) {
    std::string cell = t % 5 == 0 ? std::to_string(t) : "";
    if (cell.size() > width) cell.clear();
    ruler += cell + std::string(width - cell.size() + 1, ' ');
  }
  while (!ruler.empty() && ruler.back() == ' ') ruler.pop_back();
  os << ruler << "\n";
  for (size_t r = 0; r < tl.ranks.size(); ++r) {
    std::vector<std::string> cells(ticks, ".");
    for (const auto& t : tl.ranks[r]) {
      if (!t.action.is_compute()) continue;
      for (int64_t k = t.start; k < t.end; ++k)
        cells[k] = k == t.start ? t.action.str() : std::string(width, '-');
    }
    std::string row = "rank " + std::to_string(r);
    row += std::string(label.size() - row.size(), ' ') + " |";
    for (const auto& c : cells) row += c + std::string(width - c.size() + 1, ' ');
    while (!row.empty() && row.back() == ' ') row.pop_back();
    os << row << "\n";
  }
  return os.str();
}

}  // namespace titan
