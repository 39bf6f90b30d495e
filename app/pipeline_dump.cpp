#include "app/pipeline_dump.h"

#include <cstdio>
#include <sstream>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "models/registry.h"

namespace titan {
namespace {

// "tok_embeddings, layers.0-2, norm, output": runs of consecutive layers folded.
std::string fold_fqns(const std::vector<std::string>& fqns) {
  std::string out;
  auto layer_of = [](const std::string& f) -> int64_t {
    return f.rfind("layers.", 0) == 0 ? std::stoll(f.substr(7)) : -1;
  };
  for (size_t i = 0; i < fqns.size();) {
    size_t j = i;
    const int64_t first = layer_of(fqns[i]);
    while (first >= 0 && j + 1 < fqns.size() &&
           layer_of(fqns[j + 1]) == first + static_cast<int64_t>(j + 1 - i))
      ++j;
    out += out.empty() ? "" : ", ";
    out += j > i ? fqns[i] + "-" + std::to_string(layer_of(fqns[j])) : fqns[i];
    i = j + 1;
  }
  return out;
}

std::vector<std::string> split_spaces(const std::string& s) {
  std::istringstream is(s);
  std::vector<std::string> out;
  for (std::string w; is >> w;) out.push_back(w);
  return out;
}

}  // namespace

PipelinePlan plan_pipeline(const JobConfig& cfg, int64_t n_layers, bool tied_embeddings) {
  const auto& p = cfg.parallelism;
  PipelinePlan plan;
  plan.n_layers = n_layers;
  if (tied_embeddings && p.pipeline_parallel_degree > 1)
    throw UserError(
        "parallelism.pipeline_parallel_degree = " + std::to_string(p.pipeline_parallel_degree) +
        " with model.flavor = " + cfg.model.flavor +
        ", whose output weight is tied to the embeddings; allowed: an untied "
        "flavor (the first and last stages cannot share a weight, as in torchtitan)");
  const int64_t lbs = cfg.training.local_batch_size, mbs = p.pipeline_parallel_microbatch_size;
  if (lbs % mbs != 0)
    throw UserError("parallelism.pipeline_parallel_microbatch_size = " + std::to_string(mbs) +
                    " does not divide training.local_batch_size = " + std::to_string(lbs) +
                    "; allowed: a divisor of it (micro-batches = local_batch_size / this)");
  plan.microbatches = lbs / mbs;

  PipelineSplitOptions opt;
  opt.pp_degree = p.pipeline_parallel_degree;
  opt.schedule = p.pipeline_parallel_schedule;
  opt.layers_per_stage = p.pipeline_parallel_layers_per_stage;
  opt.first_stage_less_layers = p.pipeline_parallel_first_stage_less_layers;
  opt.last_stage_less_layers = p.pipeline_parallel_last_stage_less_layers;
  for (const std::string& stage : p.module_fqns_per_model_part)
    opt.module_fqns_per_model_part.push_back(split_spaces(stage));
  plan.stages = plan_pipeline_stages(n_layers, opt);

  PipelineSchedule compute;
  const std::string& csv = p.pipeline_parallel_schedule_csv;
  if (!csv.empty()) {
    compute = load_schedule_csv(csv);
    const std::string who = "parallelism.pipeline_parallel_schedule_csv = " + csv;
    auto mismatch = [&](const char* what, int64_t found, int64_t want, const std::string& key) {
      if (found != want)
        throw UserError(who + " has " + std::to_string(found) + " " + what + ", but " + key +
                        " gives " + std::to_string(want) + "; allowed: a schedule of " +
                        std::to_string(want) + " " + what);
    };
    mismatch("ranks", compute.num_ranks, opt.pp_degree, "parallelism.pipeline_parallel_degree");
    mismatch("stages", compute.num_stages, plan.stages.num_stages(), "the stage split");
    if (compute.stage_to_rank != plan.stages.stage_to_rank())
      throw UserError(who + " places stages on other ranks than " +
                      "parallelism.pipeline_parallel_schedule = " + plan.stages.schedule.name +
                      " does; allowed: the same placement (loop: stage s on rank s % p; V: rank "
                      "r holds stages r and 2p-1-r)");
    // The CSV's micro-batches are the largest index it names + 1.
    int64_t m = 0;
    for (const auto& row : compute.ranks)
      for (const Action& a : row) m = std::max(m, a.microbatch + 1);
    compute.num_microbatches = std::max(compute.num_microbatches, m);
    mismatch("micro-batches", compute.num_microbatches, plan.microbatches,
             "training.local_batch_size / parallelism.pipeline_parallel_microbatch_size");
  } else {
    compute = make_schedule(plan.stages.schedule.name, opt.pp_degree, plan.stages.stages_per_rank,
                            plan.microbatches);
  }
  // DualPipeV's forward + backward pairs: overlapped when they can hide an expert all-to-all
  // (not under capture: a CUDA graph replays one stream). Otherwise plain actions, lowered
  // with each SEND right after its compute, which leaves a smaller bubble.
  for (const auto& row : compute.ranks)
    for (const Action& a : row) plan.has_pairs = plan.has_pairs || a.paired;
  plan.overlap_pairs = plan.has_pairs && p.pipeline_parallel_expert_parallel_overlap &&
                       p.expert_parallel_degree > 1 && !cfg.compile.enable;
  if (!plan.overlap_pairs)
    for (auto& row : compute.ranks)
      for (Action& a : row) a.paired = false;
  plan.schedule = compute.has_comms() ? compute : add_transfers(compute);
  plan.timeline = check_schedule(plan.schedule);
  return plan;
}

std::string describe_pipeline(const JobConfig& cfg, const PipelinePlan& plan) {
  const auto& p = cfg.parallelism;
  const auto& st = plan.stages;
  std::ostringstream os;
  os << "pipeline: " << cfg.model.name << " " << cfg.model.flavor << " (" << plan.n_layers
     << " layers) over pipeline_parallel_degree " << st.pp_degree << ", schedule "
     << (p.pipeline_parallel_schedule_csv.empty() ? st.schedule.name
                                                  : p.pipeline_parallel_schedule_csv)
     << "\n";
  os << "=> " << st.num_stages() << " stages, " << st.stages_per_rank << " per rank ("
     << (st.schedule.v_style ? "V: rank r holds stages r and 2p-1-r" : "stage s on rank s % p")
     << ")\n";
  os << "=> " << plan.microbatches << " micro-batches of " << p.pipeline_parallel_microbatch_size
     << " sequence(s) (training.local_batch_size " << cfg.training.local_batch_size << ")\n\n";
  os << "stage  rank  modules\n";
  for (const auto& s : st.stages) {
    char head[32];
    std::snprintf(head, sizeof head, "%-6lld %-5lld ", static_cast<long long>(s.index),
                  static_cast<long long>(s.rank));
    os << head << fold_fqns(s.fqns) << "\n";
  }
  os << "\nactions per rank, in order (F forward, B backward, I/W its input/weight halves, "
        "SEND/RECV the transfers):\n";
  for (size_t r = 0; r < plan.schedule.ranks.size(); ++r) {
    os << "rank " << r << ":";
    for (const Action& a : plan.schedule.ranks[r]) os << " " << a.str();
    os << "\n";
  }
  os << "\n" << render_schedule_grid(plan.schedule, plan.timeline);
  char tail[160];
  std::snprintf(tail, sizeof tail,
                "schedule check: passed (every action once, every SEND matched, no deadlock); "
                "bubble fraction %.4f\n",
                plan.timeline.bubble_fraction);
  os << "\n" << tail;
  return os.str();
}

int run_dump_schedule(const JobConfig& cfg) {
  // Exit 2, not a one-stage drawing: with degree 1 training runs no pipeline, so a schedule
  // printed here would describe nothing that runs, and a script asking for one learns that
  // its config has no pipeline (as the pipeline keys at degree 1 exit 2).
  if (cfg.parallelism.pipeline_parallel_degree == 1)
    throw UserError(
        "--dump-schedule with parallelism.pipeline_parallel_degree = 1: there is no pipeline "
        "(training runs the whole model on every rank, no stages, no schedule); allowed: "
        "pipeline_parallel_degree > 1 (e.g. --parallelism.pipeline_parallel_degree 2)");
  // The meta device allocates nothing: only the layer count and the tying are read. Its
  // start-up lines (the MoE experts backend) would be stray in the report.
  std::unique_ptr<Model> m;
  {
    QuietInfoScope quiet;
    m = build_model(cfg, at::kMeta, /*defer_params=*/false);
  }
  const bool tied = m->params().index_of("output.weight") < 0;
  const PipelinePlan plan = plan_pipeline(cfg, m->info().n_layers, tied);
  std::printf("%s", describe_pipeline(cfg, plan).c_str());
  return 0;
}

}  // namespace titan
