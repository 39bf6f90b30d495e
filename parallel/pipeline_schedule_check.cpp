// The schedule check: structure, the simulated timeline (deadlocks, the bubble) and the grid
// a person reads.
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
