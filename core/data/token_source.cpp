#include "core/data/token_source.h"

#include <glob.h>
#include <signal.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>

#include "core/base/errors.h"
#include "core/base/strings.h"

namespace titan {
namespace fs = std::filesystem;

const char* token_format_name(TokenFormat f) {
  switch (f) {
    case TokenFormat::Tok: return "tok v2";
    case TokenFormat::Megatron: return "megatron";
    case TokenFormat::LlmC: return "llm.c";
  }
  return "?";
}

namespace {

// ---- A shard truncated under a read ---------------------------------------------------------
// read() checks each shard's file before copying from its mapping, but a truncation between
// the check and the copy still makes the lost pages raise SIGBUS. This handler turns that
// into the same one-line error naming the file, exit 2, instead of a bare "Bus error".
thread_local const std::string* t_reading = nullptr;

void write_all(const char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = ::write(2, p, n);
    if (k <= 0) return;
    p += k, n -= static_cast<size_t>(k);
  }
}

void on_sigbus(int sig) {
  if (const std::string* path = t_reading) {
    static const char a[] = "titan-train: error: data file '";
    static const char b[] = "': truncated while it was being read (SIGBUS); the data files of a run must not change while it trains\n";
    write_all(a, sizeof a - 1);
    write_all(path->data(), path->size());
    write_all(b, sizeof b - 1);
    ::_exit(kExitUserError);
  }
  ::signal(sig, SIG_DFL);  // not ours: the default action (a core dump)
  ::raise(sig);
}

void install_sigbus_handler() {
  static const bool once = [] {
    struct sigaction sa {};
    sa.sa_handler = on_sigbus;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, nullptr);
    return true;
  }();
  (void)once;
}

struct ReadingGuard {
  explicit ReadingGuard(const std::string& path) { t_reading = &path; }
  ~ReadingGuard() { t_reading = nullptr; }
};

constexpr int32_t kLlmcMagic = 20240520;
constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kMegatronHeader = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, S, D
constexpr size_t kLlmcHeader = 256 * 4;
constexpr uint64_t kSpotChecks = 64;  // Megatron pointer-contiguity samples

const char* kAllowedSpecs =
    "allowed: a .tok v2 file, a Megatron .bin/.idx (or their common prefix), an llm.c .bin "
    "shard, a folder of one of these, or a glob";

std::string strip_ext(const std::string& s) { return s.substr(0, s.rfind('.')); }
bool is_file(const std::string& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The first bytes of a file, for messages: hex and their printable characters.
std::string first_bytes(const std::string& path, size_t n = 8) {
  std::ifstream f(path, std::ios::binary);
  std::string buf(n, '\0');
  f.read(buf.data(), static_cast<std::streamsize>(n));
  buf.resize(static_cast<size_t>(f.gcount()));
  if (buf.empty()) return "no bytes (empty file)";
  std::string hex, text;
  char h[4];
  for (unsigned char c : buf) {
    std::snprintf(h, sizeof h, "%02x ", c);
    hex += h;
    text += (c >= 32 && c < 127) ? static_cast<char>(c) : '.';
  }
  hex.pop_back();
  return "first bytes " + hex + " ('" + text + "')";
}

int32_t first_i32(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  int32_t v = 0;
  f.read(reinterpret_cast<char*>(&v), sizeof v);
  return f.gcount() == sizeof v ? v : 0;
}

struct Candidate {
  std::string path;  // the token file (.tok, .bin)
  TokenFormat format;
};

// Classifies one file. strict (a file named on its own): anything that is not a shard is an
// error. Otherwise (folder or glob members) files of other kinds are skipped.
std::optional<Candidate> classify(const std::string& p, bool strict) {
  if (ends_with(p, ".tok")) return Candidate{p, TokenFormat::Tok};
  if (ends_with(p, ".idx")) {
    const std::string bin = strip_ext(p) + ".bin";
    if (!is_file(bin))
      throw UserError("data file '" + p + "': Megatron index without its data file '" + bin +
                      "'; allowed: a PREFIX.bin + PREFIX.idx pair");
    return Candidate{bin, TokenFormat::Megatron};
  }
  if (ends_with(p, ".bin")) {
    if (is_file(strip_ext(p) + ".idx")) return Candidate{p, TokenFormat::Megatron};
    if (first_i32(p) == kLlmcMagic) return Candidate{p, TokenFormat::LlmC};
    throw UserError("data file '" + p + "': " + first_bytes(p) +
                    " are neither an llm.c shard header (int32 20240520) nor has it a Megatron "
                    "'.idx' sibling; allowed: an llm.c shard or a Megatron .bin/.idx pair");
  }
  if (!strict) return std::nullopt;
  if (is_raw_text_path(p))
    throw UserError("data file '" + p +
                    "': raw text, not token data; allowed here: pre-tokenized data (make it "
                    "with `titan-train tokenize`)");
  std::ifstream f(p, std::ios::binary);
  char magic[8] = {};
  f.read(magic, 8);
  if (f.gcount() == 8 && std::string(magic, 8) == "TITANTOK") return Candidate{p, TokenFormat::Tok};
  if (first_i32(p) == kLlmcMagic) return Candidate{p, TokenFormat::LlmC};
  throw UserError("data file '" + p + "': " + first_bytes(p) + " is no known token format; " +
                  kAllowedSpecs);
}

bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i)
      if (is_file(g.gl_pathv[i])) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  return out;
}

