#include "core/train/float8_linears.h"

#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "core/base/strings.h"
#include "core/train/model.h"
#include "core/train/tensor_parallel.h"

namespace titan {

namespace {

// torchao 0.18's _auto_filter_for_tensorwise / _auto_filter_for_rowwise thresholds (measured
// on H100 by torchao): true when the GEMM is too small for float8 to gain.
bool too_small(float8::Recipe r, int64_t n, int64_t k) {
  if (r == float8::Recipe::Tensorwise) return k <= 4096 && n <= 1024;
  return n <= 2048 || k <= 1024 || (n <= 4096 && k <= 2048);
}

// Marked weights by TensorImpl address. The weak reference keeps the address from being
// reused by another tensor while the entry exists, so a stale entry can never match a new
// tensor; expired entries are pruned as marks are added.
struct Mark {
  explicit Mark(const at::Tensor& w)
      : impl(c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr())) {}
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  std::optional<float8::Options> opts;  // set by mark_float8_weight
  float8::Quantized pre;                // set by attach_float8_weight
  float8::TpSlice tp;                   // set by mark_float8_tp
};

struct Marks {
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, Mark> by_impl;
  size_t adds_since_prune = 0;
  std::atomic<bool> any{false};  // lock-free answer for runs without float8
};

Marks& marks() {
  static Marks m;
  return m;
}

// The live entry of w, made if there is none. Called with m.mu held.
Mark& entry_of(Marks& m, const at::Tensor& w) {
  const c10::TensorImpl* impl = w.unsafeGetTensorImpl();
  auto it = m.by_impl.find(impl);
  if (it != m.by_impl.end() && !it->second.impl.expired()) return it->second;
  m.any = true;
  if (++m.adds_since_prune >= 256) {
    m.adds_since_prune = 0;
    for (auto e = m.by_impl.begin(); e != m.by_impl.end();)
      e = e->second.impl.expired() ? m.by_impl.erase(e) : std::next(e);
  }
  return m.by_impl.insert_or_assign(impl, Mark(w)).first->second;
}

}  // namespace

Float8Plan plan_float8_linears(const ParamStore& params,
                               const std::vector<std::string>& filter_fqns, float8::Recipe recipe) {
  const std::string kAuto = "auto_filter_small_kn";
  const bool auto_filter =
      std::find(filter_fqns.begin(), filter_fqns.end(), kAuto) != filter_fqns.end();
  Float8Plan plan;
  for (int64_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    const std::vector<int64_t> shape = p.model_shape();
    if (p.expert() || shape.size() != 2 || !ends_with(p.name, ".weight")) continue;
    const std::string fqn = p.name.substr(0, p.name.size() - 7);
    if (fqn == "tok_embeddings" || fqn == "output" || ends_with(fqn, "router.gate")) continue;
    const int64_t n = shape[0], k = shape[1];  // (N, K) = (out_features, in_features)
    std::string why;
    for (const std::string& f : filter_fqns)
      if (f != kAuto && fqn.find(f) != std::string::npos) {
        why = "filter_fqns \"" + f + "\"";
        break;
      }
    if (why.empty() && (n % 16 != 0 || k % 16 != 0)) why = "a dim not a multiple of 16";
    if (why.empty() && auto_filter && too_small(recipe, n, k)) why = "auto_filter_small_kn";
    if (why.empty()) {
      plan.converted.push_back(i);
    } else {
      plan.filtered.push_back(fqn);
      plan.filtered_reasons.push_back(why);
    }
  }
  return plan;
}

void keep_tp_replicated_high_precision(const TpPlan& tp_plan, const ParamStore& params,
                                       Float8Plan& plan) {
  const std::vector<int64_t> rep = tp_plan.replicated();
  std::vector<int64_t> kept;
  for (int64_t i : plan.converted) {
    if (std::find(rep.begin(), rep.end(), i) == rep.end()) {
      kept.push_back(i);
      continue;
    }
    const std::string& name = params[i].name;
    plan.filtered.push_back(name.substr(0, name.size() - 7));  // the fqn: without ".weight"
    plan.filtered_reasons.push_back("replicated under tensor parallelism");
  }
  plan.converted = std::move(kept);
}

void mark_float8_weight(const at::Tensor& w, const float8::Options& opts) {
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  Mark& e = entry_of(m, w);
  if (!e.opts) e.opts = opts;
}

void attach_float8_weight(const at::Tensor& w, const float8::Quantized& w8) {
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  entry_of(m, w).pre = w8;
}

void mark_float8_tp(const at::Tensor& w, const float8::TpSlice& tp) {
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  entry_of(m, w).tp = tp;
}

std::optional<Float8Weight> float8_weight_of(const at::Tensor& w) {
  Marks& m = marks();
  if (!m.any) return std::nullopt;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.by_impl.find(w.unsafeGetTensorImpl());
  if (it == m.by_impl.end() || it->second.impl.expired()) return std::nullopt;
  // A stand-in without values must never reach a high-precision GEMM.
  TORCH_CHECK(it->second.opts || !it->second.pre.data.defined(),
              "a weight gathered in float8 reached a linear without its float8 mark");
  if (!it->second.opts) return std::nullopt;
  return Float8Weight{*it->second.opts, it->second.pre, it->second.tp};
}

void copy_float8_mark(const at::Tensor& from, const at::Tensor& to) {
  Marks& m = marks();
  if (!m.any) return;
  std::lock_guard<std::mutex> lock(m.mu);
  auto it = m.by_impl.find(from.unsafeGetTensorImpl());
  if (it == m.by_impl.end() || it->second.impl.expired()) return;
  const std::optional<float8::Options> opts = it->second.opts;  // entry_of may rehash
  const float8::Quantized pre = it->second.pre;
  const float8::TpSlice tp = it->second.tp;
  Mark& e = entry_of(m, to);
  e.opts = opts;
  e.pre = pre;
  e.tp = tp;
}

std::optional<float8::Options> float8_options_of(const at::Tensor& w) {
  std::optional<Float8Weight> f = float8_weight_of(w);
  if (!f) return std::nullopt;
  return f->opts;
}

}  // namespace titan
