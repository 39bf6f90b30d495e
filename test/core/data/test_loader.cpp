// The training loader and the validation reader: prefetched batches equal direct reads and the
// planned windows (token ids encode their position, so every check is exact); the state counts
// consumed, not prefetched, batches; ranks split the one-rank batch; reader errors reach the
// batch that holds them; and a 1 GB .tok v2 costs no pass over its tokens (RSS growth < 50 MB,
// open < 100 ms of CPU, the bounds issue 11 sets).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <thread>

#include "core/data/blend.h"
#include "core/base/errors.h"
#include "core/data/loader.h"
#include "data_fixtures.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

struct TwoSources {
  test::TempDir dir{"loader"};
  std::unique_ptr<Blend> blend;
  TwoSources() {
    test::write_sequential_tok(dir.file("a.tok"), 3000, 0, 100);
    test::write_sequential_tok(dir.file("b.tok"), 9000, 20000, 100);
    blend = std::make_unique<Blend>(
        parse_dataset_spec({dir.file("a.tok") + "," + dir.file("b.tok")}, {0.4, 0.6}));
  }
};

bool same(const MicroBatch& a, const MicroBatch& b) {
  return a.tokens.equal(b.tokens) && a.labels.equal(b.labels);
}

}  // namespace

TEST_CASE("loader: prefetched batches equal direct reads and the planned windows", "[loader]") {
  TwoSources d;
  const int64_t T = 31, B = 3, M = 2;
  Loader direct(*d.blend, T, B, 0, 1, M, 5, at::kCPU, 0);
  Loader ahead(*d.blend, T, B, 0, 1, M, 5, at::kCPU, 3);
  WindowPlanner planner(*d.blend, direct.layout(), 5);
  LoaderState st = planner.initial_state();
  for (int step = 0; step < 4; ++step) {
    auto plan = planner.next_step(st);
    for (int64_t m = 0; m < M; ++m) {
      MicroBatch x = direct.next(), y = ahead.next();
      REQUIRE(same(x, y));
      REQUIRE(x.tokens.sizes() == at::IntArrayRef({B, T}));
      REQUIRE(x.tokens.scalar_type() == at::kLong);
      for (int64_t b = 0; b < B; ++b) {
        const WindowRef& w = plan[static_cast<size_t>(m * B + b)];
        const int64_t first = (w.draw.source == 0 ? 0 : 20000) + w.token;
        auto tk = x.tokens[b], lb = x.labels[b];
        // Sequential ids: tokens are first .. first + T - 1, labels one further.
        REQUIRE(tk.equal(at::arange(first, first + T, at::kLong)));
        REQUIRE(lb.equal(at::arange(first + 1, first + T + 1, at::kLong)));
      }
    }
  }
  CHECK(direct.wait_ms() >= 0);
  CHECK(ahead.wait_ms() >= 0);
  CHECK(ahead.wait_ms() == 0);  // reset by the previous call
}

TEST_CASE("loader: state() counts consumed micro-batches, not prefetched ones", "[loader]") {
  TwoSources d;
  const int64_t T = 15, B = 2, M = 2, G = M * B;
  Loader loader(*d.blend, T, B, 0, 1, M, 9, at::kCPU, 4);
  CHECK(loader.state().g == 0);
  std::vector<MicroBatch> seen;
  std::vector<LoaderState> after;  // after[i]: the state once seen[i] was consumed
  auto take = [&] {
    seen.push_back(loader.next());
    after.push_back(loader.state());
  };
  take();
  CHECK(after[0].g == 0);
  CHECK(after[0].micro == 1);
  take();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the thread run ahead
  CHECK(loader.state().g == G);
  CHECK(loader.state().micro == 0);
  CHECK(loader.state().drawn[0] + loader.state().drawn[1] == G);
  for (int i = 0; i < 6; ++i) take();
  CHECK(after[2].micro == 1);  // inside step 2

  // A new loader resumed from a saved state continues exactly, at a step boundary or inside.
  for (size_t from : {1u, 2u}) {
    Loader fresh(*d.blend, T, B, 0, 1, M, 9, at::kCPU, 2);
    fresh.load_state(LoaderState::from_json(after[from].to_json(), "test"));
    for (size_t i = from + 1; i < seen.size(); ++i) REQUIRE(same(fresh.next(), seen[i]));
    CHECK(fresh.state().g == after.back().g);
  }
  LoaderState wrong{0, {0}, 0};
  CHECK_THROWS_WITH(loader.load_state(wrong), Contains("1 source counts") && Contains("2 sources"));
}

