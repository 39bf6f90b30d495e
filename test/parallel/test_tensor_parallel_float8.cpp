// Float8 linears under tensor parallelism (docs/float8.md, "Tensor parallelism"; torchao
// 0.18's Float8ColwiseParallel / Float8RowwiseParallel scales: those of the whole tensor):
// - the op: a column- and a row-parallel slice of a float8 linear on two gloo ranks (threads
//   of this process) give the unsplit op's output, input gradient and weight gradient, for
//   every recipe; without the amax all-reduce (a planted fault) they do not;
// - through the binary: llama3 debugmodel TP 2 equals 1 rank with float8 tensorwise and
//   rowwise, and FSDP 2 x async TP 2 with the FSDP float8 all-gather and precomputed scales
//   (405B's float8 recipe in small) equals 1 rank with the same micro-batches;
// - TP 2 with float8 passes the CPU capture check.
#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <thread>

#include "core/kernels/float8_tp.h"
#include "parallel/process_group.h"
#include "test_port.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

class PgAmaxAllReduce : public float8::AmaxAllReduce {
 public:
  explicit PgAmaxAllReduce(ProcessGroup& pg) : pg_(pg) {}
  void max_(at::Tensor& amax) const override { pg_.allreduce(amax, ReduceOp::Max); }

 private:
  ProcessGroup& pg_;
};

// The largest |a - b| / max|b|.
double rel(const at::Tensor& a, const at::Tensor& b) {
  return test::rel_err(a, b);
}

// x (M, K), w (N, K), go (M, N) whose halves differ in magnitude along N and K, so the two
// slices' amaxes (tensorwise, and rowwise over a cut dim) differ from the whole tensor's.
struct Inputs {
  at::Tensor x, w, go;
};
Inputs make_inputs() {
  const int64_t M = 32, K = 64, N = 48;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  Inputs in{at::randn({M, K}, gen), at::randn({N, K}, gen), at::randn({M, N}, gen)};
  in.x.narrow(1, K / 2, K / 2).mul_(9.0);
  in.w.narrow(0, 0, N / 2).mul_(5.0);
  in.w.narrow(1, 0, K / 2).mul_(0.3);
  in.go.narrow(1, N / 2, N / 2).mul_(7.0);
  return in;
}

struct Grads {
  at::Tensor y, dx, dw;
};
Grads run_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& go,
             const float8::Options& opts, const float8::TpSlice& tp) {
  at::Tensor xl = x.clone().requires_grad_(true), wl = w.clone().requires_grad_(true);
  at::Tensor y = float8::float8_linear(xl, wl, at::Tensor(), opts, nullptr, tp);
  y.backward(go);
  return {y.detach(), xl.grad(), wl.grad()};
}

// Worst relative differences of one rank's slice results against the unsplit op: [0] the
// parts with no partial sum (column: output, dw; row: dx, dw), [1] the summed ones (column:
// dx; row: output), over every recipe; and the same with the planted fault (no all-reduce).
struct OpDiff {
  double exact = 0, summed = 0, fault = 0;
};

void run_rank(int rank, int port, OpDiff& d) {
  LaunchEnv env;
  env.source = "test";
  env.rank = rank;
  env.local_rank = rank;
  env.world_size = env.local_world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  CommSection cs;
  cs.init_timeout_seconds = cs.train_timeout_seconds = 60;
  ProcessGroup pg(env, cs, /*cuda=*/false);
  auto reduce = c10::make_intrusive<PgAmaxAllReduce>(pg);
  const Inputs in = make_inputs();
  const int64_t K = in.x.size(1), N = in.w.size(0);
  for (float8::Recipe r :
       {float8::Recipe::Tensorwise, float8::Recipe::Rowwise, float8::Recipe::RowwiseWithGwHp}) {
    const float8::Options opts{r, false};
    const Grads ref = run_op(in.x, in.w, in.go, opts, {});
    for (bool fault : {false, true}) {
      auto slice = [&](float8::TpSplit s) {
        return fault ? float8::TpSlice{} : float8::TpSlice{s, reduce};
      };
      // Column: w's rows [r N/2, ...), x whole, the output's columns and their gradient.
      const Grads c =
          run_op(in.x, in.w.narrow(0, rank * N / 2, N / 2), in.go.narrow(1, rank * N / 2, N / 2),
                 opts, slice(float8::TpSplit::Column));
      at::Tensor dx_sum = c.dx.clone();
      pg.allreduce(dx_sum, ReduceOp::Sum);
      // Row: w's columns and x's columns [r K/2, ...), the output a partial sum, go whole.
      const Grads w =
          run_op(in.x.narrow(1, rank * K / 2, K / 2), in.w.narrow(1, rank * K / 2, K / 2), in.go,
                 opts, slice(float8::TpSplit::Row));
      at::Tensor y_sum = w.y.clone();
      pg.allreduce(y_sum, ReduceOp::Sum);
      const double exact = std::max({rel(c.y, ref.y.narrow(1, rank * N / 2, N / 2)),
                                     rel(c.dw, ref.dw.narrow(0, rank * N / 2, N / 2)),
                                     rel(w.dx, ref.dx.narrow(1, rank * K / 2, K / 2)),
                                     rel(w.dw, ref.dw.narrow(1, rank * K / 2, K / 2))});
      const double summed = std::max(rel(dx_sum, ref.dx), rel(y_sum, ref.y));
      if (fault) {
        d.fault = std::max(d.fault, std::max(exact, summed));
      } else {
        d.exact = std::max(d.exact, exact);
        d.summed = std::max(d.summed, summed);
      }
    }
  }
}

