#include "core/data/tokenize_pipeline.h"

#include <sys/stat.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/data/text_reader.h"

namespace titan {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kTick = std::chrono::milliseconds(500);

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

uint64_t file_bytes(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

// BOS/EOS ids to frame documents with; -1 for none.
struct Framing {
  int32_t bos = -1, eos = -1;
};

Framing framing(const Tokenizer& tok, const TokenizeOptions& o) {
  Framing f;
  if (o.bos) {
    f.bos = tok.bos_id();
    if (f.bos < 0) log_warn("the tokenizer has no BOS token; documents are stored without one");
  }
  if (o.eos) {
    f.eos = tok.eos_id();
    if (f.eos < 0) log_warn("the tokenizer has no EOS token; documents are stored without one");
  }
  return f;
}

// One batch on its way through the pipeline: records in, framed tokens out.
struct Item {
  int64_t seq = 0;
  TextBatch batch;
  std::vector<int32_t> tokens;  // framed documents back to back
  std::vector<size_t> lens;     // tokens per document
  uint64_t bytes_done = 0;      // input progress when the batch was cut
  std::exception_ptr error;     // raised when the writer reaches this batch
  bool last = false;
};

class Pipeline {
 public:
  Pipeline(const std::vector<std::string>& files, const Tokenizer& tok, const TokenizeOptions& o)
      : files_(files), tok_(tok), opts_(o), frame_(framing(tok, o)) {
    threads_ = o.threads > 0 ? o.threads
                             : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    window_ = 2 * threads_ + 2;
    for (auto& f : files) bytes_total_ += file_bytes(f);
  }
  ~Pipeline() { shutdown(); }

  TokenizeResult run(TokenShardWriter& out) {
    const auto t0 = Clock::now();
    threads_list_.emplace_back([this] { read_all(); });
    for (int i = 0; i < threads_; ++i) threads_list_.emplace_back([this] { encode_loop(); });
    TokenizeProgress p;
    p.bytes_total = bytes_total_;
    auto last_tick = Clock::now();
    for (;;) {
      std::unique_ptr<Item> item = take_next();
      if (Clock::now() - last_tick >= kTick) {
        last_tick = Clock::now();
        if (opts_.cancelled && opts_.cancelled())
          throw UserError("tokenize: interrupted; no output was written");
        p.docs = out.documents();
        p.tokens = out.tokens();
        p.seconds = since(t0);
        if (opts_.progress) opts_.progress(p);
      }
      if (!item) continue;
      if (item->error) std::rethrow_exception(item->error);
      if (item->last) break;
      const int32_t* ids = item->tokens.data();
      for (size_t n : item->lens) {
        out.add_document(ids, n);
        ids += n;
      }
      p.bytes_done = item->bytes_done;
      std::lock_guard<std::mutex> lk(mu_);
      ++next_write_;
      cv_reader_.notify_one();
    }
    shutdown();
    TokenizeResult r;
    r.docs = out.documents();
    r.tokens = out.tokens();
    r.input_bytes = bytes_total_;
    r.seconds = since(t0);
    r.threads = threads_;
    return r;
  }

 private:
  // The batch the writer needs next, or null after a tick without it.
  std::unique_ptr<Item> take_next() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_writer_.wait_for(lk, kTick, [&] { return done_.count(next_write_) > 0; });
    auto it = done_.find(next_write_);
    if (it == done_.end()) return nullptr;
    auto item = std::move(it->second);
    done_.erase(it);
    return item;
  }

  void read_all() {
    int64_t seq = 0;
    auto finish_with = [&](std::unique_ptr<Item> item) {
      item->seq = seq;
      std::lock_guard<std::mutex> lk(mu_);
      done_[seq] = std::move(item);
      reader_done_ = true;
      cv_writer_.notify_one();
      cv_worker_.notify_all();
    };
    try {
      TextReaderOptions ro;
      ro.field = opts_.field;
      ro.batch_bytes = opts_.batch_bytes;
      uint64_t before = 0;
      for (const std::string& path : files_) {
        auto src = open_text_source(path, ro);
        for (;;) {
          {
            std::unique_lock<std::mutex> lk(mu_);
            cv_reader_.wait(lk, [&] { return stop_ || seq - next_write_ < window_; });
            if (stop_) return;
          }
          auto item = std::make_unique<Item>();
          if (!src->next(item->batch)) break;
          item->seq = seq++;
          item->bytes_done = before + src->bytes_done();
          std::lock_guard<std::mutex> lk(mu_);
          todo_.push_back(std::move(item));
          cv_worker_.notify_one();
        }
        before += file_bytes(path);
      }
      auto end = std::make_unique<Item>();
      end->last = true;
      finish_with(std::move(end));
    } catch (...) {
      auto err = std::make_unique<Item>();
      err->error = std::current_exception();
      finish_with(std::move(err));
    }
  }

  void encode_loop() {
    std::string scratch;
    for (;;) {
      std::unique_ptr<Item> item;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_worker_.wait(lk, [&] { return stop_ || !todo_.empty() || reader_done_; });
        if (stop_ || todo_.empty()) return;
        item = std::move(todo_.front());
        todo_.pop_front();
      }
      encode(*item, scratch);
      std::lock_guard<std::mutex> lk(mu_);
      done_[item->seq] = std::move(item);
      cv_writer_.notify_one();
    }
  }

