// Pipeline stages and schedules as data (parallel/pipeline_stages.h, pipeline_schedule.h).
// References: torchtitan 0.2.2's stage split and PyTorch 2.11's schedule orders, printed by
// test/reference/pp_stage_split_table.py from the test venv (exact equality); the bubble of
// GPipe and 1F1B against (p-1)/(m+p-1) (tolerance 1e-12); the deadlock check against planted
// faults (a dropped receive, a duplicated forward, a cycle between two ranks); bad input as
// UserErrors (exit status 2) naming the key.
#include <catch2/catch.hpp>

#include <cmath>
#include <iostream>

#include "core/base/errors.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/pipeline_stages.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
using json = nlohmann::json;

namespace {

// The reference table, computed once per test binary run (importing torch takes seconds).
const json& reference() {
  static const json ref = [] {
    auto r = test::run(test::python() + " " + test::source_dir() +
                       "/test/reference/pp_stage_split_table.py");
    INFO(r.out.substr(0, 3000));
    REQUIRE(r.rc == 0);
    return json::parse(r.out);
  }();
  return ref;
}

std::vector<std::vector<std::string>> strings(const PipelineSchedule& s) {
  std::vector<std::vector<std::string>> out;
  for (const auto& rank : s.ranks) {
    out.emplace_back();
    for (const auto& a : rank) out.back().push_back(a.str());
  }
  return out;
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}

const std::vector<std::string> kGenerated = {
    "GPipe",         "1F1B",     "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble",
    "ZBVZeroBubble", "DualPipeV"};

// torchtitan's message and the words of ours that give the same reason.
const std::vector<std::pair<std::string, std::string>> kSameReason = {
    {"cannot be greater than effective layers", "more stages than weighted layers"},
    {"must be divisible by pipeline parallel size", "does not divide"},
    {"Single stage schedule requires exactly 1 stage", "runs exactly 1 stage per rank"},
    {"Multi-stage schedule requires at least 2", "needs at least 2 stages per rank"},
    {"input_weight (", "pipeline_parallel_first_stage_less_layers = "},
    {"output_weight (", "pipeline_parallel_last_stage_less_layers = "},
    {"v schedules assume 2 stages per rank", "needs exactly 2 stages per rank"},
};

}  // namespace

TEST_CASE("pp: the stage split equals torchtitan 0.2.2's", "[pp]") {
  const json& ref = reference();
  REQUIRE(ref["torchtitan"] == "0.2.2");
  int compared = 0, refused = 0;
  for (const auto& c : ref["splits"]) {
    const json& k = c["case"];
    INFO(k.dump());
    PipelineSplitOptions o;
    o.pp_degree = k["pp"];
    o.schedule = k["schedule"];
    if (k.contains("lps")) o.layers_per_stage = k["lps"];
    if (k.contains("first")) o.first_stage_less_layers = k["first"];
    if (k.contains("last")) o.last_stage_less_layers = k["last"];
    if (k.contains("fqns")) o.module_fqns_per_model_part = k["fqns"];
    const int64_t layers = k["layers"];
    if (c.contains("error")) {
      INFO("torchtitan: " << c["error"].get<std::string>());
      const std::string msg = what_of([&] { plan_pipeline_stages(layers, o); });
      CHECK_THAT(msg, Contains("parallelism."));
      // The same reason as torchtitan's.
      const std::string theirs = c["error"];
      int matched = 0;
      for (const auto& [tt, ours] : kSameReason) {
        if (theirs.find(tt) == std::string::npos) continue;
        CHECK_THAT(msg, Contains(ours));
        ++matched;
      }
      CHECK(matched == 1);
      ++refused;
      continue;
    }
    const PipelineStagePlan plan = plan_pipeline_stages(layers, o);
    REQUIRE(plan.num_stages() == static_cast<int64_t>(c["fqns"].size()));
    for (int64_t s = 0; s < plan.num_stages(); ++s) {
      CHECK(plan.stages[s].fqns == c["fqns"][s].get<std::vector<std::string>>());
      // The unit range covers the same modules.
      const auto& sp = plan.stages[s];
      CHECK(sp.end_unit() - sp.first_unit() ==
            static_cast<int64_t>(sp.fqns.size()) - (sp.has_head ? 1 : 0));
    }
    for (int64_t r = 0; r < o.pp_degree; ++r) {
      const auto mine = plan.stages_of_rank(r);
      CHECK(mine == c["ranks"][r].get<std::vector<int64_t>>());
      for (auto s : mine) CHECK(plan.stages[s].rank == r);
    }
    ++compared;
  }
  std::cout << "[pp] stage splits: " << compared << " equal torchtitan 0.2.2's, " << refused
            << " refused by both" << std::endl;
  CHECK(compared > 250);
  CHECK(refused > 40);
}