TEST_CASE("loader: data-parallel ranks split the one-rank batch", "[loader]") {
  TwoSources d;
  const int64_t T = 15;
  Loader single(*d.blend, T, 4, 0, 1, 1, 3, at::kCPU, 2);
  Loader r0(*d.blend, T, 2, 0, 2, 1, 3, at::kCPU, 2), r1(*d.blend, T, 2, 1, 2, 1, 3, at::kCPU, 0);
  for (int step = 0; step < 6; ++step) {
    MicroBatch s = single.next(), a = r0.next(), b = r1.next();
    // g = (m * dp + r) * B + b: rank r's rows are rows r*B .. r*B + B - 1 of the single batch.
    REQUIRE(s.tokens.slice(0, 0, 2).equal(a.tokens));
    REQUIRE(s.tokens.slice(0, 2, 4).equal(b.tokens));
    REQUIRE(s.labels.slice(0, 2, 4).equal(b.labels));
  }
  CHECK(r0.state().g == r1.state().g);
  CHECK(r0.state().drawn == single.state().drawn);
}

TEST_CASE("loader: a token id outside the vocabulary fails its batch, naming file and offset",
          "[loader]") {
  test::TempDir dir("loadervocab");
  std::vector<uint16_t> tokens(4000, 5);
  tokens[777] = 5000;
  test::write_llmc(dir.file("shard.bin"), tokens);
  BlendOptions opts;
  opts.vocab = 1000;
  Blend b(parse_dataset_spec({dir.file("shard.bin")}, {}), opts);
  Loader loader(b, 15, 4, 0, 1, 1, 0, at::kCPU, 2);
  int served = 0;
  std::string msg;
  for (int i = 0; i < 100 && msg.empty(); ++i) {  // 250 windows: an epoch is 62 batches
    try {
      loader.next();
      ++served;
    } catch (const UserError& e) {
      msg = e.what();
    }
  }
  CHECK_THAT(msg, Contains(dir.file("shard.bin")) && Contains("token id 5000 at token offset 777") &&
                      Contains("0..999"));
  CHECK(served <= 62);
  CHECK(loader.state().g == 4 * served);  // the failed batch was not consumed
  CHECK_THROWS_AS(loader.next(), UserError);  // and stays failed
}

TEST_CASE("loader: validation reads windows in order, rank-strided", "[loader]") {
  test::TempDir dir("validation");
  test::write_sequential_tok(dir.file("a.tok"), 10000, 0, 100);
  test::write_sequential_tok(dir.file("b.tok"), 3000, 20000, 100);
  BlendOptions opts;
  opts.holdout_fraction = 0.2;  // a: documents 80..99 = tokens [8000, 10000)
  Blend train(parse_dataset_spec({dir.file("a.tok")}, {}), opts);
  const int64_t T = 15, B = 3;
  ValidationReader v0(train, true, T, B, 0, 2), v1(train, true, T, B, 1, 2);
  CHECK(v0.windows() == 125);
  CHECK(v0.batches() == 125 / 2 / 3);
  for (int64_t i = 0; i < v0.batches(); ++i) {
    MicroBatch a = v0.next(), b = v1.next();
    for (int64_t r = 0; r < B; ++r) {
      const int64_t va = (i * B + r) * 2, vb = va + 1;  // windows r, r + dp, ...
      REQUIRE(a.tokens[r][0].item<int64_t>() == 8000 + va * (T + 1));
      REQUIRE(b.tokens[r][0].item<int64_t>() == 8000 + vb * (T + 1));
      REQUIRE(a.labels[r][T - 1].item<int64_t>() == 8000 + va * (T + 1) + T);
    }
  }
  CHECK(v0.next().tokens[0][0].item<int64_t>() == 8000);  // starts over

  // A separate validation blend: both sources' windows, each once, interleaved by windows.
  Blend val(parse_dataset_spec({dir.file("a.tok"), dir.file("b.tok")}, {}));
  ValidationReader one(val, false, T, 1, 0, 1);
  CHECK(one.windows() == 625 + 187);
  std::set<int64_t> firsts;
  int64_t from_b_in_first_100 = 0;
  for (int64_t i = 0; i < one.batches(); ++i) {
    const int64_t t = one.next().tokens[0][0].item<int64_t>();
    REQUIRE(firsts.insert(t).second);
    if (i < 100 && t >= 20000) ++from_b_in_first_100;
  }
  CHECK(firsts.size() == 812);
  CHECK(std::abs(from_b_in_first_100 - 23) <= 1);  // 187 / 812 of the first 100
  CHECK_THROWS_WITH(ValidationReader(train, true, 4000, 1, 0, 1),
                    Contains("holds 0 windows") && Contains("holdout_fraction"));
}

