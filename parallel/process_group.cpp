#include "parallel/process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define TITAN_PG_CUDA_EVENTS 1
#endif

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/base/errors.h"
#include "core/base/log.h"

#include <ATen/record_function.h>

namespace titan {

// Every collective is a user scope carrying its tensors (and split sizes): a named span in
// profiler traces, and what the CPU capture check compares from step to step (a collective
// that changes size cannot be replayed by a CUDA graph).
#define TITAN_COLLECTIVE_SCOPE(name, ...) \
  RECORD_USER_SCOPE_WITH_INPUTS("titan::collective:" name, std::vector<c10::IValue>({__VA_ARGS__}))


struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;  // null for a one-rank sub-group
  std::chrono::milliseconds init_timeout{0}, train_timeout{0};
  // Every wait is bounded by this (init_timeout until start_training, then train_timeout):
  // some gloo collectives are composites whose inner wait has no timeout of its own.
  std::chrono::milliseconds op_timeout{0};
  bool cuda = false;
  bool loopback = false;  // gloo over 127.0.0.1 (one node)
  int64_t global_rank = 0;
  // The world rank of each rank of this group; empty for the world itself.
  std::vector<int64_t> members;
};

namespace {

[[noreturn]] void die(int64_t rank, const std::string& what, const std::exception& e) {
  std::string msg = e.what();
  if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);  // drop the C++ trace
  std::fprintf(stderr, "titan-train: error: rank %lld: %s failed: %s\n",
               static_cast<long long>(rank), what.c_str(), msg.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(1);
}

// Time compute waited for collectives while counting is on (ProcessGroup::count_comm_waits):
// host microseconds blocked in gloo waits, and on NCCL a pair of CUDA events around each wait
// on the compute stream, whose distance is how long that stream stalled for the collective.
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_wait_us{0};
#ifdef TITAN_PG_CUDA_EVENTS
struct CudaWaits {
  std::vector<std::pair<at::cuda::CUDAEvent, at::cuda::CUDAEvent>> pairs;  // reused
  size_t used = 0;
};
CudaWaits& cuda_waits() {
  static CudaWaits w;  // collectives are issued from the training thread only
  return w;
}
#endif

// ProcessGroup::comm_counts, and the reduce-scatter on gloo that runs as an all-reduce (it
// is counted once, as a reduce-scatter).
std::mutex g_count_mu;
std::map<std::string, ProcessGroup::CommCount> g_counts;
thread_local bool g_in_reduce_scatter = false;

void count_comm(const char* kind, const at::Tensor& t) {
  std::lock_guard<std::mutex> lk(g_count_mu);
  auto& c = g_counts[kind];
  ++c.calls;
  c.bytes += static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
}

// Adds the time of its scope to the wait total (see above), when counting.
class WaitTimer {
 public:
  explicit WaitTimer(bool cuda) : on_(g_counting.load()), cuda_(cuda) {
    if (!on_) return;
#ifdef TITAN_PG_CUDA_EVENTS
    if (cuda_) {
      // Timing events cannot go into a captured graph: a captured step is not measured.
      if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
        on_ = false;
        return;
      }
      auto& w = cuda_waits();
      if (w.used == w.pairs.size())
        w.pairs.emplace_back(at::cuda::CUDAEvent(cudaEventDefault), at::cuda::CUDAEvent(cudaEventDefault));
      w.pairs[w.used].first.record(at::cuda::getCurrentCUDAStream());
      return;
    }
#endif
    t0_ = std::chrono::steady_clock::now();
  }
  ~WaitTimer() {
    if (!on_) return;
#ifdef TITAN_PG_CUDA_EVENTS
    if (cuda_) {
      auto& w = cuda_waits();
      w.pairs[w.used++].second.record(at::cuda::getCurrentCUDAStream());
      return;
    }
#endif
    g_wait_us += std::chrono::duration_cast<std::chrono::microseconds>(
                     std::chrono::steady_clock::now() - t0_)
                     .count();
  }

 private:
  bool on_, cuda_;
  std::chrono::steady_clock::time_point t0_;
};

