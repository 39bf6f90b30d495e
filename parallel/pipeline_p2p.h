// A pipeline rank's point-to-point transfers (docs/distributed.md, "Pipeline parallel"):
// the SEND and RECV actions of its schedule, batched per tick over c10d (NCCL send/recv on
// GPUs, gloo on CPU), with every tensor's shape fixed at start.
//
// Activations and their gradients between stages are all (micro-batch, seq, dim) in the
// compute dtype, so one shape serves every transfer. A receive buffer is allocated at start
// for each RECV action of this rank (one per stage and micro-batch, as PyTorch's stages do)
// and reused by every step: the addresses never change, which a captured step needs.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "parallel/pipeline_schedule.h"
#include "parallel/process_group.h"

namespace titan {

class PipelineP2P {
 public:
  // `pg` is the pipeline group, whose rank r runs schedule.ranks[r]; `schedule` holds the
  // transfers (add_transfers or a CSV with them); `shape` is the activation's
  // (micro-batch, seq, dim).
  PipelineP2P(ProcessGroup& pg, const PipelineSchedule& schedule, std::vector<int64_t> shape,
              at::ScalarType dtype, at::Device device);
  // Waits for the sends still in flight: a rank must not leave while its peer receives.
  ~PipelineP2P() { finish_sends(); }

  // One tick: posts the sends (SEND_F and SEND_B actions with their tensors, of the fixed
  // shape and dtype) and the receives (RECV_F and RECV_B actions) together, then waits for
  // the receives. Returns the receive buffers in `recvs`' order; each is this rank's buffer for its
  // action, overwritten by that action's receive in the next step.
  // On gloo the sends are not waited for here (a gloo send waits for its receive, which a
  // later tick of the peer may post): finish_sends waits for them, at the end of the step.
  std::vector<at::Tensor> exchange(const std::vector<std::pair<Action, at::Tensor>>& sends,
                                   const std::vector<Action>& recvs);
  void finish_sends();

  // The preallocated buffer of a RECV action of this rank.
  const at::Tensor& buffer(const Action& recv) const;
  // The ticks of a rank's actions: each maximal run of consecutive transfers is one batch,
  // in order (what a runner passes to exchange between two computes).
  static std::vector<std::vector<Action>> transfer_batches(const std::vector<Action>& actions);

  // The rank a transfer action talks to, and the tag that pairs a SEND with its RECV.
  int64_t peer_of(const Action& a) const;
  int64_t tag_of(const Action& a) const;

 private:
  using Key = std::tuple<int64_t, int, int64_t>;  // stage, action type, micro-batch
  static Key key(const Action& a) { return {a.stage, static_cast<int>(a.type), a.microbatch}; }

  ProcessGroup& pg_;
  std::vector<int64_t> stage_to_rank_;
  int64_t num_stages_ = 0;
  std::vector<int64_t> shape_;
  at::ScalarType dtype_;
  std::map<Key, at::Tensor> buffers_;
  std::vector<std::pair<CommWork, at::Tensor>> pending_;  // posted sends, their tensors alive
};

}  // namespace titan
