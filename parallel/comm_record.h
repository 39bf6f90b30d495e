// The collectives a captured CUDA graph holds, counted once per replay (docs/compile.md,
// "Honest metrics under capture").
//
// ProcessGroup::comm_counts counts a collective when the host issues it. A captured step
// issues its collectives once, while the graph is being captured (recorded, not run), and
// every replay then runs them with no host code at all. Left alone, the counts would hold the
// capture's collectives once and no replay's: "collectives per step" would under-count every
// replayed step. CommRecord turns the capture's issues into a record and adds the record to
// the counts on each replay:
//   begin()   before capture: a snapshot of the counts;
//   end()     after capture: the counts issued since begin() become the record and are taken
//             back out of the process's counts (the capture ran none of them);
//   replay()  after each replay (the one right after the capture included): + the record.
// So a run of W eager warm-up steps and R replays counts W eager steps + R x the record,
// which equals W + R eager steps when the captured step issues what an eager step does.
// Only the training thread issues collectives, so nothing else moves the counts between
// begin() and end().
#pragma once

#include <map>
#include <string>

#include "parallel/process_group.h"

namespace titan {

class CommRecord {
 public:
  using Counts = std::map<std::string, ProcessGroup::CommCount>;
  void begin();
  void end();
  void replay() const;
  // The collectives of one replay, by kind (kinds with no call are left out).
  const Counts& record() const { return record_; }
  bool empty() const { return record_.empty(); }

 private:
  Counts before_, record_;
  bool open_ = false;
};

}  // namespace titan