// The shards a spec names, sorted by path, one format.
std::vector<Candidate> resolve_spec(const std::string& spec) {
  std::vector<std::string> members;
  std::error_code ec;
  const bool glob = has_glob_chars(spec) && !fs::exists(spec, ec);
  if (glob) {
    members = glob_files(spec);
    if (members.empty())
      throw UserError("data path '" + spec + "': the glob matches no file; " + kAllowedSpecs);
  } else if (fs::is_directory(spec, ec)) {
    for (auto& e : fs::directory_iterator(spec, ec))
      if (e.is_regular_file() && e.path().filename().string()[0] != '.')
        members.push_back(e.path().string());
    if (members.empty())
      throw UserError("data folder '" + spec + "': is empty; " + kAllowedSpecs);
  } else if (is_file(spec)) {
    return {*classify(spec, true)};
  } else if (is_file(spec + ".bin") && is_file(spec + ".idx")) {
    return {Candidate{spec + ".bin", TokenFormat::Megatron}};
  } else {
    throw UserError("data path '" + spec + "': does not exist; " + kAllowedSpecs);
  }
  std::sort(members.begin(), members.end());
  std::vector<Candidate> out;
  std::set<std::string> seen;  // a Megatron pair is listed once
  for (auto& m : members) {
    auto c = classify(m, false);
    if (c && seen.insert(c->path).second) out.push_back(*c);
  }
  const std::string what = glob ? "the glob '" + spec + "'" : "data folder '" + spec + "'";
  if (out.empty())
    throw UserError(what + ": holds no token shards (.tok, .bin, .idx); " + kAllowedSpecs);
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.path < b.path; });
  for (auto& c : out)
    if (c.format != out[0].format)
      throw UserError(what + ": mixes formats ('" + out[0].path + "' is " +
                      token_format_name(out[0].format) + ", '" + c.path + "' is " +
                      token_format_name(c.format) + "); allowed: shards of one format");
  return out;
}

// ---- one shard per format -------------------------------------------------------------------