TEST_CASE("pp: stages map to the model's parameter units", "[pp]") {
  // docs/distributed.md's example: llama3 debugmodel (6 layers) over pp 2 with 1F1B. Units:
  // 0 the embeddings, 1..6 the layers, 7 the head.
  PipelineSplitOptions o;
  o.pp_degree = 2;
  const auto plan = plan_pipeline_stages(6, o);
  REQUIRE(plan.num_stages() == 2);
  CHECK(plan.stages[0].fqns ==
        std::vector<std::string>{"tok_embeddings", "layers.0", "layers.1", "layers.2"});
  CHECK(plan.stages[0].first_unit() == 0);
  CHECK(plan.stages[0].end_unit() == 4);
  CHECK(plan.stages[1].first_unit() == 4);
  CHECK(plan.stages[1].end_unit() == 8);
  // ZBV over 2 ranks with 2 layers per stage: rank 0 holds the first and the last stage.
  o.schedule = "ZBVZeroBubble";
  o.layers_per_stage = 2;
  const auto v = plan_pipeline_stages(6, o);
  REQUIRE(v.num_stages() == 4);
  CHECK(v.stages_of_rank(0) == std::vector<int64_t>{0, 3});
  CHECK(v.stages_of_rank(1) == std::vector<int64_t>{1, 2});
  CHECK(v.stage_to_rank() == std::vector<int64_t>{0, 1, 1, 0});
  CHECK(v.stages[3].fqns == std::vector<std::string>{"layers.5", "norm", "output"});
  CHECK(v.stages[3].first_unit() == 6);
  CHECK(v.stages[3].end_unit() == 8);
}

TEST_CASE("pp: schedule orders equal PyTorch 2.11's", "[pp]") {
  const json& ref = reference();
  int compared = 0;
  for (const auto& c : ref["schedules"]) {
    INFO(c["name"] << " p " << c["p"] << " v " << c["v"] << " m " << c["m"]);
    const auto s = make_schedule(c["name"], c["p"], c["v"], c["m"]);
    CHECK(strings(s) == c["ranks"].get<std::vector<std::vector<std::string>>>());
    ++compared;
  }
  std::cout << "[pp] schedule orders: " << compared << " equal torch " << ref["torch"].dump()
            << "'s" << std::endl;
  CHECK(compared > 250);
}

TEST_CASE("pp: 1F1B runs Schedule1F1B._step_microbatches' order", "[pp]") {
  // Warm-up of min(m, p - stage) forwards, then one backward and one forward, then the
  // remaining backwards.
  const auto s = make_schedule("1f1b", 4, 1, 6);
  const std::vector<std::vector<std::string>> want = {
      {"0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5", "0B2", "0B3", "0B4", "0B5"},
      {"1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3", "1B4", "1B5"},
      {"2F0", "2F1", "2B0", "2F2", "2B1", "2F3", "2B2", "2F4", "2B3", "2F5", "2B4", "2B5"},
      {"3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3F4", "3B4", "3F5", "3B5"}};
  CHECK(strings(s) == want);
  CHECK(s.stage_to_rank == std::vector<int64_t>{0, 1, 2, 3});
  CHECK(make_schedule("ZBVZeroBubble", 3, 2, 4).stage_to_rank ==
        std::vector<int64_t>{0, 1, 2, 2, 1, 0});
}