TEST_CASE("loader: on CUDA, batches arrive on the device equal to the CPU batches", "[loader][gpu]") {
  if (!at::hasCUDA()) TITAN_SKIP("no CUDA device");
  TwoSources d;
  const at::Device cuda(at::kCUDA, 0);
  Loader cpu(*d.blend, 31, 4, 0, 1, 2, 5, at::kCPU, 0), gpu(*d.blend, 31, 4, 0, 1, 2, 5, cuda, 3);
  for (int i = 0; i < 10; ++i) {
    MicroBatch a = cpu.next(), b = gpu.next();  // b: non-blocking copies from pinned memory
    REQUIRE(b.tokens.device() == cuda);
    REQUIRE(b.labels.device() == cuda);
    REQUIRE(a.tokens.equal(b.tokens.cpu()));
    REQUIRE(a.labels.equal(b.labels.cpu()));
  }
  BlendOptions opts;
  opts.holdout_fraction = 0.2;
  Blend h(parse_dataset_spec({d.dir.file("a.tok")}, {}), opts);
  ValidationReader vc(h, true, 15, 2, 0, 1), vg(h, true, 15, 2, 0, 1, cuda);
  for (int64_t i = 0; i < vc.batches(); ++i) REQUIRE(vc.next().tokens.equal(vg.next().tokens.cpu()));
}

namespace {

int64_t rss_kb() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// A .tok v2 of n uint16 tokens in documents of doc_len, written sparsely: header and offsets,
// then the file is extended to its full size (the tokens read as zeros) and a few tokens are
// set: token i = i % 2048 at the positions in `marks`.
void write_sparse_tok(const std::string& path, int64_t n, int64_t doc_len,
                      const std::vector<int64_t>& marks) {
  const int64_t docs = (n + doc_len - 1) / doc_len;
  const int64_t tok_at = (64 + 8 * (docs + 1) + 4095) / 4096 * 4096;
  std::ofstream o(path, std::ios::binary);
  auto put = [&](auto v) { o.write(reinterpret_cast<const char*>(&v), sizeof v); };
  o.write("TITANTOK", 8);
  put(uint32_t{2}), put(uint32_t{2}), put(uint64_t(docs)), put(uint64_t(n)), put(uint64_t{2048});
  put(uint64_t{2047}), put(uint64_t{64}), put(uint64_t(tok_at));
  for (int64_t d = 0; d <= docs; ++d) put(uint64_t(std::min(n, d * doc_len)));
  o.close();
  std::filesystem::resize_file(path, static_cast<uintmax_t>(tok_at + 2 * n));
  const int fd = ::open(path.c_str(), O_WRONLY);
  for (int64_t i : marks) {
    const uint16_t v = static_cast<uint16_t>(i % 2048);
    REQUIRE(::pwrite(fd, &v, 2, tok_at + 2 * i) == 2);
  }
  ::close(fd);
}

}  // namespace