std::unique_ptr<TokenShard> open_tok(const std::string& path) {
  auto s = std::make_unique<TokenShard>();
  s->path = path;
  s->format = TokenFormat::Tok;
  s->file = MmapFile(path);
  const MmapFile& f = s->file;
  const size_t size = f.size();
  auto bad = [&](const std::string& why) {
    return UserError("token file '" + path + "': " + why);
  };
  if (size < 12 || std::string(reinterpret_cast<const char*>(f.data()), 8) != "TITANTOK")
    throw bad(first_bytes(path) + "; allowed: a .tok file starting with \"TITANTOK\"");
  const uint32_t version = f.load<uint32_t>(8);
  if (version == 1)
    throw bad("is .tok version 1, which is read whole into memory; allowed: version 2 — "
              "convert it with `titan-train tokenize --input " + path +
              " --output NEW.tok --tokenizer TOKENIZER.json` (the tokenizer that made it)");
  if (version != 2) throw bad("unknown .tok version " + std::to_string(version) + "; allowed: 2");
  if (size < kTokHeaderBytes)
    throw bad("truncated header (" + std::to_string(size) + " bytes; a .tok v2 header has 64)");
  const uint32_t width = f.load<uint32_t>(12);
  const uint64_t docs = f.load<uint64_t>(16), ntok = f.load<uint64_t>(24);
  const uint64_t vocab = f.load<uint64_t>(32), max_id = f.load<uint64_t>(40);
  const uint64_t off_at = f.load<uint64_t>(48), tok_at = f.load<uint64_t>(56);
  if (width != 2 && width != 4)
    throw bad("bytes per token " + std::to_string(width) + "; allowed: 2 or 4");
  if (off_at != kTokHeaderBytes)
    throw bad("offsets section at byte " + std::to_string(off_at) + "; allowed: 64");
  if (docs >= size / 8 || tok_at % kTokAlign != 0 || tok_at < off_at + 8 * (docs + 1))
    throw bad("header (" + std::to_string(docs) + " documents, tokens at byte " +
              std::to_string(tok_at) + ") does not fit the layout; the file is corrupt");
  if (ntok > size / width || tok_at + ntok * width != size)
    throw bad("size " + std::to_string(size) + " bytes, but the header's " +
              std::to_string(ntok) + " tokens of " + std::to_string(width) + " bytes at byte " +
              std::to_string(tok_at) + " need " + std::to_string(tok_at + ntok * width) +
              " (truncated?)");
  if (f.load<uint64_t>(off_at) != 0 || f.load<uint64_t>(off_at + 8 * docs) != ntok)
    throw bad("document offsets do not run from 0 to the token count " + std::to_string(ntok));
  if (ntok > 0 && max_id >= vocab)
    throw bad("header max token id " + std::to_string(max_id) + " is not below its vocabulary " +
              std::to_string(vocab) + "; the file is corrupt");
  s->dtype = width == 2 ? TokenDtype::U16 : TokenDtype::U32;
  s->item_size = static_cast<int>(width);
  s->data_offset = tok_at;
  s->num_tokens = static_cast<int64_t>(ntok);
  s->num_docs = static_cast<int64_t>(docs);
  s->max_id = ntok > 0 ? static_cast<int64_t>(max_id) : -1;
  s->doc_offsets_at = off_at;
  return s;
}

// Megatron dtype code -> (dtype, bytes); false for the float codes and unknown codes.
bool megatron_dtype(uint8_t code, TokenDtype& dt, int& bytes) {
  switch (code) {
    case 1: dt = TokenDtype::U8, bytes = 1; return true;
    case 2: dt = TokenDtype::I8, bytes = 1; return true;
    case 3: dt = TokenDtype::I16, bytes = 2; return true;
    case 4: dt = TokenDtype::I32, bytes = 4; return true;
    case 5: dt = TokenDtype::I64, bytes = 8; return true;
    case 8: dt = TokenDtype::U16, bytes = 2; return true;
    default: return false;
  }
}

