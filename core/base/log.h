// Rank-aware logging: info lines come from rank 0 only, warnings and errors from every rank.
#pragma once

#include <string>

namespace titan {

void log_set_rank(int64_t rank);
int64_t log_rank();
void log_info(const std::string& msg);  // rank 0 only, to stdout
void log_warn(const std::string& msg);  // every rank, to stderr
bool log_is_tty();

// While alive, log_info prints nothing (warnings still do): for commands whose stdout is a
// report, not a run (--dump-schedule), where a builder's start-up lines would be stray.
class QuietInfoScope {
 public:
  QuietInfoScope();
  ~QuietInfoScope();
  QuietInfoScope(const QuietInfoScope&) = delete;
  QuietInfoScope& operator=(const QuietInfoScope&) = delete;

 private:
  bool was_;
};

}  // namespace titan
