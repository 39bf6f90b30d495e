// Expert parallelism's token exchange over an ep process group: the implementation of
// core/train/expert_exchange.h that the MoE layers call (docs/distributed.md).
#pragma once

#include <memory>

#include "core/train/expert_exchange.h"
#include "parallel/process_group.h"

namespace titan {

// Rank r of the ep group holds experts [r*E/P, (r+1)*E/P). dispatch() exchanges the per-expert
// counts, reads the split sizes on the host (the one named host sync of expert parallelism,
// once per MoE layer and forward), sends each rank the rows of its experts through a
// differentiable all-to-all and regroups them [source][expert] -> [expert][source]; combine()
// undoes both. Within an expert, rows keep source-rank order and each source's own order.
std::shared_ptr<ExpertExchange> make_expert_exchange(ProcessGroup& ep_group);

}  // namespace titan