const std::string kRun =
    "--config configs/llama3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
    "--validation.enable false --metrics.enable_tensorboard false --training.device cpu "
    "--debug.seed 3 --training.steps 4 --model.converters float8 ";

test::CmdResult train(int nproc, const std::string& args) {
  const std::string launch = nproc == 1
                                 ? "env -u RANK -u WORLD_SIZE " + test::binary()
                                 : test::torchrun() + " --standalone --nproc_per_node " +
                                       std::to_string(nproc) + " --no-python " + test::binary();
  return test::run("cd " + test::source_dir() + " && " + launch + " " + kRun + args);
}

std::string tail(const std::string& s) {
  return s.substr(s.size() > 4000 ? s.size() - 4000 : 0);
}

struct Step {
  double loss = 0, grad_norm = 0;
};

std::map<int64_t, Step> metrics(const std::string& dump) {
  std::map<int64_t, Step> out;
  for (auto& [step, j] : test::training_metrics(dump + "/metrics.jsonl"))
    out[step] = {j["loss"].get<double>(), j["grad_norm"].get<double>()};
  return out;
}

}  // namespace

TEST_CASE("float8 TP: column- and row-parallel slices of a float8 linear equal the unsplit op",
          "[float8][tp][dist]") {
  // Reference: the unsplit float8_linear (fp32, the CPU _scaled_mm for tensorwise, emulated
  // rowwise). The slices' operands are cast with the whole tensor's scales, so the float8
  // values are the same; what remains is the GEMMs' sums. Tolerances, relative to the
  // largest element: 1e-6 where no partial sum is added (column output and dw, row dx and
  // dw), 1e-5 where the two ranks' partial sums are (column dx, row output). The planted
  // fault (each slice scaled by its own amax) must differ by more than 1e-3. Measured: 0 (no
  // partial sum: the same float8 values and the same dot products), 2.0e-7 (summed), 7.6e-2
  // (the fault).
  const int port = test::free_tcp_port();
  OpDiff d0, d1;
  std::thread r1([&] { run_rank(1, port, d1); });
  run_rank(0, port, d0);
  r1.join();
  WARN("float8 TP slices vs the unsplit op, max relative difference: no partial sum "
       << std::max(d0.exact, d1.exact) << ", summed " << std::max(d0.summed, d1.summed)
       << "; without the amax all-reduce " << std::max(d0.fault, d1.fault));
  CHECK(std::max(d0.exact, d1.exact) <= 1e-6);  // measured 0
  CHECK(std::max(d0.summed, d1.summed) < 1e-5);
  CHECK(std::min(d0.fault, d1.fault) > 1e-3);
}

