// Pipeline schedules as data: the schedule names, the action vocabulary and its text form,
// the compute costs. The generators, the CSV form and the check live beside it
// (pipeline_schedule_generators.cpp, _csv.cpp, _check.cpp).
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

namespace {

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

}  // namespace titan
