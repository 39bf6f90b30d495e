// What the Hugging Face family files (models/hf_<family>.cpp) share with models/hf_interop.cpp
// beyond the public API: path and dtype spellings, and the config.json checks of an import.
#pragma once

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <initializer_list>
#include <string>
#include <vector>

#include "core/train/model.h"
#include "models/hf_interop.h"

namespace titan::hf_detail {

// `dir` without trailing slashes ("/" stays "/").
std::string strip_slashes(std::string dir);
// Every parameter, whole, under its name.
NamedTensors named(const ParamStore& params);
// config.json's torch_dtype spelling of an export dtype.
const char* hf_dtype_name(at::ScalarType dtype);

// Maps a SwiGLU feed-forward, in this order: <ours>w1.weight, w2, w3 <-> <hf>gate_proj.weight,
// down_proj, up_proj.
void add_hf_swiglu(std::vector<HfTensorMap>& m, const std::string& ours, const std::string& hf);

// `dir`/config.json as an object, or null when the folder (import_hf reports that) or the file
// is missing (warned with `missing_means`). Unreadable JSON is a UserError.
nlohmann::ordered_json read_hf_config(const std::string& dir_arg,
                                      const std::string& missing_means);
// Each of `keys` that config.json sets (not null) must equal `want`'s value (UserError).
void require_same_fields(const nlohmann::ordered_json& cfg, const nlohmann::ordered_json& want,
                         std::initializer_list<const char*> keys, const std::string& path);
// Warns when config.json's rope_theta or rms_norm_eps differ from the model's.
void warn_rope_theta_and_eps(const nlohmann::ordered_json& cfg, double rope_theta, double eps,
                             const std::string& path);

}  // namespace titan::hf_detail
