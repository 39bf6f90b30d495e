#include "models/hf_fp8.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/base/strings.h"
#include "models/hf_interop_detail.h"

namespace titan::hf_detail {

std::string hf_scale_inv_name(const std::string& weight) {
  return weight + "_scale_inv";
}

namespace {

// A positive integer of `q`'s weight_block_size, or a UserError.
int64_t block_dim(const nlohmann::ordered_json& v, const std::string& where) {
  if (!v.is_number_integer() || v.get<int64_t>() <= 0)
    throw UserError(where + ": found " + v.dump() + "; expected a positive integer");
  return v.get<int64_t>();
}

}  // namespace

HfFp8Blocks hf_fp8_blocks(const std::string& dir, const std::string& first_fp8) {
  const std::string path = strip_slashes(dir) + "/config.json";
  const std::string assume =
      "assuming DeepSeek-V3's weight_block_size [128, 128] for its float8 tensors (" + first_fp8 +
      " ...)";
  const nlohmann::ordered_json cfg = read_hf_config(dir, assume);
  HfFp8Blocks b;
  if (cfg.is_null()) return b;
  if (!cfg.contains("quantization_config") || cfg["quantization_config"].is_null()) {
    log_warn(path + " has no quantization_config: " + assume);
    return b;
  }
  const nlohmann::ordered_json& q = cfg["quantization_config"];
  const std::string key = path + ": quantization_config";
  if (!q.is_object()) throw UserError(key + " = " + q.dump() + "; expected an object");
  if (q.contains("quant_method") && q["quant_method"] != "fp8")
    throw UserError(key + ".quant_method = " + q["quant_method"].dump() +
                    "; allowed: \"fp8\" (block-wise float8, as DeepSeek-V3 publishes)");
  if (q.contains("fmt") && q["fmt"] != "e4m3")
    throw UserError(key + ".fmt = " + q["fmt"].dump() + "; allowed: \"e4m3\"");
  if (!q.contains("weight_block_size")) return b;
  const nlohmann::ordered_json& ws = q["weight_block_size"];
  if (!ws.is_array() || ws.size() != 2)
    throw UserError(key + ".weight_block_size = " + ws.dump() +
                    "; expected [rows, cols] of a block, e.g. [128, 128]");
  b.rows = block_dim(ws[0], key + ".weight_block_size[0]");
  b.cols = block_dim(ws[1], key + ".weight_block_size[1]");
  return b;
}

std::vector<int64_t> hf_fp8_scale_shape(const std::vector<int64_t>& shape, HfFp8Blocks b) {
  TORCH_CHECK(shape.size() == 2, "hf_fp8_scale_shape: a 2-D weight, not ", shape_str(shape));
  return {(shape[0] + b.rows - 1) / b.rows, (shape[1] + b.cols - 1) / b.cols};
}

void check_hf_fp8_pair(const SafetensorsFile& wf, const SafetensorsEntry& w,
                       const SafetensorsFile* sf, const SafetensorsEntry* s, HfFp8Blocks b) {
  const std::string tensor = "Hugging Face tensor '" + w.name + "' in " + wf.path();
  if (w.dtype != at::ScalarType::Float8_e4m3fn)
    throw UserError(tensor + " has dtype " + safetensors_dtype_name(w.dtype) +
                    "; allowed float8: F8_E4M3 (quantization_config.fmt e4m3)");
  if (w.shape.size() != 2)
    throw UserError(tensor + " is float8 of shape " + shape_str(w.shape) +
                    "; block-wise float8 weights are 2-D");
  const std::vector<int64_t> want = hf_fp8_scale_shape(w.shape, b);
  const std::string blocks =
      "one scale per [" + std::to_string(b.rows) + ", " + std::to_string(b.cols) +
      "] block (config.json quantization_config.weight_block_size) of " + shape_str(w.shape);
  const std::string scale = hf_scale_inv_name(w.name);
  if (s == nullptr)
    throw UserError(tensor + " is F8_E4M3 but the folder has no '" + scale +
                    "' to dequantize it; expected shape " + shape_str(want) + ", " + blocks);
  if (!at::isFloatingType(s->dtype) || at::isFloat8Type(s->dtype))
    throw UserError("Hugging Face tensor '" + scale + "' in " + sf->path() + " has dtype " +
                    safetensors_dtype_name(s->dtype) + "; expected F32 (or F64, F16, BF16)");
  if (s->shape != want)
    throw UserError("Hugging Face tensor '" + scale + "' in " + sf->path() + " has shape " +
                    shape_str(s->shape) + "; expected " + shape_str(want) + ", " + blocks);
}

at::Tensor dequantize_hf_fp8_rows(const at::Tensor& w, const std::vector<int64_t>& rows,
                                  const SafetensorsFile& sf, const std::string& scale_name,
                                  HfFp8Blocks b, int64_t& bytes) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == static_cast<int64_t>(rows.size()),
              "dequantize_hf_fp8_rows: ", rows.size(), " rows but a tensor of shape ",
              shape_str(w.sizes()));
  if (rows.empty()) return w.to(at::kFloat);
  const auto [lo, hi] = std::minmax_element(rows.begin(), rows.end());
  const int64_t first = *lo / b.rows, last = *hi / b.rows;
  at::Tensor s = sf.get_rows(scale_name, first, last - first + 1);  // (block rows, col blocks)
  bytes += static_cast<int64_t>(s.nbytes());
  const at::Tensor block_row = at::tensor(rows, at::kLong).div(b.rows, "floor") - first;  // (n,)
  // (n, cols): each element's block scale; the last column block may be partial.
  s = s.to(at::kFloat)
          .index_select(0, block_row)
          .repeat_interleave(b.cols, 1)
          .narrow(1, 0, w.size(1));
  // One float32 rounding of fp8 x scale, as DeepSeek's weight_dequant computes it.
  return w.to(at::kFloat).mul(s);
}

}  // namespace titan::hf_detail
