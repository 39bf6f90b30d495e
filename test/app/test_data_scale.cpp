// Pre-training scale, end to end: a training run on a generated 1 GiB .tok v2 has a peak RSS
// within 100 MB of the same run on a 10 MB file, and its start-up (a 1-step run, exec to exit)
// within 1 s of that run's (issue 11's bounds). Start-up is the binary's own "first step
// done N ms after start" figure: exec to the end of the first step, at a short seq_len so the
// step itself is small next to the bound.
#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>

#include "core/data/token_source.h"
#include "test_util.h"

using namespace titan;

namespace {

struct Measured {
  int rc = -1;
  long max_rss_kb = 0;
  double seconds = 0;
  std::string out;
};

// Runs a shell command, capturing its output in a file, with the child's own peak RSS.
Measured run_measured(const std::string& cmd, const std::string& log) {
  Measured m;
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const std::string full = "exec " + cmd + " > " + log + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  rusage ru{};
  ::wait4(pid, &status, 0, &ru);
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  m.max_rss_kb = ru.ru_maxrss;
  m.out = test::read_file(log);
  return m;
}

// n uint16 tokens, documents of 2048; dense pseudo-random ids below 2048 when `dense`,
// otherwise a sparse file (zeros) of the full size.
void write_tok(const std::string& path, int64_t n, bool dense) {
  const int64_t docs = (n + 2047) / 2048, tok_at = (64 + 8 * (docs + 1) + 4095) / 4096 * 4096;
  std::ofstream o(path, std::ios::binary);
  auto put = [&](auto v) { o.write(reinterpret_cast<const char*>(&v), sizeof v); };
  o.write("TITANTOK", 8);
  put(uint32_t{2}), put(uint32_t{2}), put(uint64_t(docs)), put(uint64_t(n)), put(uint64_t{2048});
  put(uint64_t{dense ? 2047u : 0u}), put(uint64_t{64}), put(uint64_t(tok_at));
  for (int64_t d = 0; d <= docs; ++d) put(uint64_t(std::min(n, d * 2048)));
  o.seekp(tok_at);
  if (dense) {
    uint64_t x = 2463534242ull;
    for (int64_t i = 0; i < n; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      put(static_cast<uint16_t>(i % 2048 == 0 ? 2047 : x % 2048));
    }
  }
  o.close();
  std::filesystem::resize_file(path, static_cast<uintmax_t>(tok_at + 2 * n));
}

}  // namespace

TEST_CASE("data scale: 1 GiB of tokens trains in the memory and start-up of 10 MB", "[data][slow]") {
  test::TempDir dir("datascale");
  write_tok(dir.file("small.tok"), 5'000'000, true);  // 10 MB
  auto train = [&](const std::string& data, const std::string& tag) {
    return run_measured("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                            test::binary() + " --config " + test::source_dir() +
                            "/configs/llama3_debug.toml --training.dataset_path " + data +
                            " --training.steps 1 --training.local_batch_size 2"
                            " --training.seq_len 256"
                            " --validation.enable false --metrics.enable_tensorboard false"
                            " --job.dump_folder " + dir.file("dump-" + tag),
                        dir.file(tag + ".log"));
  };
  Measured small = train(dir.file("small.tok"), "small");
  INFO(small.out);
  REQUIRE(small.rc == 0);
  write_tok(dir.file("big.tok"), int64_t{1} << 29, false);  // 1 GiB, sparse
  Measured big = train(dir.file("big.tok"), "big");
  REQUIRE(big.rc == 0);
  auto first_step_s = [](const std::string& log) {
    const std::string key = "first step done ";
    const size_t at = log.find(key);
    REQUIRE(at != std::string::npos);
    return std::stod(log.substr(at + key.size())) / 1000.0;
  };
  const double s_small = first_step_s(small.out), s_big = first_step_s(big.out);
  std::cout << "10 MB: peak RSS " << small.max_rss_kb / 1024 << " MB, first step " << s_small
            << " s; 1 GiB: peak RSS " << big.max_rss_kb / 1024 << " MB, first step " << s_big
            << " s\n";
  CHECK(big.max_rss_kb - small.max_rss_kb < 100 * 1024);
  CHECK(s_big - s_small < 1.0);
}
