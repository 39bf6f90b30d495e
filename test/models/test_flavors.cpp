// Every llama3, llama4, deepseek_v3, qwen3 and gpt_oss flavor against torchtitan 0.2.2's own flavor
// tables (test/reference/torchtitan_flavors.py reads them from the installed torchtitan package).
// Each field must be equal: these are constants, so the tolerance is 0 (doubles compare
// exactly after a JSON round trip). Known, documented differences are listed below and
// checked to be exactly those, so a change on either side shows up here.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <set>

#include "core/config/config.h"
#include "models/deepseek_v3.h"
#include "models/gpt_oss.h"
#include "models/llama3.h"
#include "models/llama4.h"
#include "models/qwen3.h"
#include "test_util.h"

using namespace titan;
using nlohmann::json;

namespace {

// Flavors torchtitan 0.2.2 does not ship: Llama-3.2 1B and 3B.
const std::set<std::string> kOnlyInTitan = {"llama3/1B", "llama3/3B"};
// Fields that differ on purpose. torchtitan replaces max_seq_len by training.seq_len (only
// warning when longer); titan-train's llama3 sizes its RoPE table by it and rejects longer
// runs, so its debug model keeps a small table.
const std::set<std::pair<std::string, std::string>> kDifferent = {
    {"llama3/debugmodel", "max_seq_len"},
    {"llama3/debugmodel_flex_attn", "max_seq_len"},
    {"llama3/debugmodel_varlen_attn", "max_seq_len"}};

json rope(const RopeScaling& r) {
  if (r.factor == 1.0) return {{"rope_factor", 1.0}};
  return {{"rope_factor", r.factor},
          {"rope_low_freq_factor", r.low_freq_factor},
          {"rope_high_freq_factor", r.high_freq_factor},
          {"rope_original_max_seq_len", r.original_max_seq_len}};
}

template <class A>
json attention(const A& a) {
  return {{"attn_type", attn_type_name(a.attn_type)},
          {"attn_mask_type", attn_mask_name(a.attn_mask)}};
}

template <class A>
json llama_common(const A& a) {
  json j = {{"dim", a.dim},
            {"n_layers", a.n_layers},
            {"n_heads", a.n_heads},
            {"n_kv_heads", a.n_kv_heads},
            {"vocab_size", a.vocab_size},
            {"multiple_of", a.multiple_of},
            {"ffn_dim_multiplier", a.ffn_dim_multiplier},
            {"norm_eps", a.norm_eps},
            {"rope_theta", a.rope_theta},
            {"depth_init", a.depth_init}};
  j.update(rope(a.rope_scaling));
  j.update(attention(a));
  return j;
}

// load_balance_coeff is a run option here (moe.load_balance_coeff), a model arg there.
json moe(const MoEArgs& m) {
  return {{"num_experts", m.num_experts},
          {"num_shared_experts", m.num_shared_experts},
          {"top_k", m.top_k},
          {"score_func", m.score_func == ScoreFunc::Softmax ? "softmax" : "sigmoid"},
          {"route_norm", m.route_norm},
          {"route_scale", m.route_scale},
          {"gate_bias", m.gate_bias},
          {"score_before_experts", m.score_before_experts},
          {"num_expert_groups", m.num_expert_groups},
          {"num_limited_groups", m.num_limited_groups},
          {"load_balance_coeff", default_config().moe.load_balance_coeff}};
}

// llama4 and deepseek_v3 take max_seq_len from the run (build_model, like torchtitan's
// update_from_config), so it is no flavor constant there and is not compared.
std::map<std::string, json> titan_flavors() {
  std::map<std::string, json> out;
  for (auto& f : llama3_flavor_names()) {
    Llama3Args a = llama3_flavor(f);
    json j = llama_common(a);
    j["tie_embeddings"] = a.tie_embeddings;
    j["max_seq_len"] = a.max_seq_len;
    out["llama3/" + f] = j;
  }
  for (auto& f : llama4_flavor_names()) {
    Llama4Args a = llama4_flavor(f);
    json j = llama_common(a);
    j["interleave_moe_layer_step"] = a.interleave_moe_layer_step;
    j["auto_scale_hidden_dim"] = a.auto_scale_hidden_dim;
    j.update(moe(a.moe));
    if (a.every_n_layers_nope > 0) {
      j["every_n_layers_nope"] = a.every_n_layers_nope;
      j["fixed_attn_block_size"] = a.fixed_attn_block_size;
    }
    out["llama4/" + f] = j;
  }
  for (auto& f : deepseek_v3_flavor_names()) {
    DeepSeekV3Args a = deepseek_v3_flavor(f);
    json j = {{"vocab_size", a.vocab_size},
              {"dim", a.dim},
              {"inter_dim", a.inter_dim},
              {"moe_inter_dim", a.moe_inter_dim},
              {"n_layers", a.n_layers},
              {"n_dense_layers", a.n_dense_layers},
              {"n_heads", a.n_heads},
              {"q_lora_rank", a.q_lora_rank},
              {"kv_lora_rank", a.kv_lora_rank},
              {"qk_nope_head_dim", a.qk_nope_head_dim},
              {"qk_rope_head_dim", a.qk_rope_head_dim},
              {"v_head_dim", a.v_head_dim},
              {"original_seq_len", a.original_seq_len},
              {"norm_eps", a.norm_eps},
              {"rope_theta", a.rope_theta},
              {"rope_factor", a.rope_factor},
              {"beta_fast", a.beta_fast},
              {"beta_slow", a.beta_slow},
              {"mscale", a.mscale}};
    j.update(moe(a.moe));
    j.update(attention(a));
    out["deepseek_v3/" + f] = j;
  }
  // qwen3's max_seq_len is the flavor's here too (build_model then takes the run's, as
  // torchtitan's update_from_config does), so it is compared.
  for (auto& f : qwen3_flavor_names()) {
    Qwen3Args a = qwen3_flavor(f);
    json j = {{"dim", a.dim},
              {"n_layers", a.n_layers},
              {"n_heads", a.n_heads},
              {"n_kv_heads", a.n_kv_heads},
              {"vocab_size", a.vocab_size},
              {"head_dim", a.head_dim},
              {"hidden_dim", a.hidden_dim},
              {"qk_norm", a.qk_norm},
              {"max_seq_len", a.max_seq_len},
              {"depth_init", a.depth_init},
              {"moe_enabled", a.moe_enabled},
              {"moe_inter_dim", a.moe_inter_dim},
              {"norm_eps", a.norm_eps},
              {"rope_theta", a.rope_theta},
              {"tie_embeddings", a.tie_embeddings},
              // Every qwen3 flavor of 0.2.2 is SDPA with the causal mask; model.attn_mask_type
              // overrides it as for the other families.
              {"attn_type", "sdpa"},
              {"attn_mask_type", "causal"}};
    if (a.moe_enabled) j.update(moe(a.moe));
    out["qwen3/" + f] = j;
  }
  // gpt_oss's max_seq_len as qwen3's: the flavor's, compared (build_model takes the run's).
  for (auto& f : gpt_oss_flavor_names()) {
    GptOssArgs a = gpt_oss_flavor(f);
    json j = {{"max_seq_len", a.max_seq_len},
              {"vocab_size", a.vocab_size},
              {"dim", a.dim},
              {"moe_inter_dim", a.moe_inter_dim},
              {"n_layers", a.n_layers},
              {"head_dim", a.head_dim},
              {"n_heads", a.n_heads},
              {"n_kv_heads", a.n_kv_heads},
              {"sliding_window_size", a.sliding_window_size},
              {"original_seq_len", a.original_seq_len},
              {"norm_eps", a.norm_eps},
              {"swiglu_limit", a.swiglu_limit},
              {"rope_theta", a.rope_theta},
              {"rope_factor", a.rope_factor},
              {"ntk_alpha", a.ntk_alpha},
              {"ntk_beta", a.ntk_beta}};
    j.update(moe(a.moe));
    j.update(attention(a));
    out["gpt_oss/" + f] = j;
  }
  return out;
}

}  // namespace

