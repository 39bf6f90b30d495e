// The data-parallel communicator: a rendezvous store and a collective backend built from the
// launch environment (docs/distributed.md).
//
// CPU runs use c10d::ProcessGroupGloo from the wheel's libtorch_cpu; CUDA runs use
// c10d::ProcessGroupNCCL. The c10d types stay out of this header so only
// parallel/process_group.cpp needs the gloo and NCCL headers.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "parallel/launch_env.h"

namespace c10d {
class Work;
}

namespace titan {

enum class ReduceOp { Sum, Max };

// A started collective. wait() blocks until it is done (bounded by the group's timeout; a
// failure ends the process like a blocking collective) and then runs its completion, once.
// ready() says, without blocking, whether wait() would return at once. On NCCL the
// collective runs on NCCL's stream and wait() only orders the current stream after it.
// Move-only: on gloo, wait() returns once the backend has released the collective, which it
// recognises by holding the last reference to it (a copy would hold another).
class CommWork {
 public:
  CommWork() = default;
  CommWork(CommWork&&) = default;
  CommWork& operator=(CommWork&&) = default;
  CommWork(const CommWork&) = delete;
  CommWork& operator=(const CommWork&) = delete;
  bool pending() const { return static_cast<bool>(wait_); }
  bool ready() const;
  void wait();

 private:
  friend class ProcessGroup;
  std::function<bool()> ready_;
  std::function<void()> wait_;
  bool cuda_ = false;  // NCCL: its wait is timed with CUDA events
};

class ProcessGroup {
 public:
  // Connects to the TCPStore (rank 0 hosts it unless torchrun's agent does) under a prefix
  // keyed by the restart count, then creates the backend: NCCL when `cuda`, else gloo. Setup
  // waits at most comm.init_timeout_seconds; collectives afterwards wait at most
  // comm.train_timeout_seconds (see start_training()).
  ProcessGroup(const LaunchEnv& env, const CommSection& comm, bool cuda);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  const std::string& backend_name() const { return backend_name_; }

  // Every rank publishes config_hash(cfg); throws UserError on every rank, naming the ranks
  // whose hash differs from rank 0's, when they do not all agree.
  void check_same_config(uint64_t hash);
  // Switches collectives from the init timeout to comm.train_timeout_seconds.
  void start_training();

  // The sub-group of `ranks` (ranks of this group, ascending), which must include this rank. Every
  // member calls it with the same name and ranks; the name keys the sub-group's rendezvous in the
  // store. A one-rank sub-group runs its collectives locally.
  std::unique_ptr<ProcessGroup> subgroup(const std::string& name,
                                         const std::vector<int64_t>& ranks);

  // Collectives, each waited for before returning. A failure or a timeout (a peer died or
  // hangs) ends this process with status 1 at once: unwinding would wait on the backend's
  // threads, which wait on the dead peer. On gloo, when a collective (or CommWork::wait)
  // returns, the backend holds no reference to its tensors: the autograd engine sums two
  // gradients of one tensor in place only when it holds the last reference, so a reference
  // that gloo's worker thread dropped a moment later made the step's ops depend on thread
  // timing (docs/compile.md, "A timing-dependent step").
  void allreduce(at::Tensor& t, ReduceOp op = ReduceOp::Sum);
  void broadcast(at::Tensor& t, int64_t root = 0);
  void barrier();
  // out (size() * in.numel(), contiguous) = the concatenation of every rank's `in`.
  void all_gather(at::Tensor& out, const at::Tensor& in);
  // The same collectives started and not waited for (CommWork::wait finishes them). On NCCL
  // they run on NCCL's own stream; on gloo in the backend's worker threads. The tensors must
  // stay alive and untouched until the wait. Every rank must start a group's collectives in
  // the same order (blocking or not).
  CommWork all_gather_start(at::Tensor& out, const at::Tensor& in);
  CommWork allreduce_start(at::Tensor& t, ReduceOp op = ReduceOp::Sum);
  // out (in.numel() / size()) = the sum over ranks of this rank's chunk of `in`.
  void reduce_scatter(at::Tensor& out, const at::Tensor& in);
  // reduce_scatter started; on gloo `in` is summed in place (an all-reduce) and `out` is a
  // copy of this rank's chunk of it, written by the wait.
  CommWork reduce_scatter_start(at::Tensor& out, at::Tensor& in);

