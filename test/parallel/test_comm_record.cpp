// CommRecord (parallel/comm_record.h): the collectives a captured step recorded are counted
// once per replay and not for the capture itself. Real collectives over a one-rank gloo group
// (a backend that runs and counts them, like the one-rank NCCL group on the GPU check).
#include <catch2/catch.hpp>

#include <unistd.h>

#include "core/config/config.h"
#include "parallel/comm_record.h"
#include "parallel/launch_env.h"
#include "parallel/process_group.h"

using namespace titan;

namespace {

ProcessGroup::CommCount count_of(const std::map<std::string, ProcessGroup::CommCount>& m,
                                 const std::string& kind) {
  auto it = m.find(kind);
  return it == m.end() ? ProcessGroup::CommCount{} : it->second;
}

}  // namespace

TEST_CASE("comm record: a recorded collective counts once per replay and not at its capture",
          "[dist]") {
  LaunchEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = 30000 + static_cast<int>(::getpid() % 20000) + 11;
  ProcessGroup pg(env, default_config().comm, /*cuda=*/false);
  at::Tensor t = at::full({256}, 2.0f);  // 1 KiB of fp32
  at::Tensor gathered = at::empty({256});
  const auto c0 = ProcessGroup::comm_counts();
  // An eager collective is counted by the host as it is issued.
  pg.allreduce(t);
  const auto c1 = ProcessGroup::comm_counts();
  CHECK(count_of(c1, "all-reduce").calls == count_of(c0, "all-reduce").calls + 1);
  CHECK(count_of(c1, "all-reduce").bytes == count_of(c0, "all-reduce").bytes + 1024);

  // "Capture": the collectives issued between begin and end become the record (here they
  // run, as gloo cannot be captured; on CUDA they are recorded into the graph, not run).
  CommRecord rec;
  CHECK(rec.empty());
  rec.begin();
  pg.allreduce(t);
  pg.all_gather(gathered, t);
  pg.allreduce(t, ReduceOp::Max);
  rec.end();
  CHECK(at::equal(gathered, t));  // they really ran over the backend
  REQUIRE(rec.record().size() == 2);
  CHECK(rec.record().at("all-reduce").calls == 2);
  CHECK(rec.record().at("all-reduce").bytes == 2048);
  CHECK(rec.record().at("all-gather").calls == 1);
  CHECK(rec.record().at("all-gather").bytes == 1024);
  // The capture itself is not counted: the counts are as before begin().
  const auto c2 = ProcessGroup::comm_counts();
  CHECK(count_of(c2, "all-reduce").calls == count_of(c1, "all-reduce").calls);
  CHECK(count_of(c2, "all-reduce").bytes == count_of(c1, "all-reduce").bytes);
  CHECK(count_of(c2, "all-gather").calls == count_of(c1, "all-gather").calls);

  // N replays add N x the record.
  const int64_t n = 5;
  for (int64_t i = 0; i < n; ++i) rec.replay();
  const auto c3 = ProcessGroup::comm_counts();
  CHECK(count_of(c3, "all-reduce").calls == count_of(c2, "all-reduce").calls + 2 * n);
  CHECK(count_of(c3, "all-reduce").bytes == count_of(c2, "all-reduce").bytes + 2048 * n);
  CHECK(count_of(c3, "all-gather").calls == count_of(c2, "all-gather").calls + n);
  CHECK(count_of(c3, "all-gather").bytes == count_of(c2, "all-gather").bytes + 1024 * n);
  CHECK(count_of(c3, "reduce-scatter").calls == count_of(c2, "reduce-scatter").calls);

  // A re-capture replaces the record; one with no collective records nothing.
  rec.begin();
  rec.end();
  CHECK(rec.empty());
  rec.replay();
  CHECK(count_of(ProcessGroup::comm_counts(), "all-reduce").calls ==
        count_of(c3, "all-reduce").calls);
}