TEST_CASE("flavors: every flavor equals torchtitan 0.2.2's model args", "[flavors]") {
  auto r = test::run(test::python() + " " + test::source_dir() +
                     "/test/reference/torchtitan_flavors.py");
  INFO(r.out.substr(0, 2000));
  REQUIRE(r.rc == 0);
  const json ref = json::parse(r.out);
  CHECK(ref["torchtitan"] == "0.2.2");
  const auto ours = titan_flavors();

  int compared = 0;
  std::set<std::pair<std::string, std::string>> different;
  for (auto& [name, theirs] : ref["flavors"].items()) {
    INFO(name);
    // Every flavor exists here, its attention variants included.
    auto it = ours.find(name);
    REQUIRE(it != ours.end());
    for (auto& [field, value] : theirs.items()) {
      INFO(field << ": torchtitan " << value.dump() << ", titan-train "
                 << (it->second.contains(field) ? it->second[field].dump() : "(missing)"));
      if (kDifferent.count({name, field})) {
        if (it->second.contains(field) && it->second[field] != value)
          different.insert({name, field});
        continue;
      }
      CHECK((it->second.contains(field) && it->second[field] == value));
    }
    for (auto& [field, value] : it->second.items()) {
      INFO(field << " = " << value.dump() << " has no torchtitan counterpart");
      CHECK(theirs.contains(field));
    }
    ++compared;
  }
  CHECK(different == kDifferent);
  std::set<std::string> only_ours;
  for (auto& [name, j] : ours)
    if (!ref["flavors"].contains(name)) only_ours.insert(name);
  CHECK(only_ours == kOnlyInTitan);
  CHECK(compared == static_cast<int>(ours.size() - kOnlyInTitan.size()));
}