// Waits for `work`, then, on gloo, until this caller holds the only reference to it, and drops
// it: when this returns, the backend references none of the collective's tensors. gloo
// completes a work (its waiters wake) on a worker thread that still holds the work, and with
// it the tensors (the work's inputs and outputs, its future's value, its profiling inputs),
// until it finishes its bookkeeping and takes the next one; on a busy machine that thread can
// wait for a core that long. A tensor the caller passed in therefore had a use count that
// depended on thread timing, and the autograd engine, which sums two incoming gradients of a
// tensor in place (add_) only when it holds the last reference to the first one (else add),
// ran different ops from step to step: the capture check's "aten::add ... (the reference
// step ran aten::add_)". NCCL's watchdog holds eager works until the device has run them;
// waiting for that would block the host, so NCCL is left as it is (docs/compile.md).
void finish_work(c10::intrusive_ptr<c10d::Work> work, bool cuda, std::chrono::milliseconds timeout,
                 int64_t rank, const char* what) {
  try {
    work->wait(cuda ? std::chrono::milliseconds(0) : timeout);
  } catch (const std::exception& e) {
    die(rank, what, e);
  }
  if (cuda) return;
  // The worker lets go a few microseconds after the wake-up unless it lost its core; the
  // bound only turns a broken assumption (another holder) into an error instead of a hang.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int spin = 0; work.use_count() > 1; ++spin) {
    if (spin < 64) {
      std::this_thread::yield();
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline)
      die(rank, what,
          std::runtime_error("gloo's worker thread still held the finished collective after "
                             "the timeout (" + std::to_string(work.use_count()) + " references)"));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

c10::intrusive_ptr<c10d::Backend> make_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                               int64_t rank, int64_t size, bool cuda, bool loopback,
                                               std::chrono::milliseconds timeout) {
#ifdef USE_C10D_NCCL
  if (cuda) {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank),
                                                       static_cast<int>(size), opts);
  }
#else
  if (cuda) throw UserError("this build has no NCCL backend; CUDA multi-process runs need one");
#endif
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  // Loopback for one node (torchrun --standalone); the host name otherwise, which is what
  // createDefaultDevice resolves (it falls back to loopback when that fails).
  opts->devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                   : c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank),
                                                     static_cast<int>(size), opts);
}

}  // namespace

ProcessGroup::ProcessGroup(const LaunchEnv& env, const CommSection& comm, bool cuda)
    : impl_(std::make_unique<Impl>()), rank_(env.rank), size_(env.world_size) {
  impl_->init_timeout = std::chrono::seconds(comm.init_timeout_seconds);
  impl_->train_timeout = std::chrono::seconds(comm.train_timeout_seconds);
  impl_->op_timeout = impl_->init_timeout;
  if (env.master_port < 1 || env.master_port > 65535)
    throw UserError("MASTER_PORT=" + std::to_string(env.master_port) +
                    " is not a TCP port; allowed: 1..65535");
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  // Under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True) the agent already
  // serves MASTER_ADDR:MASTER_PORT, so every rank is a client.
  so.isServer = env.rank == 0 && !env.agent_store;
  so.numWorkers = static_cast<size_t>(env.world_size);
  so.waitWorkers = false;  // the backend's own rendezvous waits for everyone, with a timeout
  so.timeout = impl_->init_timeout;
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    // A restarted job (torchrun --max-restarts) must not read the keys of the failed attempt.
    impl_->store =
        c10::make_intrusive<c10d::PrefixStore>("titan/" + std::to_string(env.restart_count), tcp);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    throw UserError("rank " + std::to_string(env.rank) +
                    " could not reach the rendezvous store at " + env.master_addr + ":" +
                    std::to_string(env.master_port) + " within " + "comm.init_timeout_seconds = " +
                    std::to_string(comm.init_timeout_seconds) + " (" + msg + ")");
  }
  impl_->cuda = cuda;
  impl_->loopback = env.local_world_size == env.world_size;
  impl_->global_rank = env.rank;
  try {
    impl_->backend =
        make_backend(impl_->store, rank_, size_, cuda, impl_->loopback, impl_->init_timeout);
    backend_name_ = cuda ? "nccl" : "gloo";
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    die(rank_, "creating the " + std::string(cuda ? "NCCL" : "gloo") + " process group", e);
  }
  log_info("=> process group: " + backend_name_ + ", " + std::to_string(size_) +
           " ranks, launched by " + env.source + ", store " + env.master_addr + ":" +
           std::to_string(env.master_port) + (so.isServer ? " (hosted by rank 0)" : "") +
           (env.agent_store ? " (torchrun agent store)" : "") + ", restart " +
           std::to_string(env.restart_count));
}

