// Which linear layers of a model train in float8, and how project() finds them
// (docs/float8.md). Models know nothing of it: Model::weight(i) marks the compute form of a
// converted parameter, and project() runs a marked weight's GEMMs through
// titan::float8::float8_linear instead of at::linear.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "core/kernels/float8_linear.h"
#include "core/kernels/float8_tp.h"

namespace titan {

class ParamStore;

// The conversion of one model, decided once from its parameter names and shapes, as
// torchtitan's float8 converter does with module fqns and weight shapes.
struct Float8Plan {
  std::vector<int64_t> converted;             // store indices of the float8 linears' weights
  std::vector<std::string> filtered;          // linear fqns left in high precision by a rule
  std::vector<std::string> filtered_reasons;  // the rule, one per `filtered` entry
};

// The linears are the dense 2-D ".weight" parameters other than the token embedding, the
// output layer and the MoE router's gate (all three stay in high precision, as in
// torchtitan's shipped configs). A linear (fqn = the name without ".weight") is left out when
// its fqn contains an entry of filter_fqns, when its weight (N, K) (whole model shape) has a
// dim that is not a multiple of 16 (torchtitan's rule: the GPU kernel needs it), and, when
// filter_fqns holds "auto_filter_small_kn", by torchao 0.18's size thresholds for the recipe
// (_auto_filter_for_recipe): tensorwise skips K <= 4096 and N <= 1024; rowwise skips
// N <= 2048, K <= 1024, or N <= 4096 and K <= 2048.
Float8Plan plan_float8_linears(const ParamStore& params,
                               const std::vector<std::string>& filter_fqns, float8::Recipe recipe);

struct TpPlan;
// Under tensor parallelism, moves the converted linears that the plan replicates over tp
// (deepseek_v3's MLA down-projections, the MoE shared expert) to `filtered`: their input or
// output gradient is a sequence shard or a partial sum on each tp rank, so a max over the
// ranks is not the whole tensor's amax (docs/float8.md, "Tensor parallelism").
void keep_tp_replicated_high_precision(const TpPlan& tp_plan, const ParamStore& params,
                                       Float8Plan& plan);

// project()'s side. The weight tensors marked since they were made run in float8 with
// `opts`; marks end with their tensor. Thread-safe (backward may run on other threads).
void mark_float8_weight(const at::Tensor& w, const float8::Options& opts);
// The options of a marked weight, or nullopt.
std::optional<float8::Options> float8_options_of(const at::Tensor& w);
// Attaches w's float8 form made by w's owner before the model sees w (FSDP's float8
// all-gather: e4m3 data of w's shape and its tensorwise scale); w may be a stand-in without
// values. A weight that is then marked runs its GEMMs on it (float8_linear's w8).
void attach_float8_weight(const at::Tensor& w, const float8::Quantized& w8);
// Marks w as a tensor-parallel slice of its weight (Model::weight() does it for the float8
// linears that tensor parallelism cuts): its GEMMs all-reduce the amaxes the cut spans, so
// the scales are the whole weight's and the whole activations' (core/kernels/float8_tp.h).
void mark_float8_tp(const at::Tensor& w, const float8::TpSlice& tp);
struct Float8Weight {
  float8::Options opts;
  float8::Quantized pre;  // attached float8 form; data undefined: the op casts w itself
  float8::TpSlice tp;     // split None: a whole weight
};
// A marked weight's options and attached form, or nullopt when it is not marked.
std::optional<Float8Weight> float8_weight_of(const at::Tensor& w);
// Gives `to` the mark and attached form of `from`, if it has one. Activation checkpointing's
// recompute runs a block on detached copies of its saved weights (new tensors): without the
// copy its linears would recompute, and differentiate, in high precision.
void copy_float8_mark(const at::Tensor& from, const at::Tensor& to);

}  // namespace titan