TEST_CASE("pp: every generator passes the deadlock check", "[pp]") {
  int checked = 0, refused = 0;
  const ScheduleCosts unit{1, 1, 1, 1};
  for (const auto& name : kGenerated) {
    for (int64_t p : {1, 2, 3, 4, 5, 6, 8}) {
      for (int64_t v : {1, 2, 3, 4}) {
        for (int64_t m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24}) {
          INFO(name << " p " << p << " v " << v << " m " << m);
          PipelineSchedule s;
          try {
            s = make_schedule(name, p, v, m);
          } catch (const UserError&) {
            ++refused;
            continue;
          }
          ScheduleTimeline t;
          REQUIRE_NOTHROW(t = check_schedule(s));
          REQUIRE_NOTHROW(check_schedule(add_transfers(s), unit));
          // Each rank's compute: F 1 + B 2, or F 1 + I 1 + W 1 ticks per micro-batch and stage.
          for (auto b : t.busy) CHECK(b == 3 * v * m);
          CHECK(t.bubble_fraction >= 0.0);
          CHECK(t.bubble_fraction < 1.0);
          ++checked;
        }
      }
    }
  }
  std::cout << "[pp] deadlock check: " << checked << " generated schedules pass, " << refused
            << " sizes refused" << std::endl;
  CHECK(checked > 500);
}

TEST_CASE("pp: GPipe and 1F1B bubble is (p-1)/(m+p-1)", "[pp]") {
  int checked = 0;
  for (const ScheduleCosts& costs : {ScheduleCosts{}, ScheduleCosts{1, 1, 1, 1}}) {
    for (const char* name : {"GPipe", "1F1B"}) {
      for (int64_t p = 1; p <= 8; ++p) {
        for (int64_t m = p; m <= 16; ++m) {
          const auto t = check_schedule(make_schedule(name, p, 1, m), costs);
          const double theory = double(p - 1) / double(m + p - 1);
          INFO(name << " p " << p << " m " << m << " B cost " << costs.backward);
          CHECK(std::abs(t.bubble_fraction - theory) < 1e-12);
          ++checked;
        }
      }
    }
  }
  // GPipe with fewer micro-batches than stages follows the same formula.
  CHECK(std::abs(check_schedule(make_schedule("GPipe", 8, 1, 2)).bubble_fraction - 7.0 / 9.0) <
        1e-12);
  // Interleaving v stages per rank divides the bubble by v (m a multiple of p):
  // (p-1)/(v*m + p-1) here, where every chunk's action takes as long as a whole stage's.
  for (int64_t v : {2, 3, 4}) {
    const auto t = check_schedule(make_schedule("Interleaved1F1B", 4, v, 8));
    INFO("Interleaved1F1B v " << v);
    CHECK(std::abs(t.bubble_fraction - 3.0 / (v * 8 + 3)) < 1e-12);
  }
  std::cout << "[pp] bubble: " << checked << " GPipe/1F1B cases equal (p-1)/(m+p-1) to 1e-12;"
            << " p 4, m 8:";
  for (const auto& [name, v] :
       std::vector<std::pair<std::string, int64_t>>{{"GPipe", 1},
                                                    {"1F1B", 1},
                                                    {"LoopedBFS", 2},
                                                    {"Interleaved1F1B", 2},
                                                    {"InterleavedZeroBubble", 2},
                                                    {"ZBVZeroBubble", 2},
                                                    {"DualPipeV", 2}})
    std::cout << " " << name << " " << check_schedule(make_schedule(name, 4, v, 8)).bubble_fraction;
  std::cout << std::endl;
}

