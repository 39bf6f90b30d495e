// A small real checkpoint for the reader's tests and its fuzz target
// (test/core/checkpoint/test_checkpoint_reader.cpp, test/fuzz/fuzz_checkpoint_meta.cpp).
#pragma once

#include <string>

#include "core/checkpoint/checkpoint.h"

namespace titan::test_fixtures {

// Saves one rank's checkpoint of step 1 under `root` and returns its folder, root/step-1:
// model.w [4, 3] f32, model.b [3] bf16, model.s a scalar i64, model.e [0, 3] f32 and
// optim.m [2, 2, 2] f64.
inline std::string save_small_checkpoint(const std::string& root) {
  CheckpointSnapshot s;
  s.step = 1;
  auto add = [&](const std::string& key, at::Tensor t) {
    s.entries.push_back({key, t, t.sizes().vec(), 0});
  };
  add("model.w", at::arange(12, at::kFloat).reshape({4, 3}));
  add("model.b", at::ones({3}, at::kBFloat16));
  add("model.s", at::scalar_tensor(7, at::kLong));
  add("model.e", at::empty({0, 3}));
  add("optim.m", at::zeros({2, 2, 2}, at::kDouble));
  s.train_state_json = R"({"step": 1})";
  CheckpointWriter w(root, {}, 1, 0);
  w.save(std::move(s), false);
  return root + "/step-1";
}

}  // namespace titan::test_fixtures
