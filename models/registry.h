// Building a model from the job config: the three families and their flavors.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/train/model.h"

namespace titan {

// Builds the model named by cfg.model (name, flavor) on `device`, initialized from
// cfg.debug.seed. Throws UserError for an unknown family or flavor.
// defer_params: parameters are left unallocated (meta tensors, see DeferParams) and
// uninitialized, so a sharding step can allocate only its rows before the caller runs
// init_weights(cfg.debug.seed) (parallel/fsdp.h). Buffers are allocated as usual.
std::unique_ptr<Model> build_model(const JobConfig& cfg, at::Device device,
                                   bool defer_params = false);
// What the configured model does with packed documents: the flavor's attn_mask_type and
// attn_type unless model.attn_mask_type / model.attn_type override them, and the
// model.document_* keys; eos_id is the tokenizer's. Throws UserError naming a bad key.
DocumentOptions model_document_options(const JobConfig& cfg, int64_t eos_id);
// The vocabulary of the configured flavor, without building the model (data checks).
int64_t model_vocab_size(const JobConfig& cfg);
// Flavor names of a family, for messages and docs.
std::vector<std::string> model_flavors(const std::string& name);

}  // namespace titan