TEST_CASE("pp: the CSV round-trips", "[pp]") {
  for (const auto& name : kGenerated) {
    const int64_t v = schedule_info(name).single_stage ? 1 : 2;
    for (const auto& s :
         {make_schedule(name, 4, v, 8), add_transfers(make_schedule(name, 3, v, 6))}) {
      INFO(name << " with transfers " << s.has_comms());
      const auto back = schedule_from_csv(schedule_to_csv(s), "mem.csv");
      CHECK(back.ranks == s.ranks);
      CHECK(back.stage_to_rank == s.stage_to_rank);
      CHECK(back.num_ranks == s.num_ranks);
      CHECK(back.num_stages == s.num_stages);
      CHECK(back.num_microbatches == s.num_microbatches);
      CHECK(schedule_to_csv(back) == schedule_to_csv(s));
    }
  }
  test::TempDir dir("pp-csv");
  const auto s = make_schedule("InterleavedZeroBubble", 2, 2, 4);
  save_schedule_csv(s, dir.file("zb.csv"));
  CHECK(load_schedule_csv(dir.file("zb.csv")).ranks == s.ranks);
  // PyTorch's _dump_csv keeps idle slots as empty cells; they are skipped.
  const auto py = schedule_from_csv("0F0,0F1,,0B0,0B1\r\n,1F0,1B0,1F1,1B1\r\n", "py.csv");
  CHECK(py.ranks[0].size() == 4);
  CHECK(py.ranks[1][0] == Action{1, ActionType::kForward, 0});
  CHECK_NOTHROW(check_schedule(py));
  for (const char* a :
       {"0F1", "12B3", "2I3", "2W3", "0SEND_F1", "1RECV_F1", "1SEND_B0", "0RECV_B0"})
    CHECK(parse_action(a, "test").str() == a);
}

TEST_CASE("pp: the forward-only schedule (validation) passes the check, backwards do not", "[pp]") {
  // Loop placement with 2 stages per rank, and the V: every forward once, activations sent
  // down the stages, no gradient transfer, no deadlock.
  for (bool v : {false, true}) {
    const auto where = pipeline_stage_ranks(4, 8, v);
    const PipelineSchedule fwd = make_forward_schedule(where, 4, 3);
    INFO((v ? "V" : "loop"));
    ScheduleTimeline t;
    REQUIRE_NOTHROW(t = check_schedule(fwd));
    CHECK(t.makespan > 0);
    const PipelineSchedule lowered = add_transfers(fwd);
    int64_t sends = 0;
    for (const auto& r : lowered.ranks)
      for (const Action& a : r) {
        CHECK(a.type != ActionType::kSendB);
        CHECK(a.type != ActionType::kRecvB);
        sends += a.type == ActionType::kSendF;
      }
    // Every stage boundary between ranks, for each of the 3 micro-batches (the V's turn is
    // local).
    CHECK(sends == 3 * (v ? 6 : 7));
    auto with_b = fwd;
    with_b.ranks[0].push_back(Action{0, ActionType::kBackward, 0});
    CHECK_THAT(what_of([&] { check_schedule(with_b); }),
               Contains("expected none (a forward-only schedule)"));
  }
}

