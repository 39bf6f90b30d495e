#include "parallel/mesh.h"

#include <vector>

namespace titan {

std::string Mesh::describe() const {
  return "dp_replicate " + std::to_string(replicate) + " x dp_shard " + std::to_string(shard) +
         " (ep " + std::to_string(ep) + " x efsdp " + std::to_string(efsdp()) + ")";
}

void Mesh::start_training() {
  world->start_training();
  for (auto& g : owned) g->start_training();
}

std::unique_ptr<Mesh> build_mesh(ProcessGroup& world, int64_t replicate, int64_t shard,
                                 int64_t ep) {
  TORCH_CHECK(replicate * shard == world.size() && shard % ep == 0, "inconsistent mesh degrees");
  auto m = std::make_unique<Mesh>();
  m->replicate = replicate;
  m->shard = shard;
  m->ep = ep;
  m->world = &world;
  const int64_t r = world.rank();
  m->replicate_index = r / shard;
  m->shard_index = r % shard;
  m->ep_index = m->shard_index % ep;
  m->efsdp_index = m->shard_index / ep;
  auto global = [&](int64_t rep, int64_t efsdp, int64_t e) { return rep * shard + efsdp * ep + e; };
  // Every rank creates its groups in the same order; groups of one kind are disjoint.
  auto group = [&](const char* name, const std::vector<int64_t>& ranks) {
    if (static_cast<int64_t>(ranks.size()) == world.size()) return &world;
    m->owned.push_back(world.subgroup(name, ranks));
    return m->owned.back().get();
  };
  std::vector<int64_t> ranks;
  for (int64_t s = 0; s < shard; ++s) ranks.push_back(m->replicate_index * shard + s);
  m->shard_group = group("dp_shard", ranks);
  ranks.clear();
  for (int64_t rep = 0; rep < replicate; ++rep) ranks.push_back(rep * shard + m->shard_index);
  m->replicate_group = group("dp_replicate", ranks);
  if (ep > 1) {
    ranks.clear();
    for (int64_t e = 0; e < ep; ++e) ranks.push_back(global(m->replicate_index, m->efsdp_index, e));
    m->ep_group = group("ep", ranks);
    ranks.clear();
    for (int64_t f = 0; f < m->efsdp(); ++f)
      ranks.push_back(global(m->replicate_index, f, m->ep_index));
    m->efsdp_group = group("efsdp", ranks);
  }
  return m;
}

}  // namespace titan
