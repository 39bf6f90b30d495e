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

}  // namespace titan