// Reads the .idx header and checks it against the .bin in O(1) plus kSpotChecks samples of
// pointer contiguity, so a stream offset p is .bin byte p * itemsize.
std::unique_ptr<TokenShard> open_megatron(const std::string& bin) {
  auto s = std::make_unique<TokenShard>();
  const std::string idx = strip_ext(bin) + ".idx";
  s->path = bin;
  s->format = TokenFormat::Megatron;
  s->index = MmapFile(idx);
  const MmapFile& x = s->index;
  auto bad = [&](const std::string& why) {
    return UserError("Megatron index '" + idx + "': " + why);
  };
  if (x.size() < 9 || std::memcmp(x.data(), kMegatronMagic, 9) != 0)
    throw bad(first_bytes(idx, 9) + "; allowed: a Megatron .idx starting with \"MMIDIDX\\0\\0\"");
  if (x.size() < kMegatronHeader)
    throw bad("truncated header (" + std::to_string(x.size()) + " bytes; the header has 34)");
  const uint64_t version = x.load<uint64_t>(9);
  if (version != 1) throw bad("unknown version " + std::to_string(version) + "; allowed: 1");
  const uint8_t code = x.load<uint8_t>(17);
  if (!megatron_dtype(code, s->dtype, s->item_size)) {
    const std::string name = code == 6 ? " (float64)" : code == 7 ? " (float32)" : "";
    throw bad("dtype code " + std::to_string(code) + name +
              "; allowed token dtypes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16");
  }
  const uint64_t S = x.load<uint64_t>(18), D = x.load<uint64_t>(26);
  const uint64_t cap = x.size();
  const uint64_t need = (S < cap && D < cap) ? kMegatronHeader + 12 * S + 8 * D : ~0ull;
  // Multimodal indices append one int8 mode per sequence; the modes are not used here.
  if (need == ~0ull || (cap != need && cap != need + S))
    throw bad("size " + std::to_string(cap) + " bytes, but its " + std::to_string(S) +
              " sequences and " + std::to_string(D) + " document indices need " +
              (need == ~0ull ? std::string("more") : std::to_string(need)));
  s->megatron_seqs = static_cast<int64_t>(S);
  s->pointers_at = kMegatronHeader + 4 * S;
  s->doc_indices_at = s->pointers_at + 8 * S;
  if (D < 1 || x.load<int64_t>(s->doc_indices_at) != 0 ||
      x.load<int64_t>(s->doc_indices_at + 8 * (D - 1)) != static_cast<int64_t>(S))
    throw bad("document indices do not run from 0 to the sequence count " + std::to_string(S));
  s->file = MmapFile(bin);
  const int64_t bin_size = static_cast<int64_t>(s->file.size());
  const int64_t item = s->item_size;
  auto size_at = [&](uint64_t i) { return static_cast<int64_t>(x.load<int32_t>(kMegatronHeader + 4 * i)); };
  auto ptr_at = [&](uint64_t i) { return x.load<int64_t>(s->pointers_at + 8 * i); };
  if (S == 0) {
    if (bin_size != 0)
      throw UserError("Megatron data '" + bin + "': " + std::to_string(bin_size) +
                      " bytes, but its index '" + idx + "' lists no sequence");
  } else {
    if (ptr_at(0) != 0) throw bad("first sequence pointer is " + std::to_string(ptr_at(0)) + "; allowed: 0");
    const int64_t end = ptr_at(S - 1) + size_at(S - 1) * item;
    if (end != bin_size)
      throw UserError("Megatron data '" + bin + "': " + std::to_string(bin_size) +
                      " bytes, but its index '" + idx + "' says the last sequence ends at byte " +
                      std::to_string(end) + (end > bin_size ? " (truncated .bin?)" : ""));
    // Contiguity of pairs (i, i + 1): all of them when there are at most kSpotChecks, else
    // the last pair, evenly spread ones and some keyed by S.
    const uint64_t pairs = S - 1;
    const uint64_t checks = std::min<uint64_t>(pairs, kSpotChecks);
    uint64_t h = S * 0x9E3779B97F4A7C15ull;
    for (uint64_t k = 0; k < checks; ++k) {
      h ^= h >> 29, h *= 0xBF58476D1CE4E5B9ull, h ^= h >> 32;
      const uint64_t i = pairs <= kSpotChecks ? k
                         : k == 0             ? pairs - 1
                         : k % 2              ? pairs * k / kSpotChecks
                                              : h % pairs;
      const int64_t len = size_at(i);
      if (len < 0 || ptr_at(i + 1) != ptr_at(i) + len * item)
        throw bad("sequence " + std::to_string(i) + " (pointer " + std::to_string(ptr_at(i)) +
                  ", " + std::to_string(len) + " tokens) and sequence " + std::to_string(i + 1) +
                  " (pointer " + std::to_string(ptr_at(i + 1)) +
                  ") are not contiguous in the .bin; allowed: back-to-back sequences");
    }
  }
  s->num_tokens = bin_size / item;
  s->num_docs = static_cast<int64_t>(D) - 1;
  return s;
}

