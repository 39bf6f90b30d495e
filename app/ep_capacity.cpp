#include "app/ep_capacity.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "app/train_step.h"
#include "core/base/log.h"
#include "core/train/capture_check.h"

namespace titan {
namespace {

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed << static_cast<double>(bytes) / 1048576.0 << " MiB";
  return os.str();
}

// The gradients' storage: the re-run must accumulate into the same buffers, which the
// captured optimizer graph reads.
std::vector<const void*> grad_storage(Model& model) {
  std::vector<const void*> v;
  for (auto& p : model.params().tensors())
    v.push_back(p.grad().defined() ? p.grad().data_ptr() : nullptr);
  return v;
}

}  // namespace

EpCapacityControl::EpCapacityControl(std::shared_ptr<ExpertExchange> ex, const EpCapacityPolicy& p)
    : ex_(std::move(ex)), p_(p) {
  // The worst case cannot overflow: nothing to check.
  if (!std::isfinite(ex_->capacity_factor())) p_.rerun = false;
}

void EpCapacityControl::reduce_overflow() {
  // The same tensor every step (the exchange's), which a captured graph rewrites on every
  // replay: settle() reads it whether the reduction ran eagerly or in a replay.
  flag_ = p_.rerun && !exact_only_ ? ex_->reduce_overflow() : at::Tensor();
  if (flag_.defined() && p_.agree) p_.agree(flag_);  // in place: the same tensor every step
}

at::Tensor EpCapacityControl::settle(StepPhases& phases, const std::vector<MicroBatch>& micro,
                                     const at::Tensor& loss) {
  Model& model = phases.model();
  ++steps_;
  peak_rows_ = std::max(peak_rows_, ex_->take_exact_peak_rows());
  if (!flag_.defined()) return loss;
  // The step's one small host read, after the captured forward+backward.
  at::Tensor host;
  {
    TITAN_HOST_READ_SCOPE();  // named in profiler traces
    host = flag_.to(at::kCPU);
  }
  const int64_t over = host[0].item<int64_t>();
  peak_rows_ = std::max(peak_rows_, host[1].item<int64_t>());
  if (over == 0) return loss;
  ++overflows_;
  ++overflows_total_;
  // Every ep rank read the same agreed flag, so every rank re-runs (the exact exchange's
  // collectives pair up). What the discarded pass accumulated goes: the gradients (zeroed in
  // place: the optimizer graph reads these buffers), the MoE token counts (counted again by
  // the re-run's forwards, on its own routing) and values kept for recompute.
  const auto before = grad_storage(model);
  phases.opt().zero_grad();
  model.discard_step_state();
  ex_->force_exact(true);
  at::Tensor l = phases.forward_backward(micro);
  phases.reduce_gradients();
  ex_->force_exact(false);
  peak_rows_ = std::max(peak_rows_, ex_->take_exact_peak_rows());
  const auto after = grad_storage(model);
  for (size_t i = 0; i < before.size(); ++i)  // a gradient the first pass had stays where it was
    TORCH_CHECK(before[i] == nullptr || after[i] == before[i],
                "the re-run of an overflowed step moved a gradient to new storage");
  ++reruns_;
  recent_.push_back(steps_);
  while (!recent_.empty() && recent_.front() <= steps_ - p_.window) recent_.pop_front();
  if (static_cast<int64_t>(recent_.size()) >= p_.grow_after) grow();
  return l;
}

void EpCapacityControl::grow() {
  recent_.clear();
  const double f = ex_->capacity_factor();
  const int64_t rows = ex_->capacity_rows();
  std::ostringstream os;
  os << "moe: the static expert-parallel exchange overflowed " << p_.grow_after << " times in "
     << p_.window << " steps at capacity factor " << f << " (" << rows << " rows per pair, "
     << mib(ex_->buffer_bytes()) << " per MoE layer and forward); ";
  if (f >= p_.max_factor) {
    exact_only_ = true;
    ex_->force_exact(true);
    os << "that is the cap (moe.ep_capacity_factor_max = " << p_.max_factor
       << "): the run continues eagerly with the exact exchange, without capture";
    if (log_rank() == 0) log_warn(os.str());  // once for the run, not once per rank
    return;
  }
  const double g = std::min(f * p_.growth, p_.max_factor);
  ex_->set_capacity_factor(g);
  os << "capacity factor -> " << g << " (" << ex_->capacity_rows() << " rows per pair, "
     << mib(ex_->buffer_bytes()) << "); a captured step is captured again";
  log_info(os.str());
}

std::string EpCapacityControl::capture_key() const {
  std::ostringstream os;
  os << "ep capacity " << ex_->capacity_factor() << (exact_only_ ? " exact" : "");
  return os.str();
}

std::map<std::string, double> EpCapacityControl::take_metrics() {
  std::map<std::string, double> m;
  if (ex_->is_static() || exact_only_) {  // the exact exchange has no capacity to report
    m["moe_ep_overflows"] = static_cast<double>(overflows_);
    m["moe_ep_reruns"] = static_cast<double>(reruns_);
    const double f = ex_->capacity_factor();
    m["moe_ep_capacity_factor"] = std::isfinite(f) ? f : -1;  // -1: the worst case
    m["moe_ep_capacity_rows"] = static_cast<double>(ex_->capacity_rows());
    m["moe_ep_buffer_bytes"] = static_cast<double>(ex_->buffer_bytes());
    m["moe_ep_exact_only"] = exact_only_ ? 1 : 0;
  }
  // Where no overflow is checked (the worst-case capacity, a drop policy) no flag is read in
  // settle(): the static exchange's own peak, read here.
  peak_rows_ = std::max(peak_rows_, ex_->take_static_peak_rows());
  const int64_t n = ex_->routed_rows();
  m["moe_ep_peak_pair_load"] = n > 0 ? static_cast<double>(peak_rows_) *
                                           static_cast<double>(ex_->size()) / static_cast<double>(n)
                                     : 0;
  overflows_ = reruns_ = peak_rows_ = 0;
  return m;
}

}  // namespace titan
