#include "core/data/loader.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "core/base/errors.h"
#include "core/base/timing.h"

namespace titan {

// ---- state ------------------------------------------------------------------------------------

nlohmann::json LoaderState::to_json() const {
  return {{"g", g}, {"drawn", drawn}, {"micro", micro}};
}

LoaderState LoaderState::from_json(const nlohmann::json& j, const std::string& where) {
  auto bad = [&]() {
    return UserError(where + ": data loader state " + j.dump() +
                     " is malformed; allowed: {\"g\": int, \"drawn\": [int, ...], \"micro\": int}");
  };
  if (!j.is_object() || !j.contains("g") || !j.contains("drawn") || !j["g"].is_number_integer() ||
      !j["drawn"].is_array())
    throw bad();
  LoaderState s;
  s.g = j["g"].get<int64_t>();
  int64_t sum = 0;
  for (auto& d : j["drawn"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) throw bad();
    s.drawn.push_back(d.get<int64_t>());
    sum += s.drawn.back();
  }
  if (j.contains("micro")) {
    if (!j["micro"].is_number_integer()) throw bad();
    s.micro = j["micro"].get<int64_t>();
  }
  if (s.g < 0 || sum != s.g || s.micro < 0) throw bad();
  return s;
}

// ---- planning ---------------------------------------------------------------------------------

namespace {

BlendSampler make_sampler(const Blend& blend, const LoaderLayout& lay, uint64_t seed) {
  TORCH_CHECK(lay.seq_len > 0 && lay.local_batch > 0 && lay.dp_size > 0 && lay.grad_accum > 0 &&
                  lay.dp_rank >= 0 && lay.dp_rank < lay.dp_size,
              "loader layout: seq_len ", lay.seq_len, ", batch ", lay.local_batch, ", rank ",
              lay.dp_rank, " of ", lay.dp_size, ", grad_accum ", lay.grad_accum);
  std::vector<int64_t> windows = blend.train_windows(lay.seq_len);
  for (size_t s = 0; s < blend.size(); ++s) {
    if (windows[s] > 0 || blend.weights()[s] == 0) continue;
    throw UserError("data source '" + blend.source(s).spec() + "': its " +
                    std::to_string(blend.train_range(s).size()) +
                    " training tokens hold no window of seq_len + 1 = " +
                    std::to_string(lay.seq_len + 1) +
                    " tokens; allowed: more data or a shorter training.seq_len");
  }
  return BlendSampler(blend.weights(), std::move(windows), seed);
}

}  // namespace

WindowPlanner::WindowPlanner(const Blend& blend, const LoaderLayout& layout, uint64_t seed)
    : blend_(blend), layout_(layout), sampler_(make_sampler(blend, layout, seed)) {}

LoaderState WindowPlanner::initial_state() const {
  LoaderState s;
  s.drawn.assign(blend_.size(), 0);
  return s;
}

std::vector<WindowRef> WindowPlanner::next_step(LoaderState& st) const {
  const LoaderLayout& L = layout_;
  const int64_t G = L.global_batch(), per_micro = L.dp_size * L.local_batch;
  BlendState bs{st.g, st.drawn};
  std::vector<WindowRef> out;
  out.reserve(static_cast<size_t>(L.grad_accum * L.local_batch));
  for (int64_t j = 0; j < G; ++j) {
    const int64_t g = bs.g;
    const Draw d = sampler_.draw(bs);
    const int64_t m = j / per_micro, r = (j / L.local_batch) % L.dp_size, b = j % L.local_batch;
    if (r != L.dp_rank) continue;
    WindowRef w;
    w.micro = m, w.row = b, w.g = g, w.draw = d;
    w.token = blend_.train_range(static_cast<size_t>(d.source)).begin + d.window * (L.seq_len + 1);
    out.push_back(w);
  }
  st.g = bs.g;
  st.drawn = std::move(bs.drawn);
  st.micro = 0;
  return out;
}

void read_windows(const Blend& blend, const std::vector<std::pair<int64_t, int64_t>>& starts,
                  int64_t seq_len, at::Tensor& tokens, at::Tensor& labels) {
  // Ask for every window's pages first, so their I/O overlaps, then copy them.
  for (auto& [s, pos] : starts) blend.source(static_cast<size_t>(s)).will_need(pos, seq_len + 1);
  int64_t* tk = tokens.data_ptr<int64_t>();
  int64_t* lb = labels.data_ptr<int64_t>();
  for (size_t i = 0; i < starts.size(); ++i) {
    const TokenSource& src = blend.source(static_cast<size_t>(starts[i].first));
    int64_t* t = tk + static_cast<int64_t>(i) * seq_len;
    int64_t* l = lb + static_cast<int64_t>(i) * seq_len;
    src.read(starts[i].second, seq_len, t);
    std::memcpy(l, t + 1, static_cast<size_t>(seq_len - 1) * sizeof(int64_t));
    src.read(starts[i].second + seq_len, 1, l + seq_len - 1);
  }
}

// ---- loader -----------------------------------------------------------------------------------

Loader::Loader(const Blend& blend, int64_t seq_len, int64_t local_batch, int64_t dp_rank,
               int64_t dp_size, int64_t grad_accum, uint64_t seed, at::Device device,
               int64_t prefetch_depth)
    : blend_(blend),
      layout_{seq_len, local_batch, dp_rank, dp_size, grad_accum},
      planner_(blend, layout_, seed),
      device_(device),
      depth_(std::max<int64_t>(prefetch_depth, 0)) {
  step_start_ = planner_.initial_state();
  consumed_ = step_start_;
  start();
}

Loader::~Loader() { stop(); }

Loader::Item Loader::produce() {
  const LoaderLayout& L = layout_;
  if (!plan_.empty() && next_micro_ == L.grad_accum) {
    step_start_ = step_end_;
    next_micro_ = 0;
    plan_.clear();
  }
  if (plan_.empty()) {
    step_end_ = step_start_;
    plan_ = planner_.next_step(step_end_);
  }
  std::vector<std::pair<int64_t, int64_t>> starts;
  for (int64_t b = 0; b < L.local_batch; ++b) {
    const WindowRef& w = plan_[static_cast<size_t>(next_micro_ * L.local_batch + b)];
    starts.emplace_back(w.draw.source, w.token);
  }
  auto opts = at::TensorOptions().dtype(at::kLong).pinned_memory(device_.is_cuda());
  Item it;
  it.tokens = at::empty({L.local_batch, L.seq_len}, opts);
  it.labels = at::empty({L.local_batch, L.seq_len}, opts);
  read_windows(blend_, starts, L.seq_len, it.tokens, it.labels);
  ++next_micro_;
  if (next_micro_ == L.grad_accum) {
    it.after = step_end_;
  } else {
    it.after = step_start_;
    it.after.micro = next_micro_;
  }
  return it;
}

void Loader::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || static_cast<int64_t>(queue_.size()) < depth_; });
      if (stopping_) return;
    }
    Item it;
    try {
      it = produce();
    } catch (...) {
      it.error = std::current_exception();
    }
    const bool failed = static_cast<bool>(it.error);
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(std::move(it));
    }
    cv_.notify_all();
    if (failed) return;  // the consumer rethrows when it reaches this batch
  }
}

