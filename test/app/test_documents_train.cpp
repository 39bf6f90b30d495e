// Block-causal training through the binary (docs/attention.md), on a text file of short
// documents cut from the bundled corpus (3 lines each, ~60 tokens, so most 64-token windows
// cross a boundary): block_causal changes the losses; the CPU capture check passes with it and
// changes no loss; PP 2, TP 2 and CP 2 (documents crossing the cp chunks) give the losses and
// grad norms of one process to 1e-5 relative (fp32 sums in another order, the other layout
// tests' tolerance); an unknown mask exits 2 naming the key.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <sstream>
#include <string>

#include "core/data/data_fixtures.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

const std::string kCommon =
    "--config configs/llama3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
    "--validation.enable false --metrics.enable_tensorboard false --training.device cpu "
    "--training.steps 3 --training.local_batch_size 4 --debug.seed 3 "
    "--model.attn_mask_type block_causal --comm.train_timeout_seconds 120 ";

test::CmdResult train(int nproc, const std::string& args, const std::string& dir) {
  return test::train_ranks(
      nproc, kCommon + "--training.dataset_path " + test::short_documents_file() + " " + args, dir);
}

using Step = test::StepFigures;

std::map<int64_t, Step> metrics(const test::TempDir& dir) {
  return test::step_figures(dir.file("metrics.jsonl"));
}

double worst_rel(const std::map<int64_t, Step>& ref, const std::map<int64_t, Step>& got) {
  return test::worst_rel_either(ref, got);
}

}  // namespace

TEST_CASE("documents: block_causal trains, passes the capture check and changes the loss",
          "[attention][app]") {
  test::TempDir bc("doc_bc"), causal("doc_causal"), checked("doc_checked");
  auto b = train(1, "", bc.path.string());
  INFO(b.out);
  REQUIRE(b.rc == 0);
  CHECK_THAT(b.out, Contains("=> attention: block_causal"));
  auto c = train(1, "--model.attn_mask_type causal", causal.path.string());
  REQUIRE(c.rc == 0);
  // Step 1 (same weights, same tokens): the mask alone makes the difference.
  CHECK(std::abs(metrics(bc)[1].loss - metrics(causal)[1].loss) > 1e-4);
  auto k = train(1, "--compile.enable true --training.mixed_precision_param float32",
                 checked.path.string());
  INFO(k.out);
  REQUIRE(k.rc == 0);
  CHECK_THAT(k.out, Contains("ops per step, static"));
  CHECK(worst_rel(metrics(bc), metrics(checked)) < 1e-5);
}

TEST_CASE("documents: PP 2, TP 2 and CP 2 with block_causal equal 1 rank",
          "[attention][dist][app]") {
  test::TempDir ref("doc_ref");
  const std::string flags = "--model.document_positions true --model.document_loss true ";
  auto r = train(1, flags, ref.path.string());
  INFO(r.out);
  REQUIRE(r.rc == 0);
  for (const std::string layout :
       {"--parallelism.pipeline_parallel_degree 2 --activation_checkpoint.mode full",
        "--parallelism.tensor_parallel_degree 2", "--parallelism.context_parallel_degree 2"}) {
    test::TempDir dir("doc_layout");
    auto p = train(2, flags + layout, dir.path.string());
    INFO(layout << "\n" << p.out);
    REQUIRE(p.rc == 0);
    const double worst = worst_rel(metrics(ref), metrics(dir));
    WARN(layout << ": max relative loss / grad norm difference to 1 rank " << worst);
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("documents: an unknown mask or attention type exits 2 naming the key",
          "[attention][app]") {
  test::TempDir dir("doc_bad");
  auto m = train(1, "--model.attn_mask_type sliding", dir.path.string());
  CHECK(m.rc == 2);
  CHECK_THAT(m.out, Contains("model.attn_mask_type"));
  auto t = train(1, "--model.attn_type flash", dir.path.string());
  CHECK(t.rc == 2);
  CHECK_THAT(t.out, Contains("model.attn_type"));
}

TEST_CASE("documents: block_causal on data without an EOS says so at start", "[attention][app]") {
  test::TempDir dir("doc_noeos");
  // llm.c tokens 2..201 repeated: the default tokenizer's EOS is id 1, so no boundary.
  std::vector<uint16_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(2 + i % 200);
  test::write_llmc(dir.file("noeos.bin"), tokens);
  auto r = test::train_ranks(
      1, kCommon + "--training.steps 1 --training.dataset_path " + dir.file("noeos.bin"),
      dir.path.string());
  INFO(r.out);
  REQUIRE(r.rc == 0);
  CHECK_THAT(r.out, Contains("training tokens of '" + dir.file("noeos.bin")) &&
                        Contains("hold no EOS") && Contains("model.attn_mask_type"));
  // The documents of the text file end at EOS: no such line.
  test::TempDir ok("doc_eos");
  auto o = train(1, "--training.steps 1", ok.path.string());
  REQUIRE(o.rc == 0);
  CHECK_THAT(o.out, !Contains("hold no EOS"));
}