std::unique_ptr<TokenShard> open_llmc(const std::string& path) {
  auto s = std::make_unique<TokenShard>();
  s->path = path;
  s->format = TokenFormat::LlmC;
  s->file = MmapFile(path);
  const MmapFile& f = s->file;
  auto bad = [&](const std::string& why) { return UserError("llm.c shard '" + path + "': " + why); };
  if (f.size() < kLlmcHeader)
    throw bad("truncated header (" + std::to_string(f.size()) + " bytes; the header has 1024)");
  const int32_t magic = f.load<int32_t>(0), version = f.load<int32_t>(4), n = f.load<int32_t>(8);
  if (magic != kLlmcMagic)
    throw bad("magic " + std::to_string(magic) + "; allowed: 20240520");
  if (version != 1) throw bad("version " + std::to_string(version) + "; allowed: 1 (uint16 tokens)");
  const int64_t need = static_cast<int64_t>(kLlmcHeader) + 2 * static_cast<int64_t>(n);
  if (n < 0 || static_cast<int64_t>(f.size()) != need)
    throw bad("size " + std::to_string(f.size()) + " bytes, but its header's " +
              std::to_string(n) + " tokens need " + std::to_string(need) +
              (static_cast<int64_t>(f.size()) < need ? " (truncated?)" : ""));
  s->dtype = TokenDtype::U16;
  s->item_size = 2;
  s->data_offset = kLlmcHeader;
  s->num_tokens = n;
  return s;
}

template <class T>
void convert(const uint8_t* src, int64_t n, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * static_cast<int64_t>(sizeof(T)), sizeof v);
    out[i] = static_cast<int64_t>(v);
  }
}

void convert_tokens(TokenDtype dt, const uint8_t* src, int64_t n, int64_t* out) {
  switch (dt) {
    case TokenDtype::U8: return convert<uint8_t>(src, n, out);
    case TokenDtype::I8: return convert<int8_t>(src, n, out);
    case TokenDtype::I16: return convert<int16_t>(src, n, out);
    case TokenDtype::U16: return convert<uint16_t>(src, n, out);
    case TokenDtype::I32: return convert<int32_t>(src, n, out);
    case TokenDtype::U32: return convert<uint32_t>(src, n, out);
    case TokenDtype::I64: return convert<int64_t>(src, n, out);
  }
}

}  // namespace

bool is_raw_text_path(const std::string& p) {
  for (const char* e : {".txt", ".jsonl", ".json", ".gz", ".zst", ".parquet"})
    if (ends_with(p, e)) return true;
  return false;
}

int64_t TokenShard::doc_start(int64_t d) const {
  TORCH_CHECK(num_docs >= 0 && d >= 0 && d <= num_docs, "doc_start: document ", d, " of ", num_docs);
  if (format == TokenFormat::Tok) {
    const uint64_t off = file.load<uint64_t>(doc_offsets_at + 8 * static_cast<size_t>(d));
    if (off > static_cast<uint64_t>(num_tokens))
      throw UserError("token file '" + path + "': document " + std::to_string(d) +
                      " starts at token " + std::to_string(off) + ", past its " +
                      std::to_string(num_tokens) + " tokens; the file is corrupt");
    return static_cast<int64_t>(off);
  }
  const std::string idx = index.path();
  const int64_t seq = index.load<int64_t>(doc_indices_at + 8 * static_cast<size_t>(d));
  if (seq < 0 || seq > megatron_seqs)
    throw UserError("Megatron index '" + idx + "': document " + std::to_string(d) +
                    " starts at sequence " + std::to_string(seq) + "; allowed: 0.." +
                    std::to_string(megatron_seqs));
  if (seq == megatron_seqs) return num_tokens;
  const int64_t ptr = index.load<int64_t>(pointers_at + 8 * static_cast<size_t>(seq));
  if (ptr < 0 || ptr % item_size != 0 || ptr / item_size > num_tokens)
    throw UserError("Megatron index '" + idx + "': sequence " + std::to_string(seq) +
                    " has pointer " + std::to_string(ptr) + "; allowed: a multiple of " +
                    std::to_string(item_size) + " within the .bin");
  return ptr / item_size;
}

std::string TokenSource::shown(const std::string& path) const {
  return origin_.empty() ? "'" + path + "'"
                         : "'" + origin_ + "' (tokenized into the cache file '" + path + "')";
}

std::shared_ptr<const TokenSource> TokenSource::open(const std::string& spec, int64_t vocab,
                                                     const std::string& origin) {
  if (origin.empty()) return open(spec, vocab, std::string(), nullptr);
  // A token cache: its errors name the user's file (they gave that path, not the cache's).
  try {
    return open(spec, vocab, origin, nullptr);
  } catch (const UserError& e) {
    std::string msg = e.what();
    const std::string quoted = "'" + spec + "'";
    const auto at = msg.find(quoted);
    if (at != std::string::npos)
      msg.replace(at, quoted.size(), "'" + origin + "' (tokenized into the cache file '" + spec +
                                         "')");
    else
      msg = "data file '" + origin + "' (token cache '" + spec + "'): " + msg;
    throw UserError(msg);
  }
}

