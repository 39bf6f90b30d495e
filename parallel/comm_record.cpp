#include "parallel/comm_record.h"

#include <c10/util/Exception.h>

namespace titan {

void CommRecord::begin() {
  TORCH_CHECK(!open_, "CommRecord::begin: already recording");
  before_ = ProcessGroup::comm_counts();
  open_ = true;
}

void CommRecord::end() {
  TORCH_CHECK(open_, "CommRecord::end without begin");
  open_ = false;
  record_.clear();
  for (const auto& [kind, c] : ProcessGroup::comm_counts()) {
    auto it = before_.find(kind);
    ProcessGroup::CommCount d = c;
    if (it != before_.end()) {
      d.calls -= it->second.calls;
      d.bytes -= it->second.bytes;
    }
    if (d.calls != 0) record_[kind] = d;
  }
  ProcessGroup::add_comm_counts(record_, -1);
}

void CommRecord::replay() const { ProcessGroup::add_comm_counts(record_, 1); }

}  // namespace titan
