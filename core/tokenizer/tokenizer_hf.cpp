// A Hugging Face tokenizer.json as one Tokenizer: added tokens (tokenizer_added.cpp),
// normalizer, pre-tokenizers, BPE model and decoder (tokenizer_decoders.cpp) wired as HF
// `tokenizers` 0.23 wires them (tokenizer/mod.rs).
#include <algorithm>
#include <stdexcept>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_hf.h"

namespace titan::tok {

// ---- The tokenizer ----------------------------------------------------------------------------

namespace {

class HfTokenizer : public Tokenizer {
 public:
  HfTokenizer(const json& doc, const std::string& path, const nlohmann::ordered_json* config,
              const std::string& config_path);
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override {
    return std::max(model_->max_id_plus_one(), added_.max_id_plus_one());
  }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }

 private:
  void parse_added_tokens(const json& added);
  void apply_config(const nlohmann::ordered_json& config, const std::string& config_path);
  int32_t token_to_id(const std::string& s) const {
    int32_t id = added_.find(s);
    return id >= 0 ? id : model_->token_to_id(s);
  }
  int32_t find_any(std::initializer_list<const char*> names) const;
  void encode_plain(std::string_view text, bool origin, std::vector<int32_t>& out) const;
  void run_stage(size_t stage, const Piece& p, std::vector<int32_t>& out) const;

  Ctx ctx_;  // first member: the model keeps a pointer to it
  std::unique_ptr<Normalizer> normalizer_;
  std::vector<std::unique_ptr<PreTokenizer>> stages_;
  std::unique_ptr<BpeModel> model_;
  AddedVocab added_;
  std::unique_ptr<Decoder> decoder_;
  int32_t bos_ = -1, eos_ = -1;
};

HfTokenizer::HfTokenizer(const json& doc, const std::string& path,
                         const nlohmann::ordered_json* config, const std::string& config_path)
    : ctx_{path} {
  if (!doc.is_object())
    ctx_.fail("expected a JSON object at the top level, found " + describe(doc));
  if (!doc.contains("model") || !doc["model"].is_object())
    ctx_.fail("no \"model\" object; a Hugging Face tokenizer.json has one with type \"BPE\"");
  const json& model = doc["model"];
  std::string type = model.contains("type") ? ctx_.get_string(model, "type", "", "model") : "";
  // HF reads a model without "type" that has vocab and merges as BPE (older files).
  if (type != "BPE" && !(type.empty() && model.contains("merges")))
    ctx_.fail("model.type is " + (model.contains("type") ? describe(model["type"]) : "missing") +
              "; only \"BPE\" is supported (WordPiece, Unigram and WordLevel are not)");
  model_ = std::make_unique<BpeModel>(model, ctx_);
  auto field = [&](const char* key) { return doc.contains(key) ? doc[key] : json(); };
  normalizer_ = parse_normalizer(field("normalizer"), ctx_, "normalizer");
  parse_pre_tokenizer(field("pre_tokenizer"), ctx_, "pre_tokenizer", stages_);
  decoder_ = parse_decoder(field("decoder"), ctx_, "decoder");
  parse_added_tokens(doc.contains("added_tokens") ? doc["added_tokens"] : json::array());
  if (config) apply_config(*config, config_path);
  // Without a tokenizer_config.json naming them, the usual names of each family: Llama-3,
  // Llama-2 / Mistral, Gemma, GPT-2 (whose <|endoftext|> is both).
  if (!config || !config->contains("bos_token"))
    bos_ = find_any({"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"});
  if (!config || !config->contains("eos_token"))
    eos_ = find_any({"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"});
}

int32_t HfTokenizer::find_any(std::initializer_list<const char*> names) const {
  for (const char* n : names)
    if (added_.find(n) >= 0) return added_.find(n);
  for (const char* n : names)
    if (model_->token_to_id(n) >= 0) return model_->token_to_id(n);
  return -1;
}

void HfTokenizer::parse_added_tokens(const json& added) {
  if (!added.is_array()) ctx_.fail("added_tokens must be an array, found " + describe(added));
  std::vector<AddedToken> tokens;
  for (size_t i = 0; i < added.size(); ++i) {
    const json& a = added[i];
    std::string where = "added_tokens[" + std::to_string(i) + "]";
    if (!a.is_object() || !a.contains("content") || !a["content"].is_string())
      ctx_.fail(where + " = " + describe(a) + "; expected an object with a string \"content\"");
    if (a.contains("id") && !valid_token_id(a["id"]))
      ctx_.fail(where + ".id = " + describe(a["id"]) + "; " + kTokenIdRule);
    AddedToken t;
    t.content = a["content"].get<std::string>();
    t.special = ctx_.get_bool(a, "special", false, where);
    t.single_word = ctx_.get_bool(a, "single_word", false, where);
    t.lstrip = ctx_.get_bool(a, "lstrip", false, where);
    t.rstrip = ctx_.get_bool(a, "rstrip", false, where);
    t.normalized = ctx_.get_bool(a, "normalized", !t.special, where);
    tokens.push_back(std::move(t));
  }
  // HF assigns the ids itself (the "id" fields only warn when they differ): a content the
  // model knows keeps the model's id, others follow the model vocabulary in file order.
  added_.add(tokens, *model_, normalizer_.get());
}

// torchtitan's HuggingFaceTokenizer._infer_special_tokens: the config's bos/eos/pad/unk/
// sep/cls/mask tokens and its added_tokens_decoder entries are added as special tokens.
void HfTokenizer::apply_config(const nlohmann::ordered_json& config,
                               const std::string& config_path) {
  auto bad = [&](const std::string& what) { Ctx{config_path}.fail(what); };
  if (!config.is_object()) bad("expected a JSON object at the top level");
  auto content_of = [&](const nlohmann::ordered_json& v, const std::string& key) {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string())
      return v["content"].get<std::string>();
    bad(key + " must be a string or an object with a string \"content\", found " +
        v.dump().substr(0, 60));
    return std::string();
  };
  auto token_of = [&](const nlohmann::ordered_json& v, const std::string& key) {
    AddedToken t;
    t.content = content_of(v, key);
    t.special = true;
    t.normalized = false;
    if (v.is_object()) {
      auto flag = [&](const char* k, bool def) {
        return v.contains(k) && v[k].is_boolean() ? v[k].get<bool>() : def;
      };
      t.single_word = flag("single_word", false);
      t.lstrip = flag("lstrip", false);
      t.rstrip = flag("rstrip", false);
      t.normalized = flag("normalized", true);
    }
    return t;
  };
  std::vector<AddedToken> tokens;
  for (const char* key :
       {"bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"})
    if (config.contains(key) && !config[key].is_null())
      tokens.push_back(token_of(config[key], key));
  if (config.contains("added_tokens_decoder") && config["added_tokens_decoder"].is_object())
    for (auto& [id, v] : config["added_tokens_decoder"].items())
      if (v.is_object() && v.contains("content"))
        tokens.push_back(token_of(v, "added_tokens_decoder[" + id + "]"));
  if (!tokens.empty()) added_.add(tokens, *model_, normalizer_.get());
  auto special = [&](const char* key) {
    if (!config.contains(key) || config[key].is_null()) return -1;
    return token_to_id(content_of(config[key], key));
  };
  bos_ = special("bos_token");
  eos_ = special("eos_token");
}

