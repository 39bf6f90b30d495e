// The output projection and cross-entropy loss fused and chunked over tokens, so that the
// (tokens, vocab) logits never exist at once: forward and backward each hold one chunk's
// logits (chunk, V) fp32 at a time. Same contract as at::cross_entropy_loss(at::linear(h, W)
// .float(), labels, sum) (core/trainer.cpp token_loss_sum): fp32 log-softmax, label -100 ignored.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace titan {

constexpr int64_t kIgnoreIndex = -100;

// Bound on one chunk's fp32 logits, chunk * V * 4 bytes (docs/performance.md).
constexpr int64_t kLossChunkBytes = int64_t{32} << 20;

// Tokens per chunk for a vocabulary of V: kLossChunkBytes / (4 V), rounded down to a multiple
// of 16 when it is at least 16 (GEMM tiles), and at least 1. V = 32768 gives 256; 128256, 64.
int64_t default_loss_chunk_tokens(int64_t vocab);

// Sum over tokens of -log softmax(h W^T)[label], as a 0-d fp32 tensor.
// h: (N, D) or (B, T, D) in the compute dtype; W: (V, D), same dtype (may be the embedding
// table: its gradient adds to the lookup's through autograd); labels: int64, h's leading shape.
// chunk_tokens <= 0 picks default_loss_chunk_tokens(V). Backward recomputes each chunk's
// logits from h and W with the saved per-token log-sum-exp (N fp32) and forms dh (one GEMM
// per chunk) and dW (one GEMM per chunk, accumulated in fp32).
at::Tensor fused_linear_cross_entropy(const at::Tensor& h, const at::Tensor& W,
                                      const at::Tensor& labels, int64_t chunk_tokens = 0);

}  // namespace titan