  void encode(Item& item, std::string& scratch) const {
    try {
      const TextBatch& b = item.batch;
      item.tokens.reserve(b.data.size() / 3 + 2 * b.size());
      item.lens.reserve(b.size());
      for (size_t i = 0; i < b.size(); ++i) {
        std::string_view text = decode_record(b, i, opts_.field, scratch);
        const size_t start = item.tokens.size();
        if (frame_.bos >= 0) item.tokens.push_back(frame_.bos);
        std::vector<int32_t> ids = tok_.encode(text);
        item.tokens.insert(item.tokens.end(), ids.begin(), ids.end());
        if (frame_.eos >= 0) item.tokens.push_back(frame_.eos);
        item.lens.push_back(item.tokens.size() - start);
      }
    } catch (...) {
      item.error = std::current_exception();
    }
    std::string().swap(item.batch.data);  // the text is no longer needed while it waits
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_reader_.notify_all();
    cv_worker_.notify_all();
    for (auto& t : threads_list_)
      if (t.joinable()) t.join();
    threads_list_.clear();
  }

  const std::vector<std::string>& files_;
  const Tokenizer& tok_;
  TokenizeOptions opts_;
  Framing frame_;
  int threads_ = 1;
  int64_t window_ = 4;
  uint64_t bytes_total_ = 0;

  std::mutex mu_;
  std::condition_variable cv_reader_, cv_worker_, cv_writer_;
  std::deque<std::unique_ptr<Item>> todo_;
  std::map<int64_t, std::unique_ptr<Item>> done_;
  int64_t next_write_ = 0;
  bool stop_ = false, reader_done_ = false;
  std::vector<std::thread> threads_list_;
};

TokenWriterOptions writer_options(const Tokenizer& tok, const TokenizeOptions& o) {
  TokenWriterOptions w;
  w.format = o.format;
  w.shard_tokens = o.shard_tokens;
  w.vocab_size = tok.vocab_size();
  return w;
}

// Sequential reads of a version-1 .tok; every short read is a UserError naming the file.
class V1File {
 public:
  explicit V1File(const std::string& path) : path_(path), f_(std::fopen(path.c_str(), "rb")) {
    if (!f_)
      throw UserError("token file '" + path + "': cannot be read (" + std::strerror(errno) + ")");
  }
  ~V1File() { std::fclose(f_); }
  void seek(uint64_t off) {
    if (::fseeko(f_, static_cast<off_t>(off), SEEK_SET) != 0) short_read();
  }
  void read(void* dst, size_t n) {
    if (std::fread(dst, 1, n, f_) != n) short_read();
  }
  template <class T>
  T get() {
    T v;
    read(&v, sizeof v);
    return v;
  }

 private:
  [[noreturn]] void short_read() {
    throw UserError("token file '" + path_ + "': ends early; allowed: a complete .tok file");
  }
  std::string path_;
  std::FILE* f_;
};

}  // namespace

uint32_t tok_file_version(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return 0;
  char head[12] = {};
  const size_t n = std::fread(head, 1, sizeof head, f);
  std::fclose(f);
  if (n < sizeof head || std::memcmp(head, kTokV2Magic, 8) != 0) return 0;
  uint32_t v;
  std::memcpy(&v, head + 8, 4);
  return v;
}

TokenizeResult tokenize_files(const std::vector<std::string>& files, const Tokenizer& tok,
                              const std::string& output, const TokenizeOptions& opts) {
  TokenShardWriter out(output, writer_options(tok, opts));
  TokenizeResult r;
  {
    Pipeline p(files, tok, opts);
    r = p.run(out);
  }
  r.outputs = out.commit();
  return r;
}