ProcessGroup::~ProcessGroup() = default;

std::unique_ptr<ProcessGroup> ProcessGroup::subgroup(const std::string& name,
                                                     const std::vector<int64_t>& ranks) {
  std::unique_ptr<ProcessGroup> g(new ProcessGroup());
  g->impl_ = std::make_unique<Impl>(*impl_);
  g->impl_->backend.reset();
  // Ranks of this group, as world ranks (a sub-group of a sub-group names its own ranks).
  std::vector<int64_t> world_ranks;
  for (int64_t r : ranks) {
    TORCH_CHECK(r >= 0 && r < size_, "subgroup ", name, ": rank ", r, " of a group of ", size_);
    world_ranks.push_back(impl_->members.empty() ? r : impl_->members[static_cast<size_t>(r)]);
  }
  const auto me = std::find(world_ranks.begin(), world_ranks.end(), impl_->global_rank);
  TORCH_CHECK(me != world_ranks.end(), "subgroup ", name, " does not include rank ",
              impl_->global_rank);
  g->rank_ = me - world_ranks.begin();
  g->size_ = static_cast<int64_t>(ranks.size());
  g->impl_->members = world_ranks;
  std::string key = name + "[";
  for (size_t i = 0; i < world_ranks.size(); ++i)
    key += (i ? "," : "") + std::to_string(world_ranks[i]);
  key += "]/";
  g->impl_->store = c10::make_intrusive<c10d::PrefixStore>(key, impl_->store);
  g->backend_name_ = backend_name_;
  if (g->size_ > 1) {
    try {
      g->impl_->backend = make_backend(g->impl_->store, g->rank_, g->size_, impl_->cuda,
                                       impl_->loopback, impl_->init_timeout);
    } catch (const std::exception& e) {
      die(impl_->global_rank, "creating the sub-group " + key, e);
    }
  } else {
    g->backend_name_ = "local";
  }
  return g;
}

