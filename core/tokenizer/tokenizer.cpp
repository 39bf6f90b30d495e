#include "core/tokenizer/tokenizer.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "core/base/errors.h"
#include "core/tokenizer/tokenizer_hf.h"

namespace titan {

// ---- Byte tokenizer ------------------------------------------------------------------------

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<uint8_t>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size())
      throw std::out_of_range("byte tokenizer: id " + std::to_string(id) +
                              " is outside the vocabulary [0, 258)");
    if (id < 256) out.push_back(static_cast<char>(id));
  }
  return out;
}

std::vector<int32_t> encode_document(const Tokenizer& tok, std::string_view text, bool bos,
                                     bool eos) {
  if ((bos && tok.bos_id() < 0) || (eos && tok.eos_id() < 0))
    throw UserError(std::string("the tokenizer has no ") +
                    (bos && tok.bos_id() < 0 ? "BOS" : "EOS") +
                    " token (looked for bos_token/eos_token in a tokenizer_config.json beside it, "
                    "then for <|begin_of_text|>/<|end_of_text|>, <s>/</s>, <bos>/<eos> and "
                    "<|endoftext|>)");
  std::vector<int32_t> ids = tok.encode(text);
  if (bos) ids.insert(ids.begin(), tok.bos_id());
  if (eos) ids.push_back(tok.eos_id());
  return ids;
}

const std::string& byte_level_char(uint8_t byte) {
  return tok::byte_level_table()[byte];
}

namespace {

// `hint` ends the message when the file cannot be opened.
std::string read_text_file(const std::string& path, const char* what, const char* hint) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UserError(std::string(what) + " '" + path + "': cannot be read (it is a folder)" +
                    hint);
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw UserError(std::string(what) + " '" + path + "': cannot be read (" +
                    std::strerror(errno) + ")" + hint);
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad())
    throw UserError(std::string(what) + " '" + path + "': cannot be read (" +
                    std::strerror(errno) + ")");
  return ss.str();
}

template <typename Json>
Json parse_json(const std::string& text, const std::string& path, const char* what) {
  try {
    return Json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    std::string msg = e.what();
    auto p = msg.find("] ");
    if (p != std::string::npos) msg = msg.substr(p + 2);
    throw UserError(std::string(what) + " '" + path + "': not valid JSON at byte " +
                    std::to_string(e.byte) + " (" + msg + ")");
  }
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  if (path == "bytes") return std::make_unique<ByteTokenizer>();
  const char* hint = "; give an existing tokenizer.json file or \"bytes\"";
  auto doc = parse_json<nlohmann::json>(read_text_file(path, "tokenizer file", hint), path,
                                        "tokenizer file");
  // torchtitan's layout (hf_assets_path) keeps tokenizer_config.json beside tokenizer.json.
  std::filesystem::path config_path = std::filesystem::path(path).parent_path() /
                                      "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(config_path, ec))
    return tok::make_hf_tokenizer(doc, path, nullptr, "");
  auto config = parse_json<nlohmann::ordered_json>(
      read_text_file(config_path.string(), "tokenizer config", ""), config_path.string(),
      "tokenizer config");
  return tok::make_hf_tokenizer(doc, path, &config, config_path.string());
}

}  // namespace titan