void Loader::start() {
  stopping_ = false;
  if (depth_ > 0) thread_ = std::thread([this] { run(); });
}

void Loader::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  queue_.clear();
}

void Loader::load_state(const LoaderState& st) {
  if (st.drawn.size() != blend_.size())
    throw UserError("data loader state has " + std::to_string(st.drawn.size()) +
                    " source counts but the data has " + std::to_string(blend_.size()) +
                    " sources; allowed: resume with the same training.dataset_path sources");
  if (st.micro >= layout_.grad_accum)
    throw UserError("data loader state is at micro-batch " + std::to_string(st.micro) +
                    " of a step, but a step has " + std::to_string(layout_.grad_accum));
  stop();
  step_start_ = st;
  step_start_.micro = 0;
  plan_.clear();
  next_micro_ = st.micro;
  consumed_ = st;
  start();
}

MicroBatch Loader::next() {
  const auto t0 = std::chrono::steady_clock::now();
  Item it;
  if (depth_ == 0) {
    it = produce();
  } else {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return !queue_.empty(); });
    it = std::move(queue_.front());
    queue_.pop_front();
    lk.unlock();
    cv_.notify_all();
    if (it.error) {
      lk.lock();
      queue_.push_front(it);  // the producer has stopped; every later call fails the same way
      std::rethrow_exception(it.error);
    }
  }
  consumed_ = std::move(it.after);
  MicroBatch mb;
  if (device_.is_cpu()) {
    mb = {std::move(it.tokens), std::move(it.labels)};
  } else {
    // Pinned source: the copies are asynchronous on the current stream, and the caching host
    // allocator keeps the pinned block alive until they complete.
    mb = {it.tokens.to(device_, /*non_blocking=*/true), it.labels.to(device_, true)};
  }
  wait_ms_ += ms_since(t0);
  return mb;
}

double Loader::wait_ms() {
  const double v = wait_ms_;
  wait_ms_ = 0;
  return v;
}

// ---- validation -------------------------------------------------------------------------------

