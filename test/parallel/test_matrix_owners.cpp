// Muon's owner plan (parallel/matrix_owners.h), ranks as threads of this process over gloo:
// every matrix held in pieces (FSDP's padded rows, tensor-parallel slices, or both) is
// orthogonalized by exactly one rank, the ranks share the work about evenly, and each rank
// gets back exactly its piece of Newton-Schulz of the whole matrix (bit for bit: the owner
// runs the same bf16 ops on the same whole matrix that one process would).
#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <thread>

#include "core/train/muon.h"
#include "parallel/matrix_owners.h"
#include "test_port.h"

using namespace titan;

namespace {

// The test's matrices: whole shapes, and for each the tensor-parallel dim (-1: not cut).
struct Spec {
  std::vector<int64_t> shape;
  int64_t tp_dim;
};

const std::vector<Spec> kSpecs = {
    {{10, 6}, 0}, {{7, 12}, 1}, {{16, 16}, 0}, {{6, 20}, 1}, {{12, 8}, 1},
    {{9, 4}, -1}, {{8, 24}, 0}, {{14, 6}, 1},  {{4, 4}, 0},  {{20, 10}, 1},
};

at::Tensor whole_of(size_t k) {
  // A generator of its own: the ranks are threads, the default generator is shared.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(100 + k));
  return at::randn(kSpecs[k].shape, gen).to(at::kBFloat16);
}

at::Tensor orth_ref(const at::Tensor& w) {
  return newton_schulz(w, {3.4445, -4.7750, 2.0315}, 5, 1e-7);
}

// This rank's piece: the tp slice (rank t of tp), then its rows padded to ceil(rows / shard)
// per rank (rank s of shard). shard or tp 1: no such cut.
at::Tensor piece_of(const at::Tensor& whole, int64_t tp_dim, int64_t s, int64_t shard, int64_t t,
                    int64_t tp) {
  at::Tensor x = whole;
  if (tp > 1 && tp_dim >= 0) x = x.chunk(tp, tp_dim)[static_cast<size_t>(t)];
  if (shard == 1) return x.contiguous();
  const int64_t rows = x.size(0), chunk = (rows + shard - 1) / shard;
  at::Tensor padded = at::zeros({chunk * shard, x.size(1)}, x.options());
  padded.narrow(0, 0, rows).copy_(x);
  return padded.narrow(0, s * chunk, chunk).contiguous();
}

struct Outcome {
  int64_t calls = 0;
  double cost = 0;
  int64_t wrong = 0;  // pieces that differ from the one-process result (checked on the main thread)
  std::string error;
};

// world = shard x tp ranks, rank = s * tp + t (tensor parallelism innermost, as the mesh).
void run_rank(int64_t rank, int64_t shard, int64_t tp, int port, Outcome& out) {
  try {
    LaunchEnv env;
    env.source = "test";
    env.rank = env.local_rank = rank;
    env.world_size = env.local_world_size = shard * tp;
    env.master_addr = "127.0.0.1";
    env.master_port = port;
    CommSection comm;
    comm.init_timeout_seconds = comm.train_timeout_seconds = 60;
    ProcessGroup world(env, comm, /*cuda=*/false);
    const int64_t s = rank / tp, t = rank % tp;
    std::vector<int64_t> shard_ranks, tp_ranks;
    for (int64_t i = 0; i < shard; ++i) shard_ranks.push_back(i * tp + t);
    for (int64_t i = 0; i < tp; ++i) tp_ranks.push_back(s * tp + i);
    std::unique_ptr<ProcessGroup> shard_g, tp_g;
    if (shard > 1) shard_g = world.subgroup("shard" + std::to_string(t), shard_ranks);
    if (tp > 1) tp_g = world.subgroup("tp" + std::to_string(s), tp_ranks);
    std::vector<SharedMatrix> ms;
    std::vector<at::Tensor> local;
    for (size_t k = 0; k < kSpecs.size(); ++k) {
      const Spec& sp = kSpecs[k];
      at::Tensor p = piece_of(whole_of(k), sp.tp_dim, s, shard, t, tp);
      SharedMatrix m;
      m.local_shape = p.sizes().vec();
      const int64_t tp_rows = (tp > 1 && sp.tp_dim == 0) ? sp.shape[0] / tp : sp.shape[0];
      if (shard > 1) m.cuts.push_back({shard_g.get(), 0, tp_rows});
      if (tp > 1 && sp.tp_dim >= 0) m.cuts.push_back({tp_g.get(), sp.tp_dim, -1});
      const int64_t A = sp.shape[0], B = sp.shape[1];
      m.cost = static_cast<double>(A) * B * std::min(A, B);
      if (m.cuts.empty()) continue;  // held whole (replicated): not the plan's business
      ms.push_back(m);
      local.push_back(p);
    }
    std::vector<size_t> ks;  // kSpecs index of each planned matrix
    for (size_t k = 0; k < kSpecs.size(); ++k)
      if (shard > 1 || kSpecs[k].tp_dim >= 0) ks.push_back(k);
    MatrixOwners owners(ms);
    for (int step = 0; step < 2; ++step) {  // the same plan twice: buffers are not reused wrongly
      out.calls = 0;
      out.cost = 0;
      auto res = owners.run(local, [&](const at::Tensor& w) {
        ++out.calls;
        out.cost += static_cast<double>(w.size(0)) * w.size(1) * std::min(w.size(0), w.size(1));
        return orth_ref(w);
      });
      out.wrong = 0;
      for (size_t j = 0; j < ks.size(); ++j) {
        at::Tensor want =
            piece_of(orth_ref(whole_of(ks[j])), kSpecs[ks[j]].tp_dim, s, shard, t, tp);
        if (!at::equal(res[j], want)) {
          ++out.wrong;
          out.error += "matrix " + std::to_string(ks[j]) + " differs; ";
        }
      }
    }
  } catch (const std::exception& e) {
    out.error = e.what();
  }
}

void check_plan(int64_t shard, int64_t tp) {
  const int64_t n = shard * tp;
  const int port = test::free_tcp_port();
  std::vector<Outcome> outs(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int64_t r = 1; r < n; ++r)
    threads.emplace_back([&, r] { run_rank(r, shard, tp, port, outs[static_cast<size_t>(r)]); });
  run_rank(0, shard, tp, port, outs[0]);
  for (auto& th : threads) th.join();
  int64_t calls = 0, planned = 0;
  double cost = 0, worst = 0;
  for (size_t k = 0; k < kSpecs.size(); ++k)
    if (shard > 1 || kSpecs[k].tp_dim >= 0) ++planned;
  for (int64_t r = 0; r < n; ++r) {
    const Outcome& o = outs[static_cast<size_t>(r)];
    INFO("rank " << r << ": " << o.error);
    CHECK(o.error.empty());  // (and which pieces differ)
    CHECK(o.wrong == 0);
    calls += o.calls;
    cost += o.cost;
    worst = std::max(worst, o.cost);
  }
  // Every shared matrix orthogonalized exactly once over the ranks that share it: a matrix
  // cut only over the shard group is computed once per tp rank (tp replicas).
  int64_t expected = 0;
  for (size_t k = 0; k < kSpecs.size(); ++k) {
    if (!(shard > 1 || kSpecs[k].tp_dim >= 0)) continue;
    expected += (tp > 1 && kSpecs[k].tp_dim < 0) ? tp : 1;
  }
  CHECK(calls == expected);
  WARN("shard " << shard << " x tp " << tp << ": " << planned << " matrices, Newton-Schulz calls "
                << "per rank " <<
       [&] {
         std::string s;
         for (auto& o : outs) s += std::to_string(o.calls) + " ";
         return s;
       }() << "; most loaded rank's cost share "
                << worst / cost);
  // Balanced by cost, not count: no rank carries much more than its even share (greedy,
  // costliest first; the 16 x 16 matrix alone is 38% of the total here).
  CHECK(worst / cost < 1.0 / static_cast<double>(n) + 0.2);
  for (auto& o : outs) CHECK(o.calls >= 1);
}

}  // namespace

TEST_CASE("matrix owners: FSDP 2 rows, each rank orthogonalizes about half the cost",
          "[muon][dist]") {
  check_plan(2, 1);
}

TEST_CASE("matrix owners: tensor-parallel 2 slices", "[muon][dist]") {
  check_plan(1, 2);
}

TEST_CASE("matrix owners: FSDP 2 x TP 2, rows of tensor-parallel slices", "[muon][dist]") {
  check_plan(2, 2);
}