std::shared_ptr<const TokenSource> TokenSource::open(const std::string& spec, int64_t vocab,
                                                     const std::string& origin, std::nullptr_t) {
  install_sigbus_handler();
  auto src = std::shared_ptr<TokenSource>(new TokenSource());
  src->spec_ = spec;
  src->origin_ = origin;
  src->vocab_ = vocab;
  bool docs_known = true;
  for (const Candidate& c : resolve_spec(spec)) {
    std::unique_ptr<TokenShard> s = c.format == TokenFormat::Tok        ? open_tok(c.path)
                                    : c.format == TokenFormat::Megatron ? open_megatron(c.path)
                                                                        : open_llmc(c.path);
    // A .tok header records the vocabulary of the tokenizer that wrote it: a larger one than
    // this run's means another tokenizer, even where the ids present happen to fit.
    const int64_t written_vocab =
        c.format == TokenFormat::Tok ? static_cast<int64_t>(s->file.load<uint64_t>(32)) : 0;
    if (vocab > 0 && (s->max_id >= vocab || written_vocab > vocab))
      throw UserError("token file '" + s->path + "': " +
                      (written_vocab > 0 ? "written for a vocabulary of " +
                                               std::to_string(written_vocab) + " tokens, "
                                         : std::string()) +
                      "holds token ids up to " + std::to_string(s->max_id) +
                      " (its header's max id), but this run's vocabulary (the tokenizer's, "
                      "at most the model's) has " + std::to_string(vocab) +
                      " tokens; allowed: a file tokenized with this run's tokenizer "
                      "(model.tokenizer_path), ids below " + std::to_string(vocab));
    s->file.advise_random();
    src->format_ = c.format;
    src->token_starts_.push_back(src->token_starts_.back() + s->num_tokens);
    docs_known = docs_known && s->num_docs >= 0;
    src->shards_.push_back(std::move(s));
  }
  if (docs_known) {
    src->doc_starts_.push_back(0);
    for (auto& s : src->shards_) src->doc_starts_.push_back(src->doc_starts_.back() + s->num_docs);
  }
  if (src->num_tokens() == 0)
    throw UserError("data path '" + spec + "': holds no tokens; allowed: data with at least one window");
  return src;
}

int64_t TokenSource::doc_start(int64_t d) const {
  TORCH_CHECK(!doc_starts_.empty() && d >= 0 && d <= num_docs(), "doc_start: document ", d);
  size_t i = static_cast<size_t>(
      std::upper_bound(doc_starts_.begin(), doc_starts_.end(), d) - doc_starts_.begin() - 1);
  if (i == shards_.size()) return num_tokens();  // d == num_docs
  return token_starts_[i] + shards_[i]->doc_start(d - doc_starts_[i]);
}

TokenSource::Location TokenSource::locate(int64_t pos) const {
  TORCH_CHECK(pos >= 0 && pos < num_tokens(), "locate: token ", pos, " of ", num_tokens());
  const size_t i = static_cast<size_t>(
      std::upper_bound(token_starts_.begin(), token_starts_.end(), pos) - token_starts_.begin() - 1);
  return {i, pos - token_starts_[i]};
}