  // The communication that compute did not hide: milliseconds compute waited at collectives
  // (blocking calls and CommWork::wait), over every group, while counting is on. gloo: host
  // time blocked. NCCL: the waits do not block the host, so a CUDA event is recorded on the
  // compute stream before and after each wait; their distance is the stall. take_ returns
  // the total since its last call and resets it; on NCCL it waits for the last event, so the
  // trainer calls it on log steps, after the loss read. The trainer counts its train steps.
  static void count_comm_waits(bool on);
  static double take_comm_wait_ms();
  // Collectives this process ran over a real backend (one-rank groups are not counted),
  // by kind ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", and
  // the point-to-point "send" and "recv"),
  // since the start: calls, and bytes of each collective's whole buffer (the all-gather's
  // output, the reduce-scatter's input, the all-reduce's tensor).
  struct CommCount {
    int64_t calls = 0, bytes = 0;
  };
  static std::map<std::string, CommCount> comm_counts();
  // Adds `times` x `counts` to comm_counts (negative `times` takes them out): collectives the
  // host did not issue one by one, i.e. those a CUDA graph replays (parallel/comm_record.h).
  static void add_comm_counts(const std::map<std::string, CommCount>& counts, int64_t times);
  // Sends in's dim-0 rows [sum(in_splits[:r]), +in_splits[r]) to rank r and receives rank r's
  // rows for this rank into out's rows [sum(out_splits[:r]), +out_splits[r]).
  void all_to_all(at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits);
  // The same, started and not waited for (`out` and `in` untouched until the wait).
  CommWork all_to_all_start(at::Tensor& out, const at::Tensor& in,
                            const std::vector<int64_t>& out_splits,
                            const std::vector<int64_t>& in_splits);
  // Point-to-point: one send of `tensor` to, or one receive into it from, rank `peer` of this
  // group. A send and its receive carry the same tag (gloo matches on it; NCCL matches the
  // ops between two ranks in issue order, which the tag then only documents).
  struct P2POp {
    bool send = true;
    int64_t peer = 0;
    at::Tensor tensor;  // contiguous; a receive writes it in place
    int64_t tag = 0;
  };
  // Issues every op of `ops` together and waits for them all: on NCCL as one coalesced group
  // (ncclGroupStart/End), so sends and receives posted by both neighbours in any order cannot
  // block each other; on gloo each is posted before any is waited for. Counted in comm_counts as
  // "send" and "recv", one call and the tensor's bytes each. A one-rank group has no peer: `ops`
  // must be empty.
  void send_recv(const std::vector<P2POp>& ops);
  // The same ops posted, not waited for: on gloo one CommWork per op, in `ops`' order (a
  // send's wait returns once the peer has received it: gloo sends wait for the matching
  // receive), on NCCL one for the coalesced group.
  std::vector<CommWork> send_recv_start(const std::vector<P2POp>& ops);
  // all_to_all calls of this process so far, every group (tests check with it that a
  // recompute does not communicate again).
  static int64_t all_to_all_calls();

  // Small coordination values through the rendezvous store (checkpoint completion, a shared
  // temp-folder name). Keys are private to this group.
  void store_set(const std::string& key, const std::string& value);
  std::string store_get(const std::string& key);  // waits for the key
  int64_t store_add(const std::string& key, int64_t delta);

 private:
  ProcessGroup() = default;
  CommWork make_work(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what,
                     std::function<void()> then);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t rank_ = 0, size_ = 1;
  std::string backend_name_;
};

}  // namespace titan