TEST_CASE("pp: a corrupted schedule is caught", "[pp]") {
  const auto good = add_transfers(make_schedule("1F1B", 4, 1, 8));
  REQUIRE_NOTHROW(check_schedule(good));

  auto dropped = good;  // rank 2 forgets to receive micro-batch 5's activations
  auto& r2 = dropped.ranks[2];
  r2.erase(std::find(r2.begin(), r2.end(), Action{2, ActionType::kRecvF, 5}));
  const std::string msg = what_of([&] { check_schedule(dropped); });
  INFO(msg);
  CHECK_THAT(msg, Contains("stage 2 micro-batch 5: 2RECV_F5 appears 0 times on rank 2"));

  auto extra = good;  // a send nobody receives
  extra.ranks[0].push_back(Action{0, ActionType::kSendF, 8 - 1});
  CHECK_THAT(what_of([&] { check_schedule(extra); }), Contains("0SEND_F7 appears 2 times"));

  auto twice = good;  // a forward run twice
  twice.ranks[1].insert(twice.ranks[1].begin() + 3, Action{1, ActionType::kForward, 0});
  CHECK_THAT(what_of([&] { check_schedule(twice); }), Contains("1F0 appears 2 times"));

  auto late = good;  // the receive placed after the forward that needs it: a deadlock
  auto& r3 = late.ranks[3];
  auto recv = std::find(r3.begin(), r3.end(), Action{3, ActionType::kRecvF, 0});
  std::iter_swap(recv, recv + 1);
  const std::string stuck = what_of([&] { check_schedule(late); });
  INFO(stuck);
  CHECK_THAT(stuck, Contains("deadlocks"));
  CHECK_THAT(stuck, Contains("rank 3 waits at 3F0"));

  auto weight_first = make_schedule("ZBVZeroBubble", 2, 2, 4);  // W before its I
  auto& w0 = weight_first.ranks[0];
  auto i = std::find(w0.begin(), w0.end(), Action{0, ActionType::kBackwardInput, 0});
  auto w = std::find(w0.begin(), w0.end(), Action{0, ActionType::kBackwardWeight, 0});
  std::iter_swap(i, w);
  CHECK_THAT(what_of([&] { check_schedule(weight_first); }), Contains("waits at 0W0"));

  // A planted deadlock as a user would bring it: rank 1 forwards micro-batch 1 first, rank 0
  // waits for micro-batch 0's gradient before forwarding micro-batch 1.
  test::TempDir dir("pp-dead");
  test::write_file(dir.file("dead.csv"), "0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n");
  const auto dead = load_schedule_csv(dir.file("dead.csv"));
  const std::string cyc = what_of([&] { check_schedule(dead); });
  INFO(cyc);
  CHECK_THAT(cyc, Contains("deadlocks"));
  CHECK_THAT(cyc, Contains("rank 0 waits at 0RECV_B0 (action 3 of 8) for 1SEND_B0 (rank 1)"));
  CHECK_THAT(cyc, Contains("rank 1 waits at 1RECV_F1 (action 1 of 8) for 0SEND_F1 (rank 0)"));
}