// HF's pipeline: split on the added tokens that skip normalization, normalize each plain
// piece, split it on the normalized added tokens, pre-tokenize, and run the model.
std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  auto raw_piece = [&](std::string_view seg, int32_t id, size_t offset) {
    if (id >= 0) {
      out.push_back(id);
      return;
    }
    std::string norm;
    std::string_view s = seg;
    if (normalizer_) {
      normalizer_->apply(seg, norm);
      s = norm;
    }
    if (!added_.has_normalized()) {
      encode_plain(s, offset == 0, out);
      return;
    }
    added_.split(s, true, [&](std::string_view s2, int32_t id2, size_t off2) {
      if (id2 >= 0)
        out.push_back(id2);
      else
        encode_plain(s2, offset == 0 && off2 == 0, out);
    });
  };
  if (added_.has_raw())
    added_.split(text, false, raw_piece);
  else if (!text.empty())
    raw_piece(text, -1, 0);
  return out;
}

void HfTokenizer::encode_plain(std::string_view text, bool origin,
                               std::vector<int32_t>& out) const {
  if (!text.empty()) run_stage(0, Piece{text, origin, false}, out);
}

void HfTokenizer::run_stage(size_t stage, const Piece& p, std::vector<int32_t>& out) const {
  if (stage == stages_.size()) {
    model_->tokenize(p, out);
    return;
  }
  stages_[stage]->run(p, [&](Piece q) {
    if (!q.text.empty()) run_stage(stage + 1, q, out);
  });
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* s = added_.decode_string(id);
    if (!s) s = model_->id_to_token(id);
    if (!s)
      throw std::out_of_range("tokenizer '" + ctx_.path + "': id " + std::to_string(id) +
                              " is not in the vocabulary (size " + std::to_string(vocab_size()) +
                              ")");
    tokens.push_back(*s);
  }
  std::string out;
  if (decoder_) {
    decoder_->chain(tokens);
    for (const std::string& t : tokens) out += t;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
  }
  return out;
}

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const json& doc, const std::string& path,
                                             const nlohmann::ordered_json* config,
                                             const std::string& config_path) {
  return std::make_unique<HfTokenizer>(doc, path, config, config_path);
}

}  // namespace titan::tok
