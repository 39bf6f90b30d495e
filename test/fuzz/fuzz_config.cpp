// libFuzzer target for the configuration: TOML text (first byte even) or a command line of
// --key=value arguments, one per line (first byte odd). A configuration that parses and
// validates must survive its own --dump-config: the dump parses back to the same config.
// Arguments naming a config file are skipped: reading files is the TOML half's business.
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "test/fuzz/fuzz_util.h"

namespace {

void check_round_trip(const titan::JobConfig& cfg) {
  titan::validate_config(cfg);
  titan::JobConfig back = titan::default_config();
  std::vector<std::string> warnings;
  titan::apply_toml_string(back, titan::dump_config_toml(cfg), "dump", warnings);
  if (titan::config_hash(back) != titan::config_hash(cfg)) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    return titan::fuzz::run_one([&] {
      titan::JobConfig cfg = titan::default_config();
      std::vector<std::string> warnings;
      titan::apply_toml_string(cfg, text, "fuzz.toml", warnings);
      check_round_trip(cfg);
    });
  }
  std::vector<std::string> args{"titan-train"};
  size_t b = 0;
  for (size_t e; (e = text.find('\n', b)) != std::string::npos; b = e + 1)
    args.push_back(text.substr(b, e - b));
  args.push_back(text.substr(b));
  for (const auto& a : args)
    if (a.find("config") != std::string::npos) return 0;
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return titan::fuzz::run_one([&] {
    auto r = titan::parse_command_line(static_cast<int>(argv.size()), argv.data());
    check_round_trip(r.cfg);
  });
}
