// Block recomputation for activation checkpointing (there is no C++ torch.utils.checkpoint).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace titan {

// A transformer block: x and the compute forms of its weights -> the block's output.
using BlockFn = std::function<at::Tensor(const at::Tensor& x, const std::vector<at::Tensor>& w)>;

// Runs fn(x, weights) without saving activations and recomputes it in backward. `fn` must
// outlive the backward pass (blocks keep theirs in the model). While a block is being
// recomputed, is_recomputing() is true, so side effects such as MoE token counting happen
// once per forward, not twice. Blocks hold no random ops, so no RNG state is restored.
at::Tensor checkpoint_block(const BlockFn& fn, const at::Tensor& x,
                            const std::vector<at::Tensor>& weights);
bool is_recomputing();

// Op-level selective checkpointing (selective_ac_option = "op", torchtitan's op policy). The
// block runs without grad once, and the GEMMs of project() and the attention of
// causal_sdpa() (core/train/functional.h) record their outputs on a tape as they go. In backward
// the block reruns with grad: those calls take their recorded output through autograd
// Functions whose backward computes the same gradients as the original ops, so only the
// cheap ops in between (norms, RoPE, activations, MoE routing and experts) are recomputed.
// As in torchtitan, every second GEMM of a block is recomputed rather than saved, and
// GEMMs whose weight has one of `force_recompute_shapes` are never saved. Attention is
// saved when PyTorch would run the CPU flash kernel; otherwise (other backends, CUDA, head
// dims that differ between q and v) it is recomputed. Gradients equal those without
// checkpointing.
struct OpCheckpointPolicy {
  std::vector<std::vector<int64_t>> force_recompute_shapes;  // weight shapes (out, in)
};
at::Tensor checkpoint_block_ops(const BlockFn& fn, const at::Tensor& x,
                                const std::vector<at::Tensor>& weights,
                                const OpCheckpointPolicy& policy);

// How many outputs op tapes have handed back instead of recomputing (process-wide; tests
// check with it that saving really happens).
int64_t op_tape_replays();

// Used by core/train/functional's project() and causal_sdpa(): whether a tape is recording or
// replaying on this thread, and the taped forms of the two ops (x w^T; causal attention on
// (B, H, T, D) inputs).
bool op_tape_active();
at::Tensor tape_project(const at::Tensor& x, const at::Tensor& w);
at::Tensor tape_causal_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, bool enable_gqa);

// Other saved ops under the same tape (the MoE experts' GEMM outputs and expert
// parallelism's all-to-all results, docs/moe.md): while a tape records, op_tape_save keeps an
// op's outputs; while it replays, op_tape_restore hands them back in the same order, and the
// caller passes them through an autograd Function whose backward is the op's, so neither
// the computation nor the communication runs again.
bool op_tape_recording();
bool op_tape_replaying();
void op_tape_save(const std::vector<at::Tensor>& outputs);
std::vector<at::Tensor> op_tape_restore(size_t n);

}  // namespace titan
