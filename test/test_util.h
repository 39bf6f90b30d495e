// Helpers shared by the tests: paths of the build, the set-up cache and the Python venv,
// running the binary, and scratch folders.
#pragma once

#include <vector>
#include <functional>
#include <algorithm>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

namespace titan::test {

// The environment overrides the paths compiled in, so a test binary built here also runs
// from another checkout path (scripts/gpu_check.sh carries it to a GPU machine).
inline std::string env_or(const char* name, const char* fallback) {
  const char* e = std::getenv(name);
  return e && *e ? e : fallback;
}
inline std::string source_dir() {
  return env_or("TITAN_SOURCE_DIR", TITAN_SOURCE_DIR);
}
inline std::string binary() {
  return env_or("TITAN_BINARY", TITAN_BINARY);
}
inline std::string python() {
  return env_or("TITAN_PYTHON", TITAN_TEST_PYTHON);
}
// torchrun of the same Python environment.
inline std::string torchrun() {
  const std::string py = python();
  const auto slash = py.rfind('/');
  return (slash == std::string::npos ? std::string() : py.substr(0, slash + 1)) + "torchrun";
}
inline std::string cache_dir() {
  const char* e = std::getenv("TITAN_CACHE");
  if (e && *e) return e;
  return std::string(std::getenv("HOME")) + "/.cache/titan-train";
}
inline std::string corpus_path() {
  return cache_dir() + "/data/kjv.txt";
}
inline std::string tokenizer_path() {
  return cache_dir() + "/data/tokenizer.json";
}

struct CmdResult {
  int rc = -1;
  std::string out;  // stdout and stderr together
};

// Runs a shell command, capturing stdout+stderr.
inline CmdResult run(const std::string& cmd) {
  CmdResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = pclose(p);
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

// A run's own exit status: the process's, or under torchrun (which exits 1 whenever a
// worker fails) the workers' from its summary ("exitcode  : 2"). A user error on one rank
// (2, 3 or 4: app/fatal.h) makes its peers fail too, with 1 (a closed connection) or -15
// (stopped by torchrun), and torchrun's "Root Cause" may name such a peer: the first
// documented status among the workers is the run's, else the Root Cause's.
inline int exit_status(const CmdResult& r) {
  const std::string tag = "exitcode  : ";
  if (r.rc == 0 || r.out.find(tag) == std::string::npos) return r.rc;
  for (size_t at = r.out.find(tag); at != std::string::npos; at = r.out.find(tag, at + 1)) {
    const int code = std::atoi(r.out.c_str() + at + tag.size());
    if (code >= 2 && code <= 4) return code;
  }
  const size_t root = r.out.find("Root Cause");
  const size_t at = r.out.find(tag, root == std::string::npos ? 0 : root);
  return std::atoi(r.out.c_str() + at + tag.size());
}

// A fresh empty folder under the system temp dir, removed when the object dies.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    auto base = std::filesystem::temp_directory_path();
    for (int i = 0;; ++i) {
      path =
          base / ("titan-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(i));
      if (std::filesystem::create_directories(path)) break;
    }
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Packed documents for the block-causal tests (docs/attention.md): the corpus's first 3000
// non-empty lines with a blank line (the .txt reader's document separator) after every third,
// so documents are ~60 tokens and most 64- or 128-token windows cross a boundary. Written
// once per process.
inline const std::string& short_documents_file() {
  static TempDir dir("doc_data");
  static const std::string path = [] {
    std::istringstream in(read_file(corpus_path()));
    std::string line, text;
    int n = 0;
    while (n < 3000 && std::getline(in, line)) {
      if (line.empty()) continue;
      text += line + "\n";
      if (++n % 3 == 0) text += "\n";
    }
    write_file(dir.file("short.txt"), text);
    return dir.file("short.txt");
  }();
  return path;
}

// The training lines of a metrics.jsonl (those with a loss), by step. A resumed run appends
// to the same file, so the last line of a step wins; a half-written line is skipped.
inline std::map<int64_t, nlohmann::json> training_metrics(const std::string& file) {
  std::map<int64_t, nlohmann::json> out;
  std::stringstream ss(read_file(file));
  for (std::string line; std::getline(ss, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j.contains("loss"))
      out[j["step"].get<int64_t>()] = j;
  }
  return out;
}

// step -> training loss of the run whose dump folder is `dump`.
inline std::map<int64_t, double> losses(const std::string& dump) {
  std::map<int64_t, double> out;
  for (auto& [step, j] : training_metrics(dump + "/metrics.jsonl"))
    out[step] = j["loss"].get<double>();
  return out;
}

// Polls cond every 20 ms until it holds or `seconds` pass; returns its last value.
template <class F>
bool wait_for(F cond, double seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

// Ends the current test case as skipped: ctest reports it as "Skipped", never as passed
// (test/CMakeLists.txt sets SKIP_REGULAR_EXPRESSION to this marker). For tests that need
// what this machine lacks (a GPU, an optional tool).
#define TITAN_SKIP(why)                                      \
  do {                                                       \
    std::cout << "TITAN_TEST_SKIPPED: " << why << std::endl; \
    return;                                                  \
  } while (0)

// max |ours - ref| / max |ref| in double: the relative error the parity tests state.
// Benchmarks (hidden cases, never timed tests): the wall time of one call, and a median.
inline double ms_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

inline double rel_err(const at::Tensor& ours, const at::Tensor& ref) {
  at::Tensor a = ours.to(at::kDouble), b = ref.to(at::kDouble);
  double denom = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / (denom > 0 ? denom : 1.0);
}

inline std::string shell_quote(const std::string& s) {
  std::string r = "'";
  for (char c : s) r += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return r + "'";
}

// The largest relative differences of loss and of grad norm between two runs' metrics, over
// the steps of `a` (each must be in `b`): any step struct with `loss` and `grad_norm`.
template <class Step>
std::pair<double, double> worst_rel(const std::map<int64_t, Step>& a,
                                    const std::map<int64_t, Step>& b) {
  double loss = 0, norm = 0;
  for (auto& [step, s] : a) {
    const Step& t = b.at(step);
    loss = std::max(loss, std::abs(s.loss - t.loss) / std::abs(s.loss));
    norm = std::max(norm, std::abs(s.grad_norm - t.grad_norm) / std::abs(s.grad_norm));
  }
  return {loss, norm};
}

// Loss and gradient norm of one logged step.
struct StepFigures {
  double loss = 0, grad_norm = 0;
};

// A metrics.jsonl's training steps.
inline std::map<int64_t, StepFigures> step_figures(const std::string& metrics_jsonl) {
  std::map<int64_t, StepFigures> out;
  for (auto& [step, j] : training_metrics(metrics_jsonl))
    out[step] = {j["loss"].get<double>(), j["grad_norm"].get<double>()};
  return out;
}

// The larger of the two worst relative differences (loss, grad norm) over the steps of
// `ref`; infinity when `got` lacks one of them. The "equals 1 rank" bound of the layouts.
inline double worst_rel_either(const std::map<int64_t, StepFigures>& ref,
                               const std::map<int64_t, StepFigures>& got) {
  for (auto& [step, s] : ref)
    if (!got.count(step)) return INFINITY;
  const auto [loss, norm] = worst_rel(ref, got);
  return std::max(loss, norm);
}

// The binary with `args` from the source folder on `nproc` ranks (torchrun beyond one),
// dumping into `dump`.
inline CmdResult train_ranks(int nproc, const std::string& args, const std::string& dump) {
  const std::string bin = binary() + " " + args + " --job.dump_folder " + dump;
  if (nproc == 1) return run("cd " + source_dir() + " && env -u RANK -u WORLD_SIZE " + bin);
  return run("cd " + source_dir() + " && " + torchrun() + " --standalone --nproc_per_node " +
             std::to_string(nproc) + " --no-python " + bin);
}

}  // namespace titan::test
