// The vocabulary-parallel fused loss (core/kernels/fused_loss.h, VocabShard) against the
// unfused at::cross_entropy_loss(at::linear(h, W).float(), labels, sum) of the same LibTorch
// on the whole vocabulary. The tp "ranks" are threads of this process that combine their
// log-sum-exps through a test-local all-reduce (sum or max over the threads), the same
// contract the c10d tp group gives in training. Checked: every rank's loss equals the full
// loss, the ranks' dh summed equal the full dh, their dW slices stacked equal the full dW.
// Error measure: max |a - ref| / max |ref|; tolerance 1e-5 (fp32: one more log/exp
// round-off than the one-rank path). Each rank forms logits of its own V/tp columns only.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "core/kernels/fused_loss.h"

using namespace titan;

namespace {

double rel_err(const at::Tensor& a, const at::Tensor& ref) {
  at::Tensor r = ref.detach().to(at::kDouble);
  const double diff = (a.detach().to(at::kDouble) - r).abs().max().item<double>();
  const double scale = r.abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

// An all-reduce over n threads: each contributes its tensor, all receive the combination.
class ThreadAllReduce {
 public:
  explicit ThreadAllReduce(int n) : n_(n) {}
  void operator()(at::Tensor& t, bool max) {
    std::unique_lock<std::mutex> lk(mu_);
    const int64_t gen = gen_;
    acc_ = arrived_ == 0 ? t.clone() : (max ? at::maximum(acc_, t) : acc_ + t);
    if (++arrived_ == n_) {
      result_ = acc_;
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return gen_ != gen; });
    }
    t.copy_(result_);
  }

 private:
  int n_, arrived_ = 0;
  int64_t gen_ = 0;
  at::Tensor acc_, result_;
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace

TEST_CASE("vocab-parallel fused loss over 2 and 4 ranks equals the full loss and gradients",
          "[fused_loss][tp]") {
  at::manual_seed(5);
  const int64_t N = 96, D = 48, V = 256;
  at::Tensor h = at::randn({N, D}) * 0.5;
  at::Tensor W = at::randn({V, D}) * 0.3;
  at::Tensor labels = at::randint(V, {N}, at::kLong);
  labels = at::where(at::rand({N}) < 0.2, at::full_like(labels, kIgnoreIndex), labels);
  at::Tensor hr = h.clone().requires_grad_(true), Wr = W.clone().requires_grad_(true);
  at::Tensor ref = at::cross_entropy_loss(at::linear(hr, Wr), labels, {}, at::Reduction::Sum,
                                          kIgnoreIndex);
  ref.backward();
  for (int tp : {2, 4}) {
    DYNAMIC_SECTION("tp " << tp) {
      ThreadAllReduce reduce(tp);
      std::vector<at::Tensor> loss(tp), dh(tp), dW(tp);
      std::vector<std::thread> ranks;
      const int64_t rows = V / tp;
      for (int r = 0; r < tp; ++r)
        ranks.emplace_back([&, r] {
          at::Tensor hl = h.clone().requires_grad_(true);
          at::Tensor Wl = W.narrow(0, r * rows, rows).clone().requires_grad_(true);
          VocabShard shard;
          shard.offset = r * rows;
          shard.allreduce = [&reduce](at::Tensor& t, bool max) { reduce(t, max); };
          // 40 tokens per chunk: three chunks, the last one short.
          loss[r] = fused_linear_cross_entropy(hl, Wl, labels, 40, LossBackward::kInForward,
                                               &shard);
          loss[r].backward();
          dh[r] = hl.grad();
          dW[r] = Wl.grad();
        });
      for (auto& t : ranks) t.join();
      at::Tensor dh_sum = at::zeros_like(h);
      for (int r = 0; r < tp; ++r) {
        INFO("rank " << r);
        CHECK(rel_err(loss[r], ref) < 1e-5);
        dh_sum += dh[r];
      }
      const double e_dh = rel_err(dh_sum, hr.grad()), e_dw = rel_err(at::cat(dW), Wr.grad());
      INFO("dh " << e_dh << " dW " << e_dw);
      CHECK(e_dh < 1e-5);
      CHECK(e_dw < 1e-5);
    }
  }
}
