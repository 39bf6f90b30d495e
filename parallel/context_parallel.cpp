#include "parallel/context_parallel.h"

#include "core/base/errors.h"
#include "parallel/tensor_parallel.h"

namespace titan {

CpBalancer cp_balancer(const std::string& name) {
  return name == "headtail" ? CpBalancer::HeadTail : CpBalancer::None;
}

std::string apply_context_parallel(Model& model, ProcessGroup& cp_group, const JobConfig& cfg) {
  const auto& p = cfg.parallelism;
  const std::string who =
      "parallelism.context_parallel_degree = " + std::to_string(p.context_parallel_degree);
  // The sequence-wise balance loss averages over whole sequences; a cp rank sees a slice.
  if (cfg.moe.seq_aux_loss_coeff > 0 && model.num_experts() > 0)
    throw UserError(who +
                    " with moe.seq_aux_loss_coeff > 0: the sequence-wise balance loss "
                    "needs whole sequences, and a context-parallel rank holds a slice; "
                    "allowed: seq_aux_loss_coeff = 0 under context parallelism");
  const CpBalancer b = cp_balancer(p.context_parallel_load_balancer);
  // The all-gather along the sequence with its reduce-scatter backward is the one tensor
  // parallelism uses, here over the cp group.
  model.set_context_parallel(std::make_shared<ContextParallel>(make_tp_comm(cp_group), b));
  const int64_t T = cfg.training.seq_len, cp = p.context_parallel_degree;
  return "=> context parallel: cp " + std::to_string(cp) + ", " +
         (b == CpBalancer::HeadTail
              ? "head-tail balanced (chunks r and " + std::to_string(2 * cp - 1) + " - r of " +
                    std::to_string(2 * cp) + ")"
              : std::string("contiguous chunks (no load balancer)")) +
         ", " + std::to_string(T / cp) + " of " + std::to_string(T) +
         " tokens per sequence on each rank; keys and values all-gathered over the cp group";
}

}  // namespace titan