ValidationReader::ValidationReader(const Blend& blend, bool holdout, int64_t seq_len,
                                   int64_t local_batch, int64_t dp_rank, int64_t dp_size,
                                   at::Device device)
    : blend_(blend),
      holdout_(holdout),
      seq_len_(seq_len),
      batch_(local_batch),
      rank_(dp_rank),
      dp_(dp_size),
      device_(device) {
  TORCH_CHECK(seq_len > 0 && local_batch > 0 && dp_size > 0 && dp_rank >= 0 && dp_rank < dp_size,
              "ValidationReader: layout");
  for (size_t s = 0; s < blend.size(); ++s) {
    const TokenRange r = holdout ? blend.holdout_range(s) : blend.train_range(s);
    windows_.push_back(r.size() / (seq_len + 1));
    total_ += windows_.back();
  }
  for (int64_t w : windows_)
    weights_.push_back(total_ > 0 ? static_cast<double>(w) / static_cast<double>(total_) : 0.0);
  if (batches() == 0)
    throw UserError(std::string("validation data (") +
                    (holdout ? "the held-out part of training.dataset_path" : "validation.dataset_path") +
                    ") holds " + std::to_string(total_) + " windows of seq_len + 1 = " +
                    std::to_string(seq_len + 1) + " tokens, fewer than validation.local_batch_size (" +
                    std::to_string(local_batch) + ") x data-parallel ranks (" +
                    std::to_string(dp_size) + "); allowed: " +
                    (holdout ? "a larger training.holdout_fraction"
                             : "more documents in validation.dataset_path") +
                    ", a smaller validation.local_batch_size or a shorter validation.seq_len");
  reset();
}

int64_t ValidationReader::batches() const { return total_ / dp_ / batch_; }

void ValidationReader::reset() {
  st_.g = 0;
  st_.drawn.assign(windows_.size(), 0);
  served_ = 0;
}

MicroBatch ValidationReader::next() {
  if (served_ == batches()) reset();
  std::vector<std::pair<int64_t, int64_t>> starts;
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t v = (served_ * batch_ + b) * dp_ + rank_;  // this row's validation window
    for (;;) {
      // Greedy rule over the sources that still have windows (weights ~ windows).
      const double next = static_cast<double>(st_.g + 1);
      int64_t s = -1;
      double best = -INFINITY;
      for (size_t i = 0; i < windows_.size(); ++i) {
        if (st_.drawn[i] >= windows_[i]) continue;
        const double err = weights_[i] * next - static_cast<double>(st_.drawn[i]);
        if (err > best) s = static_cast<int64_t>(i), best = err;
      }
      TORCH_CHECK(s >= 0, "ValidationReader: ran past the last window");
      const int64_t k = st_.drawn[static_cast<size_t>(s)]++;
      if (st_.g++ != v) continue;
      const TokenRange r = holdout_ ? blend_.holdout_range(static_cast<size_t>(s))
                                    : blend_.train_range(static_cast<size_t>(s));
      starts.emplace_back(s, r.begin + k * (seq_len_ + 1));
      break;
    }
  }
  ++served_;
  auto opts = at::TensorOptions().dtype(at::kLong).pinned_memory(device_.is_cuda());
  at::Tensor tokens = at::empty({batch_, seq_len_}, opts), labels = at::empty({batch_, seq_len_}, opts);
  read_windows(blend_, starts, seq_len_, tokens, labels);
  if (device_.is_cpu()) return {tokens, labels};
  return {tokens.to(device_, true), labels.to(device_, true)};
}

// ---- preview ----------------------------------------------------------------------------------

std::vector<WindowPreview> preview_windows(const Blend& blend, const LoaderLayout& layout,
                                           uint64_t seed, int64_t steps, int64_t ntokens) {
  WindowPlanner planner(blend, layout, seed);
  LoaderState st = planner.initial_state();
  std::vector<WindowPreview> out;
  const int64_t n = std::min(ntokens, layout.seq_len + 1);
  for (int64_t step = 1; step <= steps; ++step) {
    for (const WindowRef& w : planner.next_step(st)) {
      const TokenSource& src = blend.source(static_cast<size_t>(w.draw.source));
      const TokenSource::Location loc = src.locate(w.token);
      WindowPreview p;
      p.step = step;
      p.rank = layout.dp_rank;
      p.micro = w.micro;
      p.row = w.row;
      p.source = w.draw.source;
      p.path = src.shard(loc.shard).path;
      p.offset = loc.offset;
      p.tokens.resize(static_cast<size_t>(n));
      src.read(w.token, n, p.tokens.data());
      out.push_back(std::move(p));
    }
  }
  return out;
}

}  // namespace titan
