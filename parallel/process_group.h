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
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "parallel/launch_env.h"

namespace titan {

enum class ReduceOp { Sum, Max };

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

  // In-place collectives. A failure or a timeout (a peer died or hangs) ends this process
  // with status 1 at once: unwinding would wait on the backend's threads, which wait on the
  // dead peer.
  void allreduce(at::Tensor& t, ReduceOp op = ReduceOp::Sum);
  void broadcast(at::Tensor& t, int64_t root = 0);
  void barrier();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t rank_ = 0, size_ = 1;
  std::string backend_name_;
};

}  // namespace titan