void TokenSource::read(int64_t pos, int64_t n, int64_t* out) const {
  TORCH_CHECK(pos >= 0 && n >= 0 && pos + n <= num_tokens(), "read: tokens [", pos, ", ", pos + n,
              ") of ", num_tokens());
  while (n > 0) {
    const Location loc = locate(pos);
    const TokenShard& s = *shards_[loc.shard];
    const int64_t take = std::min(n, s.num_tokens - loc.offset);
    // A shard changed under the run is an error naming it (docs/data.md "Files that change").
    const std::string changed = s.file.changed_since_open();
    if (!changed.empty())
      throw UserError("data file " + shown(s.path) + ": " + changed +
                      "; the data files of a run must not change while it trains");
    {
      ReadingGuard reading(s.path);
      convert_tokens(s.dtype, s.file.data() + s.data_offset + loc.offset * s.item_size, take, out);
    }
    // Every window's ids are checked, .tok v2 too: its header's max id was checked against
    // the vocabulary at open, but a damaged token section can break that promise (a fuzz
    // finding, docs/fuzzing.md), and an id past the embedding must not reach the model.
    const int64_t vocab_limit = vocab_ > 0 ? vocab_ : std::numeric_limits<int64_t>::max();
    const int64_t limit = s.max_id >= 0 ? std::min(vocab_limit, s.max_id + 1) : vocab_limit;
    for (int64_t i = 0; i < take; ++i)
      if (out[i] < 0 || out[i] >= limit)
        throw UserError("data file " + shown(s.path) + ": token id " + std::to_string(out[i]) +
                        " at token offset " + std::to_string(loc.offset + i) +
                        (out[i] >= 0 && out[i] < vocab_limit
                             ? " is above the max id " + std::to_string(s.max_id) +
                                   " its header records; the file is corrupt"
                         : vocab_ > 0 ? " is outside this run's vocabulary (the tokenizer's, at "
                                        "most the model's); allowed: 0.." +
                                            std::to_string(vocab_ - 1)
                                      : " is negative; allowed: ids >= 0"));
    pos += take, n -= take, out += take;
  }
}

void TokenSource::will_need(int64_t pos, int64_t n) const {
  while (n > 0) {
    const Location loc = locate(pos);
    const TokenShard& s = *shards_[loc.shard];
    const int64_t take = std::min(n, s.num_tokens - loc.offset);
    s.file.will_need(s.data_offset + static_cast<size_t>(loc.offset * s.item_size),
                     static_cast<size_t>(take * s.item_size));
    pos += take, n -= take;
  }
}

void write_tok_v2(const std::string& path, const std::vector<int32_t>& tokens,
                  const std::vector<int64_t>& doc_offsets, int64_t vocab) {
  const uint64_t n = tokens.size();
  TORCH_CHECK(!doc_offsets.empty() && doc_offsets.front() == 0 &&
                  doc_offsets.back() == static_cast<int64_t>(n) &&
                  std::is_sorted(doc_offsets.begin(), doc_offsets.end()),
              "write_tok_v2: document offsets must run from 0 to ", n);
  TORCH_CHECK(vocab > 0, "write_tok_v2: vocab must be positive");
  const uint32_t width = vocab <= 65536 ? 2 : 4;
  uint64_t max_id = 0;
  for (int32_t t : tokens) {
    TORCH_CHECK(t >= 0 && t < vocab, "write_tok_v2: token ", t, " outside the vocabulary ", vocab);
    max_id = std::max<uint64_t>(max_id, static_cast<uint64_t>(t));
  }
  const uint64_t docs = doc_offsets.size() - 1;
  const uint64_t tok_at = (kTokHeaderBytes + 8 * (docs + 1) + kTokAlign - 1) / kTokAlign * kTokAlign;
  std::string buf(tok_at + n * width, '\0');
  auto put = [&](size_t off, auto v) { std::memcpy(buf.data() + off, &v, sizeof v); };
  std::memcpy(buf.data(), "TITANTOK", 8);
  put(8, uint32_t{2});
  put(12, width);
  put(16, docs);
  put(24, n);
  put(32, static_cast<uint64_t>(vocab));
  put(40, max_id);
  put(48, static_cast<uint64_t>(kTokHeaderBytes));
  put(56, tok_at);
  for (size_t d = 0; d <= docs; ++d) put(kTokHeaderBytes + 8 * d, static_cast<uint64_t>(doc_offsets[d]));
  for (size_t i = 0; i < n; ++i) {
    if (width == 2)
      put(tok_at + 2 * i, static_cast<uint16_t>(tokens[i]));
    else
      put(tok_at + 4 * i, static_cast<uint32_t>(tokens[i]));
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream o(tmp, std::ios::binary | std::ios::trunc);
    if (!o) throw UserError("output file '" + path + "': cannot be written (" + std::strerror(errno) + ")");
    o.write(buf.data(), static_cast<std::streamsize>(buf.size()));
    o.flush();
    if (!o) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw UserError("output file '" + path + "': write failed (disk full?)");
    }
  }
  fs::rename(tmp, path);
}

}  // namespace titan
