#include "core/data/token_cache.h"

#include "core/base/hash.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/base/durable_io.h"
#include "core/base/errors.h"

namespace titan {
namespace {

namespace fs = std::filesystem;

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::string default_cache_dir() {
  const char* c = std::getenv("TITAN_CACHE");
  if (c && *c) return std::string(c) + "/tokcache";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/titan-train/tokcache";
}

struct CacheKey {
  std::string text;      // what the file depends on, one fact per line
  std::string tok_path;  // the cached .tok
  std::string key_path;  // its sidecar holding `text`
};

CacheKey cache_key(const std::string& raw, const std::string& tokenizer_file,
                   const TokenCacheOptions& o) {
  struct stat st {};
  if (::stat(raw.c_str(), &st) != 0)
    throw UserError("data file '" + raw + "': " +
                    (errno == ENOENT ? std::string("does not exist")
                                     : "cannot be read (" + std::string(std::strerror(errno)) + ")") +
                    "; allowed: an existing .txt/.jsonl file or token shards (docs/data.md)");
  const std::string abs = fs::absolute(raw).lexically_normal().string();
  const long long mtime_ns =
      static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
  CacheKey k;
  k.text = "titan-train token cache 1\ninput " + abs + "\nsize " +
           std::to_string(static_cast<long long>(st.st_size)) + "\nmtime_ns " +
           std::to_string(mtime_ns) + "\ntokenizer " + file_content_hash(tokenizer_file) +
           tokenizer_config_hash(tokenizer_file) + "\nfield " + o.field + "\nbos " + (o.bos ? "1" : "0") + "\neos " + (o.eos ? "1" : "0") +
           "\noutput tok v2\n";
  std::string stem = fs::path(raw).filename().string();
  for (char& c : stem)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') c = '_';
  if (stem.size() > 64) stem.resize(64);
  const std::string dir = o.cache_dir.empty() ? default_cache_dir() : o.cache_dir;
  const std::string name =
      dir + "/" + stem + "-" + hex64(fnv1a(kFnv1aOffset, k.text.data(), k.text.size()));
  k.tok_path = name + ".tok";
  k.key_path = name + ".key";
  return k;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return {};
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool complete(const CacheKey& k) {
  return tok_file_version(k.tok_path) == kTokV2Version && slurp(k.key_path) == k.text;
}

// The sidecar under a name of its own first, so concurrent builders never share a temp.
void write_key(const CacheKey& k) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string tmp = k.key_path + ".tmp-" + host + "-" + std::to_string(::getpid());
  write_file_durable(tmp, k.text);
  if (std::rename(tmp.c_str(), k.key_path.c_str()) != 0)
    throw UserError("token cache file '" + k.key_path + "': cannot be written (" +
                    std::strerror(errno) + ")");
}

}  // namespace

std::string tokenizer_config_hash(const std::string& tokenizer_file) {
  // A tokenizer_config.json beside tokenizer.json can add special tokens and pick BOS/EOS
  // (core/tokenizer/tokenizer.h), so it changes the ids too.
  const fs::path cfg = fs::path(tokenizer_file).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (tokenizer_file == "bytes" || !fs::exists(cfg, ec)) return "";
  return "\ntokenizer_config " + file_content_hash(cfg.string());
}

std::string file_content_hash(const std::string& path) {
  if (path == "bytes") return "bytes";
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw UserError("tokenizer file '" + path + "': cannot be read (" + std::strerror(errno) + ")");
  uint64_t h = kFnv1aOffset;
  char buf[1 << 16];
  while (f.read(buf, sizeof buf) || f.gcount() > 0)
    h = fnv1a(h, buf, static_cast<size_t>(f.gcount()));
  return hex64(h);
}

std::string token_cache_path(const std::string& raw_path, const std::string& tokenizer_file,
                             const TokenCacheOptions& opts) {
  return cache_key(raw_path, tokenizer_file, opts).tok_path;
}

TokenCacheResult ensure_token_cache(const std::string& raw_path, const Tokenizer& tok,
                                    const std::string& tokenizer_file,
                                    const TokenCacheOptions& opts) {
  const CacheKey k = cache_key(raw_path, tokenizer_file, opts);
  TokenCacheResult r;
  r.path = k.tok_path;
  r.reused = true;
  if (!opts.builder) {
    if (opts.barrier) opts.barrier();
    if (!complete(k))
      throw UserError("data file '" + raw_path +
                      "': the node's local rank 0 left no token cache at '" + k.tok_path +
                      "'; see its log for why");
    r.log_line = "data: token cache for " + raw_path + " (built by local rank 0): " + k.tok_path;
    return r;
  }
  try {
    if (complete(k)) {
      r.log_line =
          "data: reusing token cache for " + raw_path + ": " + k.tok_path + " (nothing tokenized)";
    } else {
      std::error_code ec;
      const std::string dir = fs::path(k.tok_path).parent_path().string();
      fs::create_directories(dir, ec);
      if (ec)
        throw UserError("token cache folder '" + dir + "': cannot be created (" + ec.message() +
                        "); set TITAN_CACHE to a writable folder");
      write_key(k);
      TokenizeOptions t;
      t.threads = opts.threads;
      t.field = opts.field;
      t.bos = opts.bos;
      t.eos = opts.eos;
      t.progress = opts.progress;
      TokenizeResult tr = tokenize_files({raw_path}, tok, k.tok_path, t);
      r.reused = false;
      r.docs = tr.docs;
      r.tokens = tr.tokens;
      char b[160];
      std::snprintf(b, sizeof b, " (%lld documents, %lld tokens, %.1f s)",
                    static_cast<long long>(tr.docs), static_cast<long long>(tr.tokens), tr.seconds);
      r.log_line = "data: tokenized " + raw_path + " into token cache " + k.tok_path + b;
    }
  } catch (...) {
    if (opts.barrier) opts.barrier();  // the others learn of the failure now, not at a timeout
    throw;
  }
  if (opts.barrier) opts.barrier();
  return r;
}

}  // namespace titan