TEST_CASE("loader: a 1 GB .tok v2 opens and trains with no pass over its tokens", "[loader]") {
  test::TempDir dir("bigtok");
  const int64_t n = int64_t{1} << 29;  // 512 Mi tokens = 1 GiB of uint16
  std::vector<int64_t> marks;
  for (int64_t i = 0; i < 64; ++i) marks.push_back((n / 64) * i + 12345);
  write_sparse_tok(dir.file("big.tok"), n, 4096, marks);
  at::empty({8, 2048}, at::kLong);  // ATen's allocator is warm before measuring
  const int64_t rss0 = rss_kb();
  const double cpu0 = thread_cpu_ms();
  BlendOptions opts;
  opts.vocab = 2048;
  opts.holdout_fraction = 0.01;
  Blend blend(parse_dataset_spec({dir.file("big.tok")}, {}), opts);
  const double open_ms = thread_cpu_ms() - cpu0;
  CHECK(blend.source(0).num_tokens() == n);
  CHECK(blend.holdout_range(0).begin == (n / 4096 - n / 4096 / 100) * 4096);
  {
    Loader loader(blend, 2048, 8, 0, 1, 1, 1, at::kCPU, 2);
    for (int i = 0; i < 20; ++i) loader.next();
    ValidationReader val(blend, true, 2048, 8, 0, 1);
    val.next();
  }
  // The marked tokens read back through the source.
  for (int64_t i : marks) {
    int64_t t = -1;
    blend.source(0).read(i, 1, &t);
    REQUIRE(t == i % 2048);
  }
  const int64_t grown_kb = rss_kb() - rss0;
  std::cout << "1 GiB .tok v2: open " << open_ms << " ms CPU, RSS growth " << grown_kb / 1024.0
            << " MB after 20 batches of 8 x 2049 tokens\n";
  CHECK(open_ms < 100);
  CHECK(grown_kb < 50 * 1024);
}

// The loader's throughput with prefetching, B = 8, seq 256 and 2048, against direct reads on
// the caller's thread, side by side. Hidden ([.bench_data]): scripts/bench_data.sh runs it.
TEST_CASE("loader bench: tokens per second with and without prefetch", "[.bench_data]") {
  test::TempDir dir("benchdata");
  const int64_t n = int64_t{1} << 26;  // 64 Mi tokens, 128 MiB, real (not sparse) pages
  {
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    uint64_t x = 88172645463325252ull;
    for (auto& t : tokens) x ^= x << 13, x ^= x >> 7, x ^= x << 17, t = static_cast<int32_t>(x % 50000);
    std::vector<int64_t> offsets;
    for (int64_t i = 0; i < n; i += 1000) offsets.push_back(i);
    offsets.push_back(n);
    write_tok_v2(dir.file("bench.tok"), tokens, offsets, 50000);
  }
  Blend blend(parse_dataset_spec({dir.file("bench.tok")}, {}));
  const double seconds = [] {
    const char* e = std::getenv("DATA_BENCH_SECONDS");
    return e && *e ? std::atof(e) : 2.0;
  }();
  for (int64_t T : {256, 2048}) {
    double tps[2] = {0, 0}, wait_per_batch[2] = {0, 0};
    for (int64_t depth : {0, 4}) {
      const int i = depth ? 1 : 0;
      Loader loader(blend, T, 8, 0, 1, 1, 11, at::kCPU, depth);
      loader.next();
      int64_t batches = 0;
      auto t0 = std::chrono::steady_clock::now();
      double el = 0;
      while (el < seconds) {  // the consumer only takes batches: raw throughput
        loader.next();
        ++batches;
        el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      tps[i] = static_cast<double>(batches * 8 * T) / el;
      // A consumer away 2 ms per batch (a GPU step: the host thread waits on the device, its
      // core is free): the data time it still sees.
      loader.wait_ms();
      for (int b = 0; b < 200; ++b) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        loader.next();
      }
      wait_per_batch[i] = loader.wait_ms() / 200;
    }
    std::cout << std::fixed << std::setprecision(0) << "loader B=8 seq " << T << ": prefetch "
              << tps[1] << " tokens/s, direct " << tps[0] << " tokens/s, ratio "
              << std::setprecision(2) << tps[1] / tps[0] << "; a consumer away 2 ms per batch waits "
              << std::setprecision(4) << wait_per_batch[1] << " ms/batch with prefetch, "
              << wait_per_batch[0] << " ms/batch without\n";
  }
}
