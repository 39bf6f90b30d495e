// The output projection and cross-entropy loss fused and chunked over tokens, so that the
// (tokens, vocab) logits never exist at once: forward and backward each hold one chunk's
// logits (chunk, V) fp32 at a time. Same contract as at::cross_entropy_loss(at::linear(h, W)
// .float(), labels, sum) (core/trainer.cpp token_loss_sum): fp32 log-softmax, label -100 ignored.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace titan {

constexpr int64_t kIgnoreIndex = -100;

// Bound on one chunk's fp32 logits, chunk * V * 4 bytes (docs/performance.md).
constexpr int64_t kLossChunkBytes = int64_t{32} << 20;

// Tokens per chunk for a vocabulary of V: kLossChunkBytes / (4 V), rounded down to a multiple
// of 16 when it is at least 16 (GEMM tiles), and at least 1. V = 32768 gives 256; 128256, 64.
int64_t default_loss_chunk_tokens(int64_t vocab);

// Where the backward's d loss / d logits comes from.
enum class LossBackward {
  // Forward also forms dh and dW (for an upstream gradient of 1) chunk by chunk while each
  // chunk's logits exist: three GEMMs per chunk in all, as unfused. Backward only scales them
  // by the upstream gradient, and needs neither h nor W again (FSDP need not re-gather W).
  // Holds dh (N, D) and an fp32 dW (V, D) from forward to backward; the loss is the last op of
  // the forward, so that is no longer than the backward would hold them anyway. Only when
  // grad mode is on and h or W requires grad; a graph through it cannot be backpropagated twice.
  kInForward,
  // Forward saves the per-token log-sum-exp (N fp32); backward recomputes each chunk's
  // logits from h and W: four GEMMs per chunk, and h and W are kept for backward.
  kRecompute,
};

// Sum over tokens of -log softmax(h W^T)[label], as a 0-d fp32 tensor.
// h: (N, D) or (B, T, D) in the compute dtype; W: (V, D), same dtype (may be the embedding
// table: its gradient adds to the lookup's through autograd); labels: int64, h's leading shape.
// chunk_tokens <= 0 picks default_loss_chunk_tokens(V). Per chunk, dh takes one GEMM and dW
// one GEMM accumulated in fp32; dW comes back in W's dtype.
//
// With `shard` (vocabulary parallelism), W holds rows [shard->offset, + W.size(0)) of the
// output projection and labels are global token ids: each rank forms only its own slice of
// each chunk's logits, the per-token log-sum-exp and target logit are combined over the
// ranks with shard->allreduce (three all-reduces of N floats per call), and every rank
// returns the same full loss. The backward recomputes the local logits (kRecompute whatever
// `mode` says); dh is this rank's partial sum over its vocabulary slice.
struct VocabShard {
  int64_t offset = 0;
  std::function<void(at::Tensor&, bool max)> allreduce;  // in place: sum, or max
};
at::Tensor fused_linear_cross_entropy(const at::Tensor& h, const at::Tensor& W,
                                      const at::Tensor& labels, int64_t chunk_tokens = 0,
                                      LossBackward mode = LossBackward::kInForward,
                                      const VocabShard* shard = nullptr);

}  // namespace titan
