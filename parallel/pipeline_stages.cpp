#include "parallel/pipeline_stages.h"

#include <algorithm>
#include <map>

#include "core/base/errors.h"

namespace titan {

namespace {

constexpr const char* kDegreeKey = "parallelism.pipeline_parallel_degree";
constexpr const char* kLayersPerStageKey = "parallelism.pipeline_parallel_layers_per_stage";
constexpr const char* kFirstKey = "parallelism.pipeline_parallel_first_stage_less_layers";
constexpr const char* kLastKey = "parallelism.pipeline_parallel_last_stage_less_layers";
constexpr const char* kFqnsKey = "parallelism.module_fqns_per_model_part";

std::string str(int64_t v) {
  return std::to_string(v);
}

std::string layer_name(int64_t l) {
  return "layers." + str(l);
}

// The model's modules in forward order, in torchtitan's names.
std::vector<std::string> forward_order(int64_t n_layers) {
  std::vector<std::string> names = {"tok_embeddings"};
  for (int64_t l = 0; l < n_layers; ++l) names.push_back(layer_name(l));
  names.push_back("norm");
  names.push_back("output");
  return names;
}

// Stage specs from per-stage module names: every module once, in forward order, norm and
// output in one stage (they are one parameter unit here), no stage empty.
std::vector<PipelineStageSpec> specs_from_fqns(const std::vector<std::vector<std::string>>& fqns,
                                               int64_t n_layers, const std::string& who) {
  const auto order = forward_order(n_layers);
  std::map<std::string, size_t> position;
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
  const std::string known =
      "tok_embeddings, layers.0 .. layers." + str(n_layers - 1) + ", norm, output";
  std::vector<PipelineStageSpec> specs;
  size_t next = 0;
  for (size_t s = 0; s < fqns.size(); ++s) {
    const std::string where = who + " stage " + str(static_cast<int64_t>(s));
    if (fqns[s].empty()) throw UserError(where + " has no modules; every stage needs one");
    PipelineStageSpec spec;
    spec.index = static_cast<int64_t>(s);
    spec.first_layer = -1;
    for (const auto& name : fqns[s]) {
      auto it = position.find(name);
      if (it == position.end())
        throw UserError(where + " names '" + name + "', which is not a module of this model (" +
                        known + ")");
      if (it->second != next)
        throw UserError(where + " names '" + name + "' where '" +
                        (next < order.size() ? order[next] : std::string("nothing")) +
                        "' comes next: every module once, stages in forward order (" + known + ")");
      ++next;
      spec.fqns.push_back(name);
      if (name == "tok_embeddings") spec.has_embeddings = true;
      if (name == "norm" || name == "output") spec.has_head = true;
      if (name.rfind("layers.", 0) == 0) {
        const int64_t l = static_cast<int64_t>(it->second) - 1;
        if (spec.first_layer < 0) spec.first_layer = l;
        spec.end_layer = l + 1;
      }
    }
    if (spec.first_layer < 0)  // no layers: an empty range where the layers would be
      spec.first_layer = spec.end_layer = spec.has_embeddings ? 0 : n_layers;
    const bool norm = std::find(spec.fqns.begin(), spec.fqns.end(), "norm") != spec.fqns.end();
    const bool output = std::find(spec.fqns.begin(), spec.fqns.end(), "output") != spec.fqns.end();
    if (norm != output)
      throw UserError(where + " holds '" + (norm ? "norm" : "output") + "' without '" +
                      (norm ? "output" : "norm") +
                      "': the final norm and the output projection stay in one stage");
    specs.push_back(std::move(spec));
  }
  if (next != order.size())
    throw UserError(who + " leaves out '" + order[next] + "' and what follows it (" + known +
                    "): every module must be in one stage");
  return specs;
}

// pipeline_llm's number of stages: from layers_per_stage when given, else 1 per rank for a
// single-stage schedule and 2 for the others.
int64_t count_stages(int64_t n_layers, const PipelineSplitOptions& opt, const ScheduleInfo& info) {
  const int64_t p = opt.pp_degree;
  if (opt.layers_per_stage == 0) return p * (info.single_stage ? 1 : 2);
  const int64_t lps = opt.layers_per_stage;
  const int64_t weighted = n_layers + opt.first_stage_less_layers + opt.last_stage_less_layers;
  const int64_t stages = (weighted + lps - 1) / lps;
  const std::string what =
      "the model's " + str(n_layers) + " layers + " + str(opt.first_stage_less_layers) +
      " (embeddings) + " + str(opt.last_stage_less_layers) + " (norm and output) at " +
      kLayersPerStageKey + " = " + str(lps) + " make " + str(stages) + " stages";
  if (stages % p != 0)
    throw UserError(what + ", which " + kDegreeKey + " = " + str(p) +
                    " does not divide; pick a layers_per_stage that gives a multiple of " + str(p) +
                    " stages");
  const int64_t per_rank = stages / p;
  if (info.single_stage && per_rank != 1)
    throw UserError(what + ", " + str(per_rank) + " per rank, but " + info.name +
                    " runs exactly 1 stage per rank; raise " + kLayersPerStageKey);
  if (!info.single_stage && per_rank < 2)
    throw UserError(what + ", 1 per rank, but " + info.name +
                    " needs at least 2 stages per rank; lower " + kLayersPerStageKey);
  return stages;
}

}  // namespace

std::vector<std::vector<std::string>> generate_stage_fqns(int64_t num_stages, int64_t n_layers,
                                                          int64_t input_weight,
                                                          int64_t output_weight) {
  if (num_stages < 1) throw UserError(std::string(kDegreeKey) + ": at least 1 stage is needed");
  if (num_stages == 1) return {forward_order(n_layers)};
  const int64_t weighted = n_layers + input_weight + output_weight;
  const std::string sizes = str(num_stages) + " stages over " + str(n_layers) + " layers + " +
                            str(input_weight) + " (" + kFirstKey + ") + " + str(output_weight) +
                            " (" + kLastKey + ") = " + str(weighted) + " weighted layers";
  if (num_stages > weighted)
    throw UserError(sizes + ": more stages than weighted layers; lower " + kDegreeKey + " or " +
                    kLayersPerStageKey);
  const int64_t per_stage = weighted / num_stages;
  const int64_t extra = weighted % num_stages;
  if (input_weight > per_stage)
    throw UserError(sizes + ": " + kFirstKey + " = " + str(input_weight) +
                    " exceeds the fewest weighted layers a stage gets (" + str(per_stage) + ")");
  if (output_weight > per_stage)
    throw UserError(sizes + ": " + kLastKey + " = " + str(output_weight) +
                    " exceeds the fewest weighted layers a stage gets (" + str(per_stage) + ")");
  std::vector<std::vector<std::string>> out;
  int64_t layer = 0;
  for (int64_t s = 0; s < num_stages; ++s) {
    std::vector<std::string> names;
    int64_t take = per_stage + (s < extra ? 1 : 0);
    if (s == 0) {
      names.push_back("tok_embeddings");
      take -= input_weight;
    } else if (s == num_stages - 1) {
      take -= output_weight;
    }
    for (int64_t i = 0; i < take && layer < n_layers; ++i) names.push_back(layer_name(layer++));
    if (s == num_stages - 1) {
      names.push_back("norm");
      names.push_back("output");
    }
    out.push_back(std::move(names));
  }
  return out;
}

std::vector<int64_t> PipelineStagePlan::stage_to_rank() const {
  std::vector<int64_t> out;
  for (const auto& s : stages) out.push_back(s.rank);
  return out;
}

std::vector<int64_t> PipelineStagePlan::stages_of_rank(int64_t rank) const {
  if (schedule.v_style) return {rank, num_stages() - 1 - rank};
  std::vector<int64_t> out;
  for (int64_t k = 0; k < stages_per_rank; ++k) out.push_back(rank + k * pp_degree);
  return out;
}

PipelineStagePlan plan_pipeline_stages(int64_t n_layers, const PipelineSplitOptions& opt) {
  PipelineStagePlan plan;
  plan.schedule = schedule_info(opt.schedule);
  plan.pp_degree = opt.pp_degree;
  const int64_t p = opt.pp_degree;
  if (p < 1) throw UserError(std::string(kDegreeKey) + " = " + str(p) + " must be at least 1");
  if (n_layers < 1) throw UserError("pipeline stages: the model has no transformer layers");
  if (opt.first_stage_less_layers < 0)
    throw UserError(std::string(kFirstKey) + " = " + str(opt.first_stage_less_layers) +
                    " must be 0 or more");
  if (opt.last_stage_less_layers < 0)
    throw UserError(std::string(kLastKey) + " = " + str(opt.last_stage_less_layers) +
                    " must be 0 or more");
  if (opt.layers_per_stage < 0)
    throw UserError(std::string(kLayersPerStageKey) + " = " + str(opt.layers_per_stage) +
                    " must be at least 1 (or unset)");
  const int64_t counted = count_stages(n_layers, opt, plan.schedule);
  const bool explicit_split = !opt.module_fqns_per_model_part.empty();
  const auto fqns = explicit_split
                        ? opt.module_fqns_per_model_part
                        : generate_stage_fqns(counted, n_layers, opt.first_stage_less_layers,
                                              opt.last_stage_less_layers);
  const std::string who = explicit_split ? std::string(kFqnsKey) : "the generated split";
  plan.stages = specs_from_fqns(fqns, n_layers, who);
  const int64_t S = plan.num_stages();
  const std::string split = (explicit_split ? std::string(kFqnsKey) : std::string("the split")) +
                            " gives " + str(S) + " stages";
  if (S % p != 0)
    throw UserError(split + ", which " + kDegreeKey + " = " + str(p) + " does not divide");
  plan.stages_per_rank = S / p;
  if (plan.schedule.v_style && plan.stages_per_rank != 2)
    throw UserError(split + " over " + str(p) +
                    " ranks, but parallelism.pipeline_parallel_schedule = " + plan.schedule.name +
                    " needs exactly 2 stages per rank (stages r and 2p-1-r)");
  if (plan.schedule.single_stage && plan.stages_per_rank != 1)
    throw UserError(split + " over " + str(p) +
                    " ranks, but parallelism.pipeline_parallel_schedule = " + plan.schedule.name +
                    " runs exactly 1 stage per rank");
  const auto ranks = pipeline_stage_ranks(p, S, plan.schedule.v_style);
  for (int64_t s = 0; s < S; ++s) plan.stages[s].rank = ranks[s];
  return plan;
}

}  // namespace titan
