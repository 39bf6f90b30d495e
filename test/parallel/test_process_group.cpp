// ProcessGroup over gloo, two ranks as two threads of this process: when a collective (or a
// CommWork's wait) returns, the backend holds no reference to its tensors. The autograd
// engine accumulates two gradients of one tensor in place only when it holds the last
// reference to the first (torch/csrc/autograd/input_buffer.cpp, can_accumulate_inplace), so
// a reference that gloo's worker thread drops a moment after the wait returns made the
// step's op sequence (add_ or add) depend on thread timing (docs/compile.md).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <thread>

#include "parallel/process_group.h"

using namespace titan;

namespace {

// One rank's collectives; counts the calls after which a tensor was still shared.
struct Shared {
  int allreduce = 0, all_gather_in = 0, all_gather_out = 0, reduce_scatter = 0, started = 0;
  int wrong_values = 0;  // Catch's macros are not thread-safe: counted, checked on the main thread
  int total() const { return allreduce + all_gather_in + all_gather_out + reduce_scatter + started; }
};

// Sole owner: this handle is the tensor's only reference and its storage's only user.
bool unshared(const at::Tensor& t) {
  return t.use_count() == 1 && t.storage().use_count() == 1;
}

void run_rank(int rank, int port, int iters, Shared& s) {
  LaunchEnv env;
  env.source = "test";
  env.rank = rank;
  env.local_rank = rank;
  env.world_size = env.local_world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  CommSection comm;
  comm.init_timeout_seconds = comm.train_timeout_seconds = 60;
  ProcessGroup pg(env, comm, /*cuda=*/false);
  for (int i = 0; i < iters; ++i) {
    at::Tensor t = at::full({256}, 1.0f);
    pg.allreduce(t);
    s.allreduce += !unshared(t);
    at::Tensor in = at::full({64}, static_cast<float>(rank)), out = at::empty({128});
    pg.all_gather(out, in);
    s.all_gather_in += !unshared(in);
    s.all_gather_out += !unshared(out);
    at::Tensor rs = at::empty({64});
    pg.reduce_scatter(rs, at::ones({128}));
    s.reduce_scatter += !unshared(rs);
    at::Tensor a = at::ones({256});
    CommWork w = pg.allreduce_start(a);
    w.wait();
    s.started += !unshared(a);
    // The values stay right: sums over 2 ranks, rank 1's block of the gather.
    s.wrong_values += t[0].item<float>() != 2.0f || out[64].item<float>() != 1.0f ||
                      rs[0].item<float>() != 2.0f || a[0].item<float>() != 2.0f;
  }
}

}  // namespace

TEST_CASE("gloo collectives hold no reference to their tensors when they return",
          "[dist][comm]") {
  const int port = 21000 + static_cast<int>(::getpid() % 20000);
  const int iters = 400;
  Shared s0, s1;
  std::thread r1([&] { run_rank(1, port, iters, s1); });
  run_rank(0, port, iters, s0);
  r1.join();
  INFO("calls after which gloo still held a tensor, rank 0: all-reduce " << s0.allreduce
       << ", all-gather in " << s0.all_gather_in << " out " << s0.all_gather_out
       << ", reduce-scatter " << s0.reduce_scatter << ", started all-reduce " << s0.started
       << "; rank 1: " << s1.total() << " in all (of " << 5 * iters << " per rank)");
  CHECK(s0.wrong_values + s1.wrong_values == 0);
  CHECK(s0.total() == 0);
  CHECK(s1.total() == 0);
}
