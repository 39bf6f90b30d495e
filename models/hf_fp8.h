// Block-wise float8 Hugging Face checkpoints (DeepSeek-V3's published weights): a linear weight
// stored as float8 e4m3fn `W` [rows, cols] has a companion `W_scale_inv` of shape
// [ceil(rows / br), ceil(cols / bc)] (float32), one scale per br x bc block (the blocks at the
// right and bottom edges are partial), and the weight is W.float() * scale_inv of its block.
// config.json says so in quantization_config {"quant_method": "fp8", "fmt": "e4m3",
// "weight_block_size": [br, bc]} ([128, 128] in DeepSeek-V3). The import dequantizes on load,
// in float32, then converts to the target's dtype: float8 is never a storage format of ours.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/checkpoint/safetensors.h"

namespace titan::hf_detail {

struct HfFp8Blocks {
  int64_t rows = 128;
  int64_t cols = 128;
};

// "<weight>_scale_inv".
std::string hf_scale_inv_name(const std::string& weight);

// The block size config.json's quantization_config gives for the float8 tensors of `dir`
// (`first_fp8` names one, for the messages). UserError when quant_method is not "fp8", fmt not
// "e4m3" or weight_block_size not two positive integers; [128, 128] with a warning when
// config.json or its quantization_config is missing.
HfFp8Blocks hf_fp8_blocks(const std::string& dir, const std::string& first_fp8);

// [ceil(rows / b.rows), ceil(cols / b.cols)] for a weight of `shape` (2-D).
std::vector<int64_t> hf_fp8_scale_shape(const std::vector<int64_t>& shape, HfFp8Blocks b);

// Checks float8 entry `w` of `wf` (dtype e4m3fn, 2-D) and its scale entry `s` of `sf` (nullptr
// when the folder has none): present, floating, not float8, of hf_fp8_scale_shape. UserError
// naming the file and the tensor otherwise.
void check_hf_fp8_pair(const SafetensorsFile& wf, const SafetensorsEntry& w,
                       const SafetensorsFile* sf, const SafetensorsEntry* s, HfFp8Blocks b);

// Rows `rows` (HF row indices, any order) of a float8 weight, already read as `w` [n, cols]
// float8, dequantized to float32 with the scales of their blocks, read from `sf`'s
// `scale_name` (only the block rows they fall in; their bytes are added to `bytes`).
at::Tensor dequantize_hf_fp8_rows(const at::Tensor& w, const std::vector<int64_t>& rows,
                                  const SafetensorsFile& sf, const std::string& scale_name,
                                  HfFp8Blocks b, int64_t& bytes);

}  // namespace titan::hf_detail
