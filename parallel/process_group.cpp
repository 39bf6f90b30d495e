#include "parallel/process_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>

#include "core/errors.h"
#include "core/log.h"

namespace titan {

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds init_timeout{0}, train_timeout{0};
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

}  // namespace

ProcessGroup::ProcessGroup(const LaunchEnv& env, const CommSection& comm, bool cuda)
    : impl_(std::make_unique<Impl>()), rank_(env.rank), size_(env.world_size) {
  impl_->init_timeout = std::chrono::seconds(comm.init_timeout_seconds);
  impl_->train_timeout = std::chrono::seconds(comm.train_timeout_seconds);
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
  try {
#ifdef USE_C10D_NCCL
    if (cuda) {
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = impl_->init_timeout;
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          impl_->store, static_cast<int>(rank_), static_cast<int>(size_), opts);
      backend_name_ = "nccl";
    }
#else
    if (cuda) throw UserError("this build has no NCCL backend; CUDA multi-process runs need one");
#endif
    if (!cuda) {
      auto opts = c10d::ProcessGroupGloo::Options::create(impl_->init_timeout);
      // Loopback for one node (torchrun --standalone); the host name otherwise, which is
      // what createDefaultDevice resolves (it falls back to loopback when that fails).
      opts->devices.push_back(env.local_world_size == env.world_size
                                  ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                  : c10d::ProcessGroupGloo::createDefaultDevice());
      impl_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          impl_->store, static_cast<int>(rank_), static_cast<int>(size_), opts);
      backend_name_ = "gloo";
    }
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
  impl_->backend->setTimeout(impl_->train_timeout);
  impl_->store->setTimeout(impl_->train_timeout);
}

void ProcessGroup::allreduce(at::Tensor& t, ReduceOp op) {
  try {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op == ReduceOp::Sum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    impl_->backend->allreduce(v, o)->wait();
  } catch (const std::exception& e) {
    die(rank_, "all-reduce", e);
  }
}

void ProcessGroup::broadcast(at::Tensor& t, int64_t root) {
  try {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    impl_->backend->broadcast(v, o)->wait();
  } catch (const std::exception& e) {
    die(rank_, "broadcast", e);
  }
}

void ProcessGroup::barrier() {
  try {
    impl_->backend->barrier()->wait();
  } catch (const std::exception& e) {
    die(rank_, "barrier", e);
  }
}

}  // namespace titan
