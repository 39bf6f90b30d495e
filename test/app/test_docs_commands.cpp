// Every `titan-train` command shown in a code block of README.md and docs/*.md runs from the
// build and exits as the text says (issue 45: the docs had drifted from the binary). Each
// command is either run, rewritten to a short form of itself (one training step, files of
// the test's own), or listed below as skipped with its reason; a new command in the docs
// that is neither fails the test, and so does a skip entry that no longer matches a command.
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

using namespace titan;
namespace fs = std::filesystem;

namespace {

struct DocCommand {
  std::string file;  // README.md or docs/x.md
  int line = 0;      // of the command's first line
  std::string text;  // continuation lines joined, comment dropped
};

// The commands of a markdown file: lines inside ``` blocks that start (after an optional
// "$ " prompt and environment assignments) with the binary or with torchrun launching it.
std::vector<DocCommand> doc_commands(const std::string& root, const std::string& file) {
  std::ifstream in(root + "/" + file);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  static const std::regex cmd(
      R"(^\s*(\$ )?([A-Z_]+=\S+ )*((\./)?build/titan-train|titan-train|torchrun)(\s|$))");
  std::vector<DocCommand> out;
  bool block = false;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (l.find("```") != std::string::npos && l.find_first_not_of(" ") == l.find("```")) {
      block = !block;
      continue;
    }
    if (!block || !std::regex_search(l, cmd)) continue;
    if (l.find("titan-train") == std::string::npos) continue;  // torchrun of something else
    DocCommand c{file, static_cast<int>(i + 1), l};
    while (!c.text.empty() && c.text.back() == '\\' && i + 1 < lines.size()) {
      c.text.pop_back();
      c.text += " " + lines[++i];
    }
    // A trailing "# comment" (none of the commands has a # inside an argument).
    if (auto h = c.text.find(" #"); h != std::string::npos) c.text.resize(h);
    c.text = std::regex_replace(c.text, std::regex(R"(\s+)"), " ");
    c.text = std::regex_replace(c.text, std::regex(R"(^\s*(\$ )?|\s+$)"), "");
    out.push_back(c);
  }
  return out;
}

// Commands not run, each matched by a piece of its text, with the reason. Multi-rank layouts
// have their own equality tests (test/parallel, test/app/test_pipeline_train.cpp); here the
// test runs what one CPU process runs in seconds.
struct Skip {
  const char* file;
  const char* piece;
  const char* reason;
};
const Skip kSkips[] = {
    {"README.md", "--parallelism.pipeline_parallel_degree 2 --training.local_batch_size 4",
     "2 ranks under torchrun (PP 2 training: test_pipeline_train.cpp)"},
    {"README.md", "'fineweb/*.parquet'", "needs FineWeb's parquet files"},
    {"README.md", "'fineweb-edu/*.parquet'", "needs FineWeb-Edu's parquet files"},
    {"README.md", "'fineweb10B/fineweb_train_*.bin'", "needs llm.c's FineWeb shards"},
    {"README.md", "--config my.toml --training.dataset_path /data/",
     "trains on the /data/fw shards the line above would write from FineWeb-Edu"},
    {"README.md", "--from-hf Llama-3.2-1B/", "needs Meta's Llama-3.2-1B download"},
    {"README.md", "--from-hf SmolLM-135M/", "needs the SmolLM-135M download"},
    {"README.md", "--model qwen3 --flavor 0.6B --from-hf Qwen3-0.6B/",
     "needs the Qwen3-0.6B download (qwen3 convert-hf: test_qwen3.cpp)"},
    {"README.md", "--checkpoint outputs/qwen3_debug/checkpoint",
     "reads the checkpoint a qwen3 training run writes (generate: test_generate.cpp)"},
    {"README.md", "--from-hf Qwen3-0.6B/ --prompt", "needs the Qwen3-0.6B download"},
    {"docs/models.md", "--model qwen3 --flavor 0.6B --from-hf Qwen3-0.6B/",
     "needs the Qwen3-0.6B download"},
    {"README.md", "--from-safetensors w.safetensors --to-hf out/ --dtype bfloat16",
     "reads the w.safetensors the Llama-3.2-1B line writes"},
    {"README.md", "--model deepseek_v3 --flavor 16B --from-safetensors",
     "needs a DeepSeek-V3 16B safetensors file (about 60 GiB)"},
    {"docs/data.md", "--tokenizer TOK.json --output OUT [--format",
     "a synopsis with placeholders, not a command"},
    {"docs/data.md", "--input OLD.tok --output NEW.tok", "a synopsis with placeholders"},
    {"docs/distributed.md", "--config llama4_17bx16e.toml",
     "Llama-4 17Bx16E on 8+ GPUs (its config is parsed by test_torchtitan_configs.cpp)"},
    {"docs/distributed.md", "build/titan-train --config llama3_70b.toml",
     "Llama-3 70B on 8 GPUs (the estimate line beside it runs here)"},
    {"docs/distributed.md",
     "--nproc_per_node 8 --no-python build/titan-train --config "
     "configs/llama3_8b.toml",
     "8 GPUs (async TP of llama3 8B)"},
    {"docs/distributed.md", "--parallelism.enable_async_tensor_parallel true",
     "2 ranks under torchrun (async TP: test_async_tensor_parallel.cpp)"},
    {"docs/distributed.md", "--parallelism.context_parallel_degree=2",
     "2 ranks under torchrun (CP: test_context_parallel.cpp)"},
    {"docs/distributed.md", "--parallelism.pipeline_parallel_schedule Interleaved1F1B",
     "2 ranks under torchrun (test_pipeline_train.cpp)"},
    {"docs/distributed.md", "--training.local_batch_size 4 --training.global_batch_size 8",
     "4 ranks under torchrun (PP 2 x FSDP 2: test_pipeline_train.cpp)"},
    {"docs/distributed.md", "--model.name llama4 --parallelism.pipeline_parallel_degree 2",
     "8 ranks under torchrun (PP 2 x TP 2 x EP 2: test_pipeline_train.cpp)"},
    {"docs/distributed.md",
     "--parallelism.pipeline_parallel_degree 2 "
     "--parallelism.context_parallel_degree 2",
     "4 ranks under torchrun (PP 2 x CP 2: test_pipeline_train.cpp)"},
};

