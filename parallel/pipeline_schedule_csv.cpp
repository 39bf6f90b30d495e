// The CSV form of a schedule (torch.distributed.pipelining's _dump_csv / _load_csv layout).
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

}  // namespace titan
