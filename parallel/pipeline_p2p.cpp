#include "parallel/pipeline_p2p.h"

#include <string>

namespace titan {

PipelineP2P::PipelineP2P(ProcessGroup& pg, const PipelineSchedule& schedule,
                         std::vector<int64_t> shape, at::ScalarType dtype, at::Device device)
    : pg_(pg),
      stage_to_rank_(schedule.stage_to_rank),
      num_stages_(schedule.num_stages),
      shape_(std::move(shape)),
      dtype_(dtype) {
  TORCH_CHECK(schedule.num_ranks == pg.size(), "PipelineP2P: the schedule has ", schedule.num_ranks,
              " ranks but the pipeline group ", pg.size());
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  for (const Action& a : schedule.ranks[static_cast<size_t>(pg.rank())])
    if (a.type == ActionType::kRecvF || a.type == ActionType::kRecvB)
      buffers_.emplace(key(a), at::empty(shape_, opts));
}

int64_t PipelineP2P::peer_of(const Action& a) const {
  int64_t stage = a.stage;
  switch (a.type) {
    case ActionType::kSendF:
    case ActionType::kRecvB:
      stage = a.stage + 1;  // the next stage: activations go to it, their gradients come back
      break;
    case ActionType::kSendB:
    case ActionType::kRecvF:
      stage = a.stage - 1;
      break;
    default:
      TORCH_CHECK(false, "PipelineP2P: ", a.str(), " is no transfer");
  }
  TORCH_CHECK(stage >= 0 && stage < num_stages_, "PipelineP2P: ", a.str(),
              " has no neighbouring stage");
  return stage_to_rank_[static_cast<size_t>(stage)];
}

int64_t PipelineP2P::tag_of(const Action& a) const {
  // Named by the sender: activations of (stage s, mb) are SEND_F at s and RECV_F at s + 1;
  // gradients of (s, mb) are SEND_B at s and RECV_B at s - 1.
  const bool forward = a.type == ActionType::kSendF || a.type == ActionType::kRecvF;
  const int64_t sender = a.type == ActionType::kRecvF   ? a.stage - 1
                         : a.type == ActionType::kRecvB ? a.stage + 1
                                                        : a.stage;
  return (a.microbatch * num_stages_ + sender) * 2 + (forward ? 0 : 1);
}

const at::Tensor& PipelineP2P::buffer(const Action& recv) const {
  auto it = buffers_.find(key(recv));
  TORCH_CHECK(it != buffers_.end(), "PipelineP2P: rank ", pg_.rank(), " has no receive ",
              recv.str(), " in its schedule");
  return it->second;
}

std::vector<at::Tensor> PipelineP2P::exchange(
    const std::vector<std::pair<Action, at::Tensor>>& sends, const std::vector<Action>& recvs) {
  std::vector<ProcessGroup::P2POp> ops;
  ops.reserve(sends.size() + recvs.size());
  for (const auto& [a, t] : sends) {
    TORCH_CHECK(a.type == ActionType::kSendF || a.type == ActionType::kSendB,
                "PipelineP2P: ", a.str(), " is no send");
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape_) && t.scalar_type() == dtype_,
                "PipelineP2P: ", a.str(), " sends ", t.sizes(), " ", t.scalar_type(),
                "; the pipeline's shape is fixed at ", at::IntArrayRef(shape_), " ", dtype_);
    ops.push_back({true, peer_of(a), t.contiguous(), tag_of(a)});
  }
  std::vector<at::Tensor> out;
  for (const Action& a : recvs) {
    const at::Tensor& b = buffer(a);
    ops.push_back({false, peer_of(a), b, tag_of(a)});
    out.push_back(b);
  }
  std::vector<CommWork> works = pg_.send_recv_start(ops);
  if (works.size() != ops.size()) {  // NCCL: one coalesced group, waited for as a whole
    for (CommWork& w : works) w.wait();
    return out;
  }
  // gloo: a send completes only once its peer receives it, and the schedule's check assumes
  // sends do not wait; the receives are waited for now, the sends at finish_sends.
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].send)
      pending_.emplace_back(std::move(works[i]), ops[i].tensor);
    else
      works[i].wait();
  }
  return out;
}

void PipelineP2P::finish_sends() {
  for (auto& [work, tensor] : pending_) work.wait();
  pending_.clear();
}

std::vector<std::vector<Action>> PipelineP2P::transfer_batches(const std::vector<Action>& actions) {
  std::vector<std::vector<Action>> out;
  bool open = false;
  for (const Action& a : actions) {
    if (a.is_compute()) {
      open = false;
      continue;
    }
    if (!open) out.emplace_back();
    out.back().push_back(a);
    open = true;
  }
  return out;
}

}  // namespace titan