// A doc's config name as the test finds it: configs/x.toml in the repository, or one of
// torchtitan's own configs (llama3_70b.toml) kept under test/core/config/torchtitan_v022.
std::string resolve_path(const std::string& root, const std::string& word) {
  if (word.rfind("configs/", 0) == 0) return root + "/" + word;
  if (word.size() > 5 && word.compare(word.size() - 5, 5, ".toml") == 0 &&
      word.find('/') == std::string::npos) {
    const std::string tt = root + "/test/core/config/torchtitan_v022/" + word;
    if (fs::exists(tt)) return tt;
  }
  return word;
}

// The command as the test runs it: the built binary, repository paths made absolute, the
// README's tokenizer and data files replaced by the test's, and a training run cut to one
// step with its output in `dir` (the keys it sets replace the same keys in the text).
std::string runnable(const DocCommand& c, const std::string& dir) {
  const std::string root = test::source_dir();
  std::istringstream is(c.text);
  std::vector<std::string> words;
  for (std::string w; is >> w;) words.push_back(w);
  static const std::set<std::string> kSubcommands = {"tokenize", "convert-hf", "estimate",
                                                     "data-preview"};
  static const std::set<std::string> kShort = {"--training.steps", "--validation.enable",
                                               "--metrics.enable_tensorboard", "--job.dump_folder",
                                               "--training.device"};
  bool training = true;
  std::vector<std::string> out;
  for (size_t i = 0; i < words.size(); ++i) {
    std::string w = words[i];
    if (w == "build/titan-train" || w == "./build/titan-train" || w == "titan-train") {
      out.push_back(test::binary());
      if (i + 1 == words.size() || kSubcommands.count(words[i + 1]) || words[i + 1] == "--help")
        training = false;
      continue;
    }
    if (w == "--dump-config" || w == "--dump-schedule") training = false;
    if (kShort.count(w) && i + 1 < words.size()) {  // replaced below
      ++i;
      continue;
    }
    if (w == "tok.json") w = test::tokenizer_path();
    out.push_back(resolve_path(root, w));
  }
  std::string cmd;
  for (const std::string& w : out) cmd += (cmd.empty() ? "" : " ") + w;
  if (training)
    cmd +=
        " --training.steps 1 --validation.enable false --metrics.enable_tensorboard false "
        "--training.device cpu --job.dump_folder " +
        dir + "/out";
  return cmd;
}

}  // namespace

TEST_CASE("docs: every titan-train command in README.md and docs/*.md runs and exits 0",
          "[docs][cli]") {
  // Reference: the text itself. Each command runs in a scratch folder on one process
  // (OMP_NUM_THREADS=1), exit 0 expected (none of the commands shown is an error example);
  // the skipped ones are listed above with their reasons.
  const std::string root = test::source_dir();
  std::vector<std::string> files = {"README.md"};
  for (auto& e : fs::directory_iterator(root + "/docs"))
    if (e.path().extension() == ".md") files.push_back("docs/" + e.path().filename().string());
  std::sort(files.begin() + 1, files.end());
  std::vector<DocCommand> all;
  for (const std::string& f : files)
    for (const DocCommand& c : doc_commands(root, f)) all.push_back(c);
  REQUIRE(all.size() >= 20);
  std::set<const Skip*> used;
  int ran = 0, skipped = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const DocCommand& c : all) {
    INFO(c.file << ":" << c.line << ": " << c.text);
    const Skip* skip = nullptr;
    for (const Skip& s : kSkips)
      if (!skip && c.file == s.file && c.text.find(s.piece) != std::string::npos) skip = &s;
    if (skip) {
      used.insert(skip);
      ++skipped;
      continue;
    }
    // Multi-rank launches must be listed: one process cannot run them.
    REQUIRE(c.text.find("torchrun") == std::string::npos);
    test::TempDir dir("doccmd");
    // The README's tokenize example reads data.jsonl: three short documents.
    test::write_file(dir.file("data.jsonl"),
                     "{\"text\": \"In the beginning God created the heaven and the earth.\"}\n"
                     "{\"text\": \"And the earth was without form, and void.\"}\n"
                     "{\"text\": \"And God said, Let there be light: and there was light.\"}\n");
    const std::string cmd = runnable(c, dir.path.string());
    auto r = test::run("cd " + dir.path.string() +
                       " && env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK "
                       "OMP_NUM_THREADS=1 timeout 120 sh -c " +
                       test::shell_quote(cmd));
    INFO("ran: " << cmd << "\n" << r.out);
    CHECK(r.rc == 0);
    ++ran;
  }
  for (const Skip& s : kSkips) {
    INFO("skip entry with no command left in " << s.file << ": " << s.piece);
    CHECK(used.count(&s) == 1);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WARN("docs: " << all.size() << " commands, " << ran << " run, " << skipped
                << " skipped with a reason, in " << secs << " s");
  CHECK(ran + skipped == static_cast<int>(all.size()));
  CHECK(ran >= 10);
}
