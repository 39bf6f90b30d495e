#include "parallel/mesh.h"

#include <vector>

namespace titan {

std::string Mesh::describe() const {
  return "dp_replicate " + std::to_string(replicate) + " x dp_shard " + std::to_string(shard / cp) +
         (cp > 1 ? " x cp " + std::to_string(cp) : "") +
         (tp > 1 ? " x tp " + std::to_string(tp) : "") + " (ep " + std::to_string(ep) +
         " x efsdp " + std::to_string(efsdp()) + ")";
}

void Mesh::start_training() {
  world->start_training();
  for (auto& g : owned) g->start_training();
}

std::unique_ptr<Mesh> build_mesh(ProcessGroup& world, int64_t replicate, int64_t shard, int64_t ep,
                                 int64_t tp, int64_t cp) {
  shard *= cp;  // context parallelism folds into the shard dimension (mesh.h)
  TORCH_CHECK(replicate * shard * tp == world.size() && shard % ep == 0,
              "inconsistent mesh degrees");
  auto m = std::make_unique<Mesh>();
  m->cp = cp;
  m->replicate = replicate;
  m->shard = shard;
  m->ep = ep;
  m->tp = tp;
  m->world = &world;
  const int64_t dp = world.rank() / tp;
  m->tp_index = world.rank() % tp;
  m->replicate_index = dp / shard;
  m->shard_index = dp % shard;
  m->ep_index = m->shard_index % ep;
  m->efsdp_index = m->shard_index / ep;
  m->cp_index = m->shard_index % cp;
  auto global = [&](int64_t rep, int64_t s) { return (rep * shard + s) * tp + m->tp_index; };
  // Every rank creates its groups in the same order; groups of one kind are disjoint.
  auto group = [&](const std::string& name, const std::vector<int64_t>& ranks) {
    if (static_cast<int64_t>(ranks.size()) == world.size()) return &world;
    m->owned.push_back(world.subgroup(name, ranks));
    return m->owned.back().get();
  };
  // The group names carry the tp index when tp > 1: sub-groups of different tp indices run
  // their rendezvous side by side.
  const std::string sfx = tp > 1 ? "/tp" + std::to_string(m->tp_index) : "";
  std::vector<int64_t> ranks;
  for (int64_t s = 0; s < shard; ++s) ranks.push_back(global(m->replicate_index, s));
  m->shard_group = group("dp_shard" + sfx, ranks);
  ranks.clear();
  for (int64_t rep = 0; rep < replicate; ++rep) ranks.push_back(global(rep, m->shard_index));
  m->replicate_group = group("dp_replicate" + sfx, ranks);
  if (ep > 1) {
    ranks.clear();
    for (int64_t e = 0; e < ep; ++e)
      ranks.push_back(global(m->replicate_index, m->efsdp_index * ep + e));
    m->ep_group = group("ep" + sfx, ranks);
    ranks.clear();
    for (int64_t f = 0; f < m->efsdp(); ++f)
      ranks.push_back(global(m->replicate_index, f * ep + m->ep_index));
    m->efsdp_group = group("efsdp" + sfx, ranks);
  }
  if (cp > 1) {
    ranks.clear();
    const int64_t first = m->shard_index - m->cp_index;
    for (int64_t c = 0; c < cp; ++c) ranks.push_back(global(m->replicate_index, first + c));
    m->cp_group = group("cp" + sfx, ranks);
  }
  if (tp > 1) {
    ranks.clear();
    for (int64_t t = 0; t < tp; ++t) ranks.push_back(dp * tp + t);
    m->tp_group = group("tp", ranks);
  }
  return m;
}

}  // namespace titan
