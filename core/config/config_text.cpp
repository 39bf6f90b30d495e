// The config's text forms, all derived from the option registry: --dump-config's TOML,
// --help, the README's option reference, the startup table and the config hash.
#include "core/config/config.h"

#include <iomanip>
#include <sstream>

#include "core/config/config_detail.h"

namespace titan {

using namespace config_detail;

// ---- public: text forms --------------------------------------------------------------------

std::string dump_config_toml(const JobConfig& cfg) {
  std::ostringstream os;
  os << "# titan-train effective config (defaults < TOML < command line)\n";
  std::string cur;
  for (auto& o : registry()) {
    // The file pointer is not part of the config; `later` keys can only hold their default.
    if (o.name() == "job.config_file" || !o.later.empty()) continue;
    if (o.section != cur) {
      os << (cur.empty() ? "" : "\n") << "[" << o.section << "]\n";
      cur = o.section;
    }
    const OptValue v = o.get(cfg);
    if (o.string_groups) {  // torchtitan's array of arrays: [["a", "b"], ["c"]]
      std::vector<std::string> groups;
      for (const std::string& g : std::get<std::vector<std::string>>(v)) {
        std::istringstream is(g);
        std::vector<std::string> items;
        for (std::string w; is >> w;) items.push_back(w);
        groups.push_back(format_option_value(items));
      }
      os << o.key << " = [" << join(groups, ", ") << "]\n";
      continue;
    }
    os << o.key << " = " << format_option_value(v) << "\n";
  }
  return os.str();
}

std::string usage_text() {
  return "titan-train: pre-train Llama-3, Llama-4, DeepSeek-V3 and Qwen3 models on LibTorch.\n\n"
         "Usage:\n"
         "  titan-train --config FILE [--section.key=value | --section.key value]...   train\n"
         "  titan-train estimate --config FILE [--world N] [--gpu h100] [--set key=value]\n"
         "  titan-train data-preview --config FILE [--steps N] [--rank R] [--world W]\n"
         "  titan-train tokenize --tokenizer FILE --output OUT INPUT...\n"
         "  titan-train convert-hf --model llama3 --flavor F --from-hf DIR --to-safetensors FILE\n"
         "  titan-train convert-hf --model llama3 --flavor F --from-safetensors FILE --to-hf DIR\n"
         "                         [--dtype float32|bfloat16|float16]\n"
         "  titan-train generate --config FILE (--checkpoint DIR | --from-hf DIR) --prompt TEXT\n"
         "                       [--max-new-tokens N --temperature T --top-k K --top-p P --seed S]\n"
         "  titan-train --config FILE --dump-schedule   print the pipeline stages and schedule\n"
         "  titan-train --help | --dump-config\n\n"
         "Subcommands: estimate, data-preview, tokenize, convert-hf, generate (each takes --help).\n\n"
         "Most common:\n"
         "  titan-train --config configs/llama3_debug.toml --training.steps 50\n"
         "  titan-train --config my.toml --training.dataset_path data.tok "
         "--model.tokenizer_path tok.json\n";
}

std::string config_help_text() {
  std::ostringstream os;
  os << usage_text() << "\n"
        "Precedence: defaults < TOML file < command line. Booleans: --key, --key=true,\n"
        "--key false. Lists: --key a,b or --key a b. Empty values: --key= .\n\n"
        "Options:\n";
  std::string cur;
  for (auto& o : registry()) {
    if (o.section != cur) {
      os << "\n[" << o.section << "]\n";
      cur = o.section;
    }
    os << "  --" << o.name() << " <" << opt_type_name(o.type)
       << ">  (default: " << format_option_value(o.default_value) << ")\n      " << o.help;
    std::string allowed = allowed_text(o);
    if (!allowed.empty()) os << "; allowed: " << allowed;
    if (!o.aliases.empty()) os << "; older name: " << join(o.aliases, ", ");
    os << "\n";
  }
  os << "\nAccepted with a warning and ignored (torchtitan keys): "
     << join(ignored_torchtitan_keys(), ", ") << "\n";
  return os.str();
}

std::string config_reference_markdown() {
  auto esc = [](const std::string& s) {
    std::string r;
    for (char c : s) r += (c == '|') ? std::string("\\|") : std::string(1, c);
    return r;
  };
  std::ostringstream os;
  os << "| key | type | default | allowed | description |\n|---|---|---|---|---|\n";
  for (auto& o : registry()) {
    std::string help = o.help;
    if (!o.aliases.empty()) help += " (older name: " + join(o.aliases, ", ") + ")";
    os << "| `" << o.name() << "` | " << opt_type_name(o.type) << " | `"
       << esc(format_option_value(o.default_value)) << "` | " << esc(allowed_text(o)) << " | "
       << esc(help) << " |\n";
  }
  return os.str();
}

std::string config_table(const JobConfig& cfg) {
  std::ostringstream os;
  size_t w = 0;
  for (auto& o : registry()) w = std::max(w, o.name().size());
  std::string rule(w + 40, '-');
  os << "+" << rule << "\n";
  os << "| " << std::left << std::setw(static_cast<int>(w)) << "option"
     << " | value\n";
  os << "+" << rule << "\n";
  for (auto& o : registry()) {
    if (!o.later.empty()) continue;
    OptValue v = o.get(cfg);
    bool changed = v != o.default_value;
    os << "| " << std::left << std::setw(static_cast<int>(w)) << o.name() << " | "
       << format_option_value(v) << (changed ? "  *" : "") << "\n";
  }
  os << "+" << rule << "\n";
  os << "(* differs from the default)\n";
  return os.str();
}

uint64_t config_hash(const JobConfig& cfg) {
  std::string s = dump_config_toml(cfg);
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace titan