void ProcessGroup::check_same_config(uint64_t hash) {
  auto& store = *impl_->store;
  std::vector<uint64_t> hashes(static_cast<size_t>(size_));
  try {
    auto key = [](int64_t r) { return "config_hash/" + std::to_string(r); };
    const std::string mine = std::to_string(hash);
    store.set(key(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
    std::vector<std::string> keys;
    for (int64_t r = 0; r < size_; ++r) keys.push_back(key(r));
    store.wait(keys, impl_->init_timeout);
    for (int64_t r = 0; r < size_; ++r) {
      auto v = store.get(keys[static_cast<size_t>(r)]);
      hashes[static_cast<size_t>(r)] = std::stoull(std::string(v.begin(), v.end()));
    }
    // Rank 0 hosts the store: it must not exit (on a mismatch) before everyone has read it.
    store.add("config_hash/read", 1);
    if (rank_ == 0) {
      const auto deadline = std::chrono::steady_clock::now() + impl_->init_timeout;
      while (store.add("config_hash/read", 0) < size_) {
        if (std::chrono::steady_clock::now() > deadline)
          throw std::runtime_error("timed out waiting for every rank to read the config hashes");
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  } catch (const std::exception& e) {
    die(rank_, "exchanging config hashes through the store", e);
  }
  std::vector<int64_t> differ;
  for (int64_t r = 1; r < size_; ++r)
    if (hashes[static_cast<size_t>(r)] != hashes[0]) differ.push_back(r);
  if (differ.empty()) return;
  std::ostringstream os;
  os << "the configuration differs between ranks: rank(s)";
  for (int64_t r : differ) os << " " << r;
  os << " resolved a config whose hash differs from rank 0's (" << std::hex << hashes[0]
     << "); allowed: every rank runs the same config file and flags (compare "
        "--dump-config on each)";
  throw UserError(os.str());
}

void ProcessGroup::start_training() {
  if (impl_->backend) impl_->backend->setTimeout(impl_->train_timeout);
  impl_->op_timeout = impl_->train_timeout;
  impl_->store->setTimeout(impl_->train_timeout);
}

void ProcessGroup::allreduce(at::Tensor& t, ReduceOp op) {
  TITAN_COLLECTIVE_SCOPE("all-reduce", t);
  if (!impl_->backend) return;
  count_comm("all-reduce", t);
  WaitTimer timer(impl_->cuda);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op == ReduceOp::Sum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    work = impl_->backend->allreduce(v, o);
  } catch (const std::exception& e) {
    die(impl_->global_rank, "all-reduce", e);
  }
  finish_work(std::move(work), impl_->cuda, impl_->op_timeout, impl_->global_rank, "all-reduce");
}

void ProcessGroup::broadcast(at::Tensor& t, int64_t root) {
  TITAN_COLLECTIVE_SCOPE("broadcast", t);
  if (!impl_->backend) return;
  count_comm("broadcast", t);
  WaitTimer timer(impl_->cuda);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    work = impl_->backend->broadcast(v, o);
  } catch (const std::exception& e) {
    die(impl_->global_rank, "broadcast", e);
  }
  finish_work(std::move(work), impl_->cuda, impl_->op_timeout, impl_->global_rank, "broadcast");
}

void ProcessGroup::barrier() {
  if (!impl_->backend) return;
  WaitTimer timer(impl_->cuda);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = impl_->backend->barrier();
  } catch (const std::exception& e) {
    die(impl_->global_rank, "barrier", e);
  }
  finish_work(std::move(work), impl_->cuda, impl_->op_timeout, impl_->global_rank, "barrier");
}

bool CommWork::ready() const { return !ready_ || ready_(); }

void CommWork::wait() {
  if (!wait_) return;
  auto w = std::move(wait_);
  wait_ = nullptr;
  ready_ = nullptr;
  WaitTimer timer(cuda_);
  w();
}

void ProcessGroup::count_comm_waits(bool on) { g_counting = on; }

double ProcessGroup::take_comm_wait_ms() {
  double ms = static_cast<double>(g_wait_us.exchange(0)) / 1000.0;
#ifdef TITAN_PG_CUDA_EVENTS
  auto& w = cuda_waits();
  if (w.used > 0) w.pairs[w.used - 1].second.synchronize();
  for (size_t i = 0; i < w.used; ++i) ms += w.pairs[i].first.elapsed_time(w.pairs[i].second);
  w.used = 0;
#endif
  return ms;
}

std::map<std::string, ProcessGroup::CommCount> ProcessGroup::comm_counts() {
  std::lock_guard<std::mutex> lk(g_count_mu);
  return g_counts;
}

void ProcessGroup::add_comm_counts(const std::map<std::string, CommCount>& counts,
                                   int64_t times) {
  std::lock_guard<std::mutex> lk(g_count_mu);
  for (const auto& [kind, c] : counts) {
    auto& g = g_counts[kind];
    g.calls += times * c.calls;
    g.bytes += times * c.bytes;
  }
}

CommWork ProcessGroup::make_work(const c10::intrusive_ptr<c10d::Work>& work,
                                 const std::string& what, std::function<void()> then) {
  const int64_t rank = impl_->global_rank;
  // NCCL: wait() only orders the current stream after the collective (its watchdog
  // enforces the timeout); a bounded wait would block the host. gloo: bounded.
  const auto timeout = impl_->cuda ? std::chrono::milliseconds(0) : impl_->op_timeout;
  CommWork w;
  const bool cuda = impl_->cuda;
  w.cuda_ = cuda;
  // ready_ borrows the work that wait_ owns (CommWork::wait drops both together), so that
  // finish_work sees wait_'s reference as the only one of this process's code.
  c10d::Work* raw = work.get();
  w.ready_ = [raw] { return raw->isCompleted(); };
  // An init-capture: a plain capture of the const reference would be a const member, which
  // std::move would copy, and finish_work would then wait for its own copy to go away.
  w.wait_ = [held = work, rank, timeout, cuda, what, then = std::move(then)]() mutable {
    finish_work(std::move(held), cuda, timeout, rank, what.c_str());
    if (then) then();
  };
  return w;
}

void ProcessGroup::all_gather(at::Tensor& out, const at::Tensor& in) {
  all_gather_start(out, in).wait();
}

CommWork ProcessGroup::all_gather_start(at::Tensor& out, const at::Tensor& in) {
  TITAN_COLLECTIVE_SCOPE("all-gather", out, in);
  TORCH_CHECK(out.numel() == in.numel() * size_ && out.is_contiguous() && in.is_contiguous(),
              "all_gather: out must hold size() x in.numel() contiguous elements");
  if (!impl_->backend) {
    out.view(in.sizes()).copy_(in);
    return {};
  }
  count_comm("all-gather", out);
  try {
    at::Tensor dst = out.view({-1}), src = in.view({-1});
    c10::intrusive_ptr<c10d::Work> work;
    if (impl_->cuda) {
      work = impl_->backend->_allgather_base(dst, src);
    } else {
      // gloo: the native allgather (its own timeout) into views of the output.
      std::vector<std::vector<at::Tensor>> outs(1);
      for (int64_t r = 0; r < size_; ++r)
        outs[0].push_back(dst.narrow(0, r * src.numel(), src.numel()));
      std::vector<at::Tensor> ins{src};
      work = impl_->backend->allgather(outs, ins);
    }
    return make_work(work, "all-gather", nullptr);
  } catch (const std::exception& e) {
    die(impl_->global_rank, "all-gather", e);
  }
}

CommWork ProcessGroup::allreduce_start(at::Tensor& t, ReduceOp op) {
  TITAN_COLLECTIVE_SCOPE("all-reduce", t);
  if (!impl_->backend) return {};
  if (!g_in_reduce_scatter) count_comm("all-reduce", t);
  try {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op == ReduceOp::Sum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    return make_work(impl_->backend->allreduce(v, o), "all-reduce", nullptr);
  } catch (const std::exception& e) {
    die(impl_->global_rank, "all-reduce", e);
  }
}

void ProcessGroup::reduce_scatter(at::Tensor& out, const at::Tensor& in) {
  at::Tensor sum = in.contiguous().clone();
  reduce_scatter_start(out, sum).wait();
}

CommWork ProcessGroup::reduce_scatter_start(at::Tensor& out, at::Tensor& in) {
  TITAN_COLLECTIVE_SCOPE("reduce-scatter", out, in);
  TORCH_CHECK(in.numel() == out.numel() * size_ && out.is_contiguous() && in.is_contiguous(),
              "reduce_scatter: in must hold size() x out.numel() contiguous elements");
  if (!impl_->backend) {
    out.copy_(in.view(out.sizes()));
    return {};
  }
  count_comm("reduce-scatter", in);
  if (!impl_->cuda) {
    // gloo's reduce-scatter is an all-reduce plus a copy whose inner wait ignores timeouts
    // (a hung peer would hang us); the same all-reduce through our bounded path.
    at::Tensor flat = in.view({-1});
    g_in_reduce_scatter = true;
    CommWork w = allreduce_start(flat, ReduceOp::Sum);
    g_in_reduce_scatter = false;
    auto then = [out, flat, r = rank_]() mutable {
      out.view({-1}).copy_(flat.narrow(0, r * out.numel(), out.numel()));
    };
    auto inner = std::move(w.wait_);
    w.wait_ = [inner = std::move(inner), then]() mutable {
      inner();
      then();
    };
    return w;
  }
  try {
    at::Tensor dst = out.view({-1}), src = in.view({-1});
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    return make_work(impl_->backend->_reduce_scatter_base(dst, src, o), "reduce-scatter",
                     nullptr);
  } catch (const std::exception& e) {
    die(impl_->global_rank, "reduce-scatter", e);
  }
}

namespace {
std::atomic<int64_t> g_all_to_alls{0};
}  // namespace

int64_t ProcessGroup::all_to_all_calls() {
  return g_all_to_alls.load();
}

void ProcessGroup::all_to_all(at::Tensor& out, const at::Tensor& in,
                              const std::vector<int64_t>& out_splits,
                              const std::vector<int64_t>& in_splits) {
  all_to_all_start(out, in, out_splits, in_splits).wait();
}

CommWork ProcessGroup::all_to_all_start(at::Tensor& out, const at::Tensor& in,
                                        const std::vector<int64_t>& out_splits,
                                        const std::vector<int64_t>& in_splits) {
  ++g_all_to_alls;
  TITAN_COLLECTIVE_SCOPE("all-to-all", out, in, c10::IValue(out_splits), c10::IValue(in_splits));
  if (!impl_->backend) {
    out.copy_(in);
    return {};
  }
  count_comm("all-to-all", in);
  try {
    at::Tensor src = in;
    std::vector<int64_t> os = out_splits, is = in_splits;
    return make_work(impl_->backend->alltoall_base(out, src, os, is), "all-to-all", nullptr);
  } catch (const std::exception& e) {
    die(impl_->global_rank, "all-to-all", e);
  }
}

void ProcessGroup::send_recv(const std::vector<P2POp>& ops) {
  for (CommWork& w : send_recv_start(ops)) w.wait();
}

std::vector<CommWork> ProcessGroup::send_recv_start(const std::vector<P2POp>& ops) {
  std::vector<CommWork> out;
  if (ops.empty()) return out;
  // The capture check compares these from step to step: a pipeline step must send and receive
  // the same shapes to the same peers every time for its CUDA graphs to replay.
  std::vector<c10::IValue> scope;
  for (const P2POp& op : ops) {
    scope.emplace_back(op.tensor);
    scope.emplace_back(op.send ? op.peer : -1 - op.peer);
    scope.emplace_back(op.tag);
  }
  RECORD_USER_SCOPE_WITH_INPUTS("titan::collective:send-recv", scope);
  TORCH_CHECK(impl_->backend, "send_recv: a one-rank group has no peer to send to");
  for (const P2POp& op : ops) {
    TORCH_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, "send_recv: peer ", op.peer,
                " is not another rank of this group of ", size_);
    TORCH_CHECK(op.tensor.is_contiguous(), "send_recv: tensors must be contiguous");
    count_comm(op.send ? "send" : "recv", op.tensor);
  }
  try {
    const bool group = impl_->cuda;  // gloo has no coalescing, and needs none (see header)
    if (group) impl_->backend->startCoalescing();
    for (const P2POp& op : ops) {
      std::vector<at::Tensor> t{op.tensor};
      const int peer = static_cast<int>(op.peer), tag = static_cast<int>(op.tag);
      auto w = op.send ? impl_->backend->send(t, peer, tag) : impl_->backend->recv(t, peer, tag);
      if (!group) out.push_back(make_work(w, op.send ? "send" : "recv", nullptr));
    }
    if (group) out.push_back(make_work(impl_->backend->endCoalescing(), "send/recv", nullptr));
  } catch (const std::exception& e) {
    die(impl_->global_rank, "send/recv", e);
  }
  return out;
}

void ProcessGroup::store_set(const std::string& key, const std::string& value) {
  try {
    impl_->store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception& e) {
    die(impl_->global_rank, "store set of " + key, e);
  }
}

std::string ProcessGroup::store_get(const std::string& key) {
  try {
    auto v = impl_->store->get(key);
    return std::string(v.begin(), v.end());
  } catch (const std::exception& e) {
    die(impl_->global_rank, "store get of " + key, e);
  }
}

int64_t ProcessGroup::store_add(const std::string& key, int64_t delta) {
  try {
    return impl_->store->add(key, delta);
  } catch (const std::exception& e) {
    die(impl_->global_rank, "store add of " + key, e);
  }
}

}  // namespace titan