TokenizeResult convert_tok_v1(const std::string& input, const Tokenizer& tok,
                              const std::string& output, const TokenizeOptions& opts) {
  const auto t0 = Clock::now();
  auto bad = [&](const std::string& why) {
    return UserError("token file '" + input + "': " + why +
                     "; allowed: a version-1 .tok file made by `titan-train tokenize`");
  };
  const uint64_t size = file_bytes(input);
  V1File head(input), body(input);
  char magic[8];
  head.read(magic, 8);
  if (std::memcmp(magic, kTokV2Magic, 8) != 0) throw bad("missing the TITANTOK header");
  const auto version = head.get<uint32_t>(), width = head.get<uint32_t>();
  const auto docs = head.get<uint64_t>(), ntok = head.get<uint64_t>(), vocab = head.get<uint64_t>();
  if (version == kTokV2Version) throw bad("it is already version 2; use it as it is");
  if (version != 1) throw bad("version " + std::to_string(version));
  if (width != 2 && width != 4) throw bad("token width " + std::to_string(width));
  if (docs > size || ntok > size || 40 + 8 * (docs + 1) + width * ntok != size)
    throw bad("size " + std::to_string(size) + " bytes disagrees with its header");
  if (static_cast<int64_t>(vocab) > tok.vocab_size())
    throw bad("made with a vocabulary of " + std::to_string(vocab) +
              " tokens, but the tokenizer has " + std::to_string(tok.vocab_size()));
  const Framing fr = framing(tok, opts);
  TokenShardWriter out(output, writer_options(tok, opts));
  body.seek(40 + 8 * (docs + 1));
  std::vector<int32_t> doc;
  std::vector<uint8_t> raw;
  uint64_t prev = head.get<uint64_t>();
  if (prev != 0) throw bad("document offsets out of order");
  for (uint64_t d = 0; d < docs; ++d) {
    const uint64_t end = head.get<uint64_t>();
    if (end < prev || end > ntok) throw bad("document offsets out of order");
    const uint64_t n = end - prev;
    raw.resize(n * width);
    body.read(raw.data(), raw.size());
    doc.clear();
    if (fr.bos >= 0) doc.push_back(fr.bos);
    for (uint64_t i = 0; i < n; ++i) {
      uint32_t t;
      if (width == 2) {
        uint16_t v;
        std::memcpy(&v, raw.data() + 2 * i, 2);
        t = v;
      } else {
        std::memcpy(&t, raw.data() + 4 * i, 4);
      }
      if (t >= vocab)
        throw bad("token " + std::to_string(t) + " at token offset " + std::to_string(prev + i) +
                  " outside the vocabulary of " + std::to_string(vocab));
      doc.push_back(static_cast<int32_t>(t));
    }
    if (fr.eos >= 0) doc.push_back(fr.eos);
    out.add_document(doc.data(), doc.size());
    prev = end;
    if (opts.cancelled && (d & 0xFFFF) == 0 && opts.cancelled())
      throw UserError("tokenize: interrupted; no output was written");
  }
  if (prev != ntok) throw bad("document offsets out of order");
  TokenizeResult r;
  r.docs = out.documents();
  r.tokens = out.tokens();
  r.input_bytes = size;
  r.outputs = out.commit();
  r.seconds = since(t0);
  return r;
}

std::string format_progress(const TokenizeProgress& p) {
  auto human = [](double v) {
    char b[32];
    if (v >= 1e9)
      std::snprintf(b, sizeof b, "%.2fG", v / 1e9);
    else if (v >= 1e6)
      std::snprintf(b, sizeof b, "%.2fM", v / 1e6);
    else if (v >= 1e4)
      std::snprintf(b, sizeof b, "%.1fk", v / 1e3);
    else
      std::snprintf(b, sizeof b, "%.0f", v);
    return std::string(b);
  };
  const double mbs = p.seconds > 0 ? p.bytes_done / 1e6 / p.seconds : 0;
  std::string s = human(static_cast<double>(p.docs)) + " docs  " +
                  human(static_cast<double>(p.tokens)) + " tokens  ";
  char b[96];
  std::snprintf(b, sizeof b, "%.1f MB/s", mbs);
  s += b;
  if (p.bytes_total > 0 && p.bytes_done > 0) {
    const double left = (static_cast<double>(p.bytes_total) - p.bytes_done) / (mbs * 1e6);
    const long sec = static_cast<long>(left + 0.5);
    std::snprintf(b, sizeof b, "  %.0f%%  ETA %ld:%02ld:%02ld",
                  100.0 * p.bytes_done / p.bytes_total, sec / 3600, sec / 60 % 60, sec % 60);
    s += b;
  }
  return s;
}

}  // namespace titan