TEST_CASE("pp: bad input is a UserError naming the key", "[pp]") {
  auto says = [](const std::function<void()>& f, const std::string& part) {
    const std::string msg = what_of(f);
    INFO(msg);
    CHECK_THAT(msg, Contains(part));
  };
  says([] { make_schedule("1F1B", 4, 1, 3); }, "parallelism.pipeline_parallel_microbatch_size");
  says([] { make_schedule("1F1B", 4, 1, 3); }, "3 micro-batches for 4 stages");
  says([] { make_schedule("ZBVZeroBubble", 2, 3, 4); }, "needs exactly 2 stages per rank");
  says([] { make_schedule("GPipe", 2, 2, 4); }, "runs exactly 1 stage per rank");
  says([] { make_schedule("Interleaved1F1B", 4, 2, 9); }, "multiple of the rounds");
  says([] { make_schedule("DualPipeV", 2, 2, 3); }, "needs at least as many micro-batches");
  says([] { make_schedule("ZeroBubble", 2, 2, 4); }, "parallelism.pipeline_parallel_schedule");
  says([] { make_schedule("1F1B", 2, 1, 0); }, "parallelism.pipeline_parallel_microbatch_size");

  PipelineSplitOptions o;
  o.pp_degree = 2;
  o.schedule = "ZBVZeroBubble";
  o.layers_per_stage = 1;  // 8 weighted layers: 8 stages, 4 per rank
  says([&] { plan_pipeline_stages(6, o); }, "exactly 2 stages per rank");
  o.layers_per_stage = 3;  // 3 stages over 2 ranks
  says([&] { plan_pipeline_stages(6, o); }, "parallelism.pipeline_parallel_layers_per_stage");
  o = PipelineSplitOptions{};
  o.pp_degree = 8;
  says([&] { plan_pipeline_stages(4, o); }, "parallelism.pipeline_parallel_degree");
  o.pp_degree = 4;
  o.first_stage_less_layers = 3;  // 4 + 3 + 1 over 4 stages: at least 2 each
  says([&] { plan_pipeline_stages(4, o); },
       "parallelism.pipeline_parallel_first_stage_less_layers");

  o = PipelineSplitOptions{};
  o.pp_degree = 2;
  using Parts = std::vector<std::vector<std::string>>;
  const std::string key = "parallelism.module_fqns_per_model_part";
  o.module_fqns_per_model_part =
      Parts{{"tok_embeddings", "layers.0"}, {"layers.2", "norm", "output"}};
  says([&] { plan_pipeline_stages(3, o); }, key + " stage 1 names 'layers.2' where 'layers.1'");
  o.module_fqns_per_model_part =
      Parts{{"tok_embeddings", "layers.0", "norm"}, {"layers.1", "output"}};
  says([&] { plan_pipeline_stages(2, o); }, "comes next");
  o.module_fqns_per_model_part =
      Parts{{"tok_embeddings", "layers.0", "layers.1", "norm"}, {"output"}};
  says([&] { plan_pipeline_stages(2, o); }, "stay in one stage");
  o.module_fqns_per_model_part = Parts{{"tok_embeddings", "layers.0"}, {"layers.1"}};
  says([&] { plan_pipeline_stages(2, o); }, "leaves out 'norm'");
  o.module_fqns_per_model_part = Parts{{"tok_embeddings", "layer.0"}, {"norm", "output"}};
  says([&] { plan_pipeline_stages(1, o); }, "not a module of this model");
  o.module_fqns_per_model_part = Parts{{"tok_embeddings", "layers.0"}, {}, {"norm", "output"}};
  says([&] { plan_pipeline_stages(1, o); }, "has no modules");

  const std::string csv = "parallelism.pipeline_parallel_schedule_csv";
  says([] { schedule_from_csv("0F0,0X1\n", "bad.csv"); }, csv + " = bad.csv row 1 column 2");
  says([] { schedule_from_csv("0F0,0UNSHARD\n", "bad.csv"); }, "does not schedule yet");
  says([] { schedule_from_csv("0F0,0B0\n0F1,0B1\n", "two.csv"); }, "is on rank 0 and on rank 1");
  says([] { schedule_from_csv("\n\n", "empty.csv"); }, "holds no schedule");
  says([] { load_schedule_csv("/nonexistent/pp.csv"); }, csv);
}

TEST_CASE("pp: the grid shows ranks as rows and ticks as columns", "[pp]") {
  const auto s = make_schedule("1F1B", 4, 1, 8);
  const auto t = check_schedule(s);
  const std::string grid = render_schedule_grid(s, t);
  std::cout << grid << std::endl;
  std::cout << render_schedule_grid(make_schedule("ZBVZeroBubble", 2, 2, 4),
                                    check_schedule(make_schedule("ZBVZeroBubble", 2, 2, 4)))
            << std::endl;
  std::stringstream ss(grid);
  std::vector<std::string> lines;
  for (std::string l; std::getline(ss, l);) lines.push_back(l);
  REQUIRE(lines.size() == 2 + 4);  // legend, ruler, one row per rank
  CHECK_THAT(lines[0], Contains("1F1B: 4 ranks, 4 stages, 8 micro-batches; 33 ticks"));
  // Rank 0 starts at tick 0 and idles while the first micro-batch goes down and back up;
  // every rank's idle cells add up to the bubble.
  CHECK(lines[2].rfind("rank 0 |0F0 0F1 0F2 0F3 .", 0) == 0);
  int64_t idle = 0;
  for (int r = 0; r < 4; ++r) {
    std::stringstream row(lines[2 + r].substr(lines[2 + r].find('|') + 1));
    int64_t cells = 0;
    for (std::string c; row >> c; ++cells) idle += c == ".";
    CHECK(cells == 33);
  }
  CHECK(static_cast<double>(idle) / (4.0 * 33) == Approx(t.bubble_fraction).epsilon(1e-12));
}
