#include "parallel/pipeline_runner.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

#include "parallel/overlap_pair.h"

namespace titan {

PipelineRunner::PipelineRunner(Model& model, ProcessGroup& pp, PipelineStagePlan plan,
                               const PipelineSchedule& schedule, std::vector<int64_t> activation,
                               at::ScalarType dtype, at::Device device)
    : model_(model),
      plan_(std::move(plan)),
      schedule_(schedule.has_comms() ? schedule : add_transfers(schedule)),
      rank_(pp.rank()) {
  TORCH_CHECK(schedule_.num_ranks == pp.size() && plan_.pp_degree == pp.size(),
              "PipelineRunner: a schedule of ", schedule_.num_ranks, " ranks and a plan of ",
              plan_.pp_degree, " for a pipeline group of ", pp.size());
  TORCH_CHECK(schedule_.num_stages == plan_.num_stages(), "PipelineRunner: the schedule has ",
              schedule_.num_stages, " stages, the plan ", plan_.num_stages());
  TORCH_CHECK(schedule_.stage_to_rank == plan_.stage_to_rank(),
              "PipelineRunner: the schedule places the stages on other ranks than the plan");
  check_schedule(schedule_);  // a UserError naming the fault (deadlock, missing action)
  stages_ = plan_.stages_of_rank(rank_);
  for (const Action& a : schedule_.ranks[static_cast<size_t>(rank_)])
    split_ = split_ || a.type == ActionType::kBackwardWeight;
  for (int64_t s : stages_) {
    const PipelineStageSpec& spec = plan_.stages[static_cast<size_t>(s)];
    TORCH_CHECK(spec.end_layer <= model.num_blocks(), "PipelineRunner: stage ", s,
                " ends at layer ", spec.end_layer, " of a model of ", model.num_blocks());
  }
  if (pp.size() > 1)
    p2p_ = std::make_unique<PipelineP2P>(pp, schedule_, std::move(activation), dtype, device);
}

std::vector<int64_t> PipelineRunner::stage_params() const {
  const std::vector<ParamUnit> units = model_.param_units();
  std::vector<int64_t> out;
  for (int64_t s : stages_) {
    const PipelineStageSpec& spec = plan_.stages[static_cast<size_t>(s)];
    for (int64_t u = spec.first_unit(); u < spec.end_unit(); ++u)
      for (int64_t i : units[static_cast<size_t>(u)].params) out.push_back(i);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void PipelineRunner::reset() {
  input_.clear();
  output_.clear();
  objective_.clear();
  grad_out_.clear();
  deferred_.clear();
  loss_ = at::Tensor();
}

at::Tensor PipelineRunner::run(const std::vector<MicroBatch>& micro, double global_tokens,
                               double aux_div) {
  RECORD_USER_SCOPE("titan::pipeline_schedule");
  TORCH_CHECK(static_cast<int64_t>(micro.size()) == schedule_.num_microbatches,
              "PipelineRunner: ", micro.size(), " micro-batches for a schedule of ",
              schedule_.num_microbatches);
  reset();
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  Clock::duration computing{0};
  overlapped_pairs_ = overlap_turns_ = 0;
  std::vector<Action> batch;  // consecutive transfers: one tick
  const std::vector<Action>& acts = schedule_.ranks[static_cast<size_t>(rank_)];
  for (size_t i = 0; i < acts.size(); ++i) {
    const Action& a = acts[i];
    if (!a.is_compute()) {
      batch.push_back(a);
      continue;
    }
    transfer(batch);
    batch.clear();
    const auto c0 = Clock::now();
    // Lowering put a paired forward's backward right after it (pipeline_schedule.h).
    if (overlap_pairs_ && a.paired && i + 1 < acts.size() &&
        acts[i + 1].type == ActionType::kBackward) {
      const Action& b = acts[++i];
      overlap_turns_ += run_overlapped_pair([&] { forward(a, micro, global_tokens, aux_div); },
                                            [&] { backward(b); });
      ++overlapped_pairs_;
    } else if (a.type == ActionType::kForward) {
      forward(a, micro, global_tokens, aux_div);
    } else if (a.type == ActionType::kBackwardWeight) {
      backward_weight(a);
    } else {
      backward(a);
    }
    computing += Clock::now() - c0;
  }
  transfer(batch);
  TORCH_CHECK(deferred_.empty(), "PipelineRunner: an I action without its W (",
              deferred_.begin()->first.first, ", ", deferred_.begin()->first.second, ")");
  if (p2p_) p2p_->finish_sends();
  compute_ms_ = std::chrono::duration<double, std::milli>(computing).count();
  total_ms_ = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  at::Tensor loss =
      loss_.defined() ? loss_ : at::zeros({}, micro.front().tokens.options().dtype(at::kFloat));
  reset();
  return loss;
}

void PipelineRunner::forward(const Action& a, const std::vector<MicroBatch>& micro,
                             double global_tokens, double aux_div) {
  const PipelineStageSpec& spec = plan_.stages[static_cast<size_t>(a.stage)];
  const MicroBatch& mb = micro[static_cast<size_t>(a.microbatch)];
  const Key key{a.stage, a.microbatch};
  at::Tensor in;
  if (spec.has_embeddings) {
    in = mb.tokens;
  } else {
    // From the previous stage: on this rank (the V's turn) or received.
    auto local = output_.find({a.stage - 1, a.microbatch});
    const at::Tensor& src = local != output_.end()
                                ? local->second
                                : p2p_->buffer({a.stage, ActionType::kRecvF, a.microbatch});
    in = src.detach().requires_grad_(true);
    input_[key] = in;
  }
  at::Tensor h;
  {
    SplitBackwardForward split(split_);  // linear layers whose grad_w can wait for a W
    h = model_.forward_stage(in, spec.has_embeddings, spec.first_layer, spec.end_layer, mb.tokens);
  }
  at::Tensor aux = model_.aux_loss();  // this forward's MoE layers only
  at::Tensor aux_term = aux.defined() ? aux / aux_div : at::Tensor();
  if (spec.has_head) {
    at::Tensor loss = model_.head_loss_sum(h, mb.labels, mb.tokens) / global_tokens;
    objective_[key] = aux_term.defined() ? loss + aux_term : loss;
    loss_ = loss_.defined() ? loss_ + loss.detach() : loss.detach();
  } else {
    output_[key] = h;
    if (aux_term.defined()) objective_[key] = aux_term;
  }
}

void PipelineRunner::backward(const Action& a) {
  const PipelineStageSpec& spec = plan_.stages[static_cast<size_t>(a.stage)];
  const Key key{a.stage, a.microbatch};
  std::vector<at::Tensor> roots, grads;
  if (!spec.has_head) {
    at::Tensor g;
    if (auto it = grad_out_.find(key); it != grad_out_.end()) {
      g = it->second;
    } else {  // the next stage is on this rank (the V's turn): its input's gradient
      auto next = input_.find({a.stage + 1, a.microbatch});
      TORCH_CHECK(next != input_.end() && next->second.grad().defined(),
                  "PipelineRunner: no output gradient for ", a.str());
      g = next->second.grad();
    }
    roots.push_back(output_.at(key));
    grads.push_back(g);
  }
  if (auto it = objective_.find(key); it != objective_.end()) {
    roots.push_back(it->second);
    grads.push_back(at::ones_like(it->second));
  }
  {
    // I: the linear layers' grad_w GEMMs go to the store; W runs them.
    std::optional<DeferWeightGrads> defer;
    if (a.type == ActionType::kBackwardInput) defer.emplace(&deferred_[key]);
    torch::autograd::backward(roots, grads);
  }
  output_.erase(key);
  objective_.erase(key);
  grad_out_.erase(key);
}

void PipelineRunner::backward_weight(const Action& a) {
  auto it = deferred_.find({a.stage, a.microbatch});
  TORCH_CHECK(it != deferred_.end(), "PipelineRunner: ", a.str(), " before its I");
  it->second.flush();
  deferred_.erase(it);
}

void PipelineRunner::transfer(const std::vector<Action>& batch) {
  if (batch.empty()) return;
  std::vector<std::pair<Action, at::Tensor>> sends;
  std::vector<Action> recvs;
  for (const Action& a : batch) {
    const Key key{a.stage, a.microbatch};
    if (a.type == ActionType::kSendF) {
      sends.emplace_back(a, output_.at(key).detach());
    } else if (a.type == ActionType::kSendB) {
      const at::Tensor& in = input_.at(key);
      TORCH_CHECK(in.grad().defined(), "PipelineRunner: ", a.str(), " before its backward");
      sends.emplace_back(a, in.grad());
    } else {
      recvs.push_back(a);
    }
  }
  std::vector<at::Tensor> got = p2p_->exchange(sends, recvs);
  for (size_t i = 0; i < recvs.size(); ++i)
    if (recvs[i].type == ActionType::kRecvB)
      grad_out_[{recvs[i].stage, recvs[i].microbatch}] = got[i];
  // A stage's input gradient is sent once: drop the leaf (and its gradient) now.
  for (const Action& a : batch)
    if (a.type == ActionType::kSendB) input_.erase({a.stage, a.microbatch});
}

}  // namespace titan
