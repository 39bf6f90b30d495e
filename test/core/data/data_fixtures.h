// Small token files for the blend and loader tests, written with core's .tok v2 writer (whose
// layout test_token_source.cpp checks against numpy) and as raw llm.c shards.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "core/data/token_source.h"

namespace titan::test {

// n tokens with ids first_id, first_id + 1, ... in documents of doc_len tokens (the last one
// shorter), so a window's first id says where it starts. vocab 65536: uint16 tokens.
inline void write_sequential_tok(const std::string& path, int64_t n, int64_t first_id,
                                 int64_t doc_len, int64_t vocab = 65536) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets = {0};
  for (int64_t i = 0; i < n; ++i) {
    tokens.push_back(static_cast<int32_t>(first_id + i));
    if ((i + 1) % doc_len == 0 || i + 1 == n) offsets.push_back(i + 1);
  }
  write_tok_v2(path, tokens, offsets, vocab);
}

// An llm.c shard: 256 x int32 header (20240520, 1, n), then uint16 tokens.
inline void write_llmc(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens.size());
  std::ofstream o(path, std::ios::binary);
  o.write(reinterpret_cast<const char*>(header.data()), 1024);
  o.write(reinterpret_cast<const char*>(tokens.data()),
          static_cast<std::streamsize>(2 * tokens.size()));
}

}  // namespace titan::test