TEST_CASE("float8 TP: llama3 TP 2 equals 1 rank with float8 tensorwise and rowwise",
          "[float8][tp][dist][app]") {
  // The global batch of 4 sequences on one dp rank; losses and grad norms over 4 steps, fp32.
  // Not bit-equal: the row-parallel GEMMs' partial sums add in another order (high precision
  // TP 2 differs from 1 rank by ~1e-7), and under float8 a last-bit change of an activation
  // can change its tensor's scale or move an element to the next float8 value, which the
  // lr warm-up then grows (measured over steps 1..4, tensorwise: loss 3.5e-7 .. 2.3e-5, grad
  // norm 4.8e-6 .. 2.2e-4; rowwise: loss 0 .. 8.0e-6, grad norm 0 .. 2.2e-5). Tolerances:
  // step 1 (same weights, the scales' effect alone) loss 2e-6 relative (scaling each slice
  // by its own amax, a planted fault, measured 7.7e-6 for tensorwise; rowwise's power-of-2
  // scales mostly hide it), every step loss 1e-4 and grad norm 1e-3.
  for (const char* recipe : {"tensorwise", "rowwise"}) {
    DYNAMIC_SECTION(recipe) {
      test::TempDir one("f8tp_one"), tp("f8tp_tp");
      const std::string common =
          "--training.local_batch_size 4 "
          "--quantize.linear.float8.recipe_name " +
          std::string(recipe) + " ";
      auto r1 = train(1, common + "--job.dump_folder " + one.path.string());
      INFO(tail(r1.out));
      REQUIRE(r1.rc == 0);
      auto r2 = train(2, common + "--parallelism.tensor_parallel_degree 2 --job.dump_folder " +
                             tp.path.string());
      INFO(tail(r2.out));
      REQUIRE(r2.rc == 0);
      CHECK_THAT(r2.out, Contains("42 linears converted, 0 filtered"));
      auto a = metrics(one.path.string()), b = metrics(tp.path.string());
      REQUIRE(a.size() == 4);
      REQUIRE(b.size() == 4);
      const auto [l, n] = test::worst_rel(a, b);
      const double l1 = std::abs(a[1].loss - b[1].loss) / a[1].loss;
      WARN("float8 " << recipe << " TP 2 vs 1 rank over 4 steps: loss " << l << ", grad norm " << n
                     << "; step 1 loss " << l1);
      CHECK(l1 < 2e-6);
      CHECK(l < 1e-4);
      CHECK(n < 1e-3);
    }
  }
}

TEST_CASE(
    "float8 TP: FSDP 2 x async TP 2 with the float8 all-gather and precomputed scales equals 1 "
    "rank",
    "[float8][tp][dist][app][async_tp]") {
  // 405B's float8 settings in small. Each dp rank takes 2 sequences; the reference is 1 rank
  // with the same 2-sequence micro-batches accumulated twice (an activation's tensorwise scale
  // is its micro-batch's amax). 4 steps; tolerances: loss 3e-4, grad norm 1e-3 relative
  // (measured: step 1 equal, then loss 1.7e-5, grad norm 3.3e-5; the float8 amplification
  // of the TP 2 test above).
  test::TempDir one("f8tp_acc"), f("f8tp_fsdp");
  auto r1 = train(1,
                  "--training.local_batch_size 2 --training.global_batch_size 4 "
                  "--job.dump_folder " +
                      one.path.string());
  INFO(tail(r1.out));
  REQUIRE(r1.rc == 0);
  auto r4 = train(4,
                  "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2 "
                  "--parallelism.enable_async_tensor_parallel true "
                  "--quantize.linear.float8.enable_fsdp_float8_all_gather true "
                  "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp true "
                  "--job.dump_folder " +
                      f.path.string());
  INFO(tail(r4.out));
  REQUIRE(r4.rc == 0);
  CHECK_THAT(r4.out, Contains("dp_replicate 1 x dp_shard 2 x tp 2"));
  CHECK_THAT(r4.out, Contains("float8 all-gather of"));
  CHECK_THAT(r4.out, Contains("=> async tensor parallel with float8 linears"));
  // The float8 linears' boundaries fall back to plain TP, visibly (a line and the metric).
  CHECK_THAT(r4.out, Contains("ran plain TP's all-gather / reduce-scatter, not chunked (first "
                              "reason: float8 weights)"));
  for (auto& [step, j] : test::training_metrics(f.file("metrics.jsonl")))
    CHECK(j.value("tp/async_fallback_calls", 0.0) > 0);
  auto a = metrics(one.path.string()), b = metrics(f.path.string());
  REQUIRE(a.size() == 4);
  REQUIRE(b.size() == 4);
  const auto [l, n] = test::worst_rel(a, b);
  WARN("float8 FSDP 2 x async TP 2 (float8 all-gather, precomputed scales) vs 1 rank: loss "
       << l << ", grad norm " << n);
  CHECK(l < 3e-4);
  CHECK(n < 1e-3);
}

TEST_CASE("float8 TP: TP 2 with float8 passes the CPU capture check",
          "[float8][tp][dist][app][compile]") {
  // The amax all-reduces are device ops on device tensors: no host read, the same op sequence
  // every step (bf16 compute, as the GPU step).
  for (const char* recipe : {"tensorwise", "rowwise"}) {
    DYNAMIC_SECTION(recipe) {
      test::TempDir dir("f8tp_compile");
      auto r = train(2,
                     "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2 "
                     "--compile.enable true --training.steps 5 "
                     "--quantize.linear.float8.recipe_name " +
                         std::string(recipe) + " --job.dump_folder " + dir.path.string());
      INFO(tail(r.out));
      REQUIRE(r.rc == 0);
      CHECK_THAT(r.out, Contains("ops per step, static"));
      CHECK_THAT(r.out, Contains("capture check: 3 steps compared"));
    }
  }
}
