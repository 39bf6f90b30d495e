#include "core/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <type_traits>

#include <CLI/CLI.hpp>
#include <toml++/toml.h>

#include "core/errors.h"

namespace titan {
namespace {

template <class T>
struct Identity {
  using type = T;
};

template <class T>
constexpr OptType type_of() {
  if constexpr (std::is_same_v<T, bool>) return OptType::Bool;
  if constexpr (std::is_same_v<T, int64_t>) return OptType::Int;
  if constexpr (std::is_same_v<T, double>) return OptType::Float;
  if constexpr (std::is_same_v<T, std::string>) return OptType::String;
  if constexpr (std::is_same_v<T, std::vector<std::string>>) return OptType::StringList;
}

// Builder for one registry entry bound to JobConfig::*sec .*field.
struct Def {
  Option o;
  Def& choices(std::vector<std::string> c) {
    o.choices = std::move(c);
    return *this;
  }
  Def& range(std::optional<double> lo, std::optional<double> hi) {
    o.min = lo;
    o.max = hi;
    return *this;
  }
  Def& alias(std::string a) {
    o.aliases.push_back(std::move(a));
    return *this;
  }
};

template <class Sec, class T>
Def def(const char* section, const char* key, Sec JobConfig::*sec, T Sec::*field,
        typename Identity<T>::type value, const char* help) {
  Def d;
  d.o.section = section;
  d.o.key = key;
  d.o.type = type_of<T>();
  d.o.default_value = OptValue(std::move(value));
  d.o.help = help;
  d.o.get = [sec, field](const JobConfig& c) { return OptValue(c.*sec.*field); };
  d.o.set = [sec, field](JobConfig& c, const OptValue& v) { c.*sec.*field = std::get<T>(v); };
  return d;
}

using Strings = std::vector<std::string>;
constexpr double kNoMax = std::numeric_limits<double>::infinity();

std::vector<Option> build_registry() {
  using J = JobConfig;
  std::vector<Def> d;
  // [job]
  d.push_back(def("job", "config_file", &J::job, &JobSection::config_file, "",
                  "TOML config file to load (same as --config)"));
  d.push_back(def("job", "dump_folder", &J::job, &JobSection::dump_folder, "./outputs",
                  "Folder for metrics, TensorBoard events and checkpoints"));
  d.push_back(def("job", "description", &J::job, &JobSection::description, "default job",
                  "Free-text description of the job"));
  d.push_back(def("job", "use_for_integration_test", &J::job, &JobSection::use_for_integration_test,
                  false, "Marks a config as part of the integration suite (informational)"));
  d.push_back(def("job", "print_args", &J::job, &JobSection::print_args, false,
                  "Also print the merged config as TOML at startup"));
  // [model]
  d.push_back(def("model", "name", &J::model, &ModelSection::name, "llama3", "Model family")
                  .choices({"llama3", "llama4", "deepseek_v3"}));
  d.push_back(def("model", "flavor", &J::model, &ModelSection::flavor, "debugmodel",
                  "Model size within the family (see docs/models.md)"));
  d.push_back(
      def("model", "hf_assets_path", &J::model, &ModelSection::hf_assets_path, "",
          "Folder holding tokenizer.json (Hugging Face layout); empty: use tokenizer_path"));
  d.push_back(def("model", "tokenizer_path", &J::model, &ModelSection::tokenizer_path, "",
                  "tokenizer.json file, or \"bytes\" for the byte tokenizer; empty: the bundled "
                  "tokenizer made by scripts/setup.sh"));
  d.push_back(def("model", "converters", &J::model, &ModelSection::converters, Strings{},
                  "Model converters (float8, mx): none are supported, so this must stay empty")
                  .choices({}));
  // [optimizer]
  d.push_back(def("optimizer", "name", &J::optimizer, &OptimizerSection::name, "AdamW", "Optimizer")
                  .choices({"AdamW"}));
  d.push_back(
      def("optimizer", "lr", &J::optimizer, &OptimizerSection::lr, 8e-4, "Peak learning rate")
          .range(0.0, kNoMax));
  d.push_back(def("optimizer", "beta1", &J::optimizer, &OptimizerSection::beta1, 0.9,
                  "AdamW first-moment decay")
                  .range(0.0, 1.0));
  d.push_back(def("optimizer", "beta2", &J::optimizer, &OptimizerSection::beta2, 0.95,
                  "AdamW second-moment decay")
                  .range(0.0, 1.0));
  d.push_back(def("optimizer", "eps", &J::optimizer, &OptimizerSection::eps, 1e-8, "AdamW epsilon")
                  .range(0.0, kNoMax));
  d.push_back(def("optimizer", "weight_decay", &J::optimizer, &OptimizerSection::weight_decay, 0.1,
                  "Decoupled weight decay, applied to matrices only (docs/training.md)")
                  .range(0.0, kNoMax));
  d.push_back(def("optimizer", "implementation", &J::optimizer, &OptimizerSection::implementation,
                  "fused", "AdamW kernel: fused (one multi-tensor kernel) or for-loop")
                  .choices({"fused", "foreach", "for-loop"}));
  // [lr_scheduler]
  d.push_back(def("lr_scheduler", "warmup_steps", &J::lr_scheduler,
                  &LRSchedulerSection::warmup_steps, 200, "Linear warmup steps")
                  .range(0.0, kNoMax));
  d.push_back(def("lr_scheduler", "decay_ratio", &J::lr_scheduler, &LRSchedulerSection::decay_ratio,
                  -1.0,
                  "Fraction of the steps spent decaying (warmup-stable-decay); negative: decay "
                  "over every step after warmup")
                  .range(-1.0, 1.0));
  d.push_back(def("lr_scheduler", "decay_type", &J::lr_scheduler, &LRSchedulerSection::decay_type,
                  "linear", "Shape of the decay")
                  .choices({"linear", "sqrt", "cosine"}));
  d.push_back(def("lr_scheduler", "min_lr_factor", &J::lr_scheduler,
                  &LRSchedulerSection::min_lr_factor, 0.0,
                  "Floor of the decay as a fraction of the peak lr")
                  .range(0.0, 1.0)
                  .alias("lr_scheduler.lr_min"));
  // [training]
  d.push_back(def("training", "dataset", &J::training, &TrainingSection::dataset, "kjv",
                  "Dataset name; \"kjv\" is the bundled King James Bible corpus"));
  d.push_back(def("training", "dataset_path", &J::training, &TrainingSection::dataset_path, "",
                  "Data file or folder: .txt (blank-line separated documents), .jsonl (\"text\" "
                  "field) or .tok (made by `titan-train tokenize`); empty: the named dataset"));
  d.push_back(def("training", "local_batch_size", &J::training, &TrainingSection::local_batch_size,
                  8, "Sequences per micro-batch on each rank")
                  .range(1.0, kNoMax)
                  .alias("training.batch_size"));
  d.push_back(
      def("training", "global_batch_size", &J::training, &TrainingSection::global_batch_size, -1,
          "Sequences per optimizer step over all ranks; -1: local_batch_size x data-parallel "
          "degree. Larger values accumulate gradients")
          .range(-1.0, kNoMax));
  d.push_back(def("training", "seq_len", &J::training, &TrainingSection::seq_len, 2048,
                  "Tokens per sequence")
                  .range(1.0, kNoMax));
  d.push_back(def("training", "max_norm", &J::training, &TrainingSection::max_norm, 1.0,
                  "Clip gradients to this global L2 norm; 0 disables clipping")
                  .range(0.0, kNoMax));
  d.push_back(def("training", "steps", &J::training, &TrainingSection::steps, 10000,
                  "Optimizer steps to train")
                  .range(1.0, kNoMax));
  d.push_back(def("training", "mixed_precision_param", &J::training,
                  &TrainingSection::mixed_precision_param, "bfloat16",
                  "Compute dtype of parameters on CUDA (fp32 master weights are kept); CPU runs "
                  "stay in float32")
                  .choices({"bfloat16", "float32"}));
  d.push_back(def("training", "mixed_precision_reduce", &J::training,
                  &TrainingSection::mixed_precision_reduce, "float32",
                  "Dtype of gradient reductions across ranks")
                  .choices({"float32", "bfloat16"}));
  d.push_back(def("training", "holdout_fraction", &J::training, &TrainingSection::holdout_fraction,
                  0.01, "Fraction of documents held out of training for validation")
                  .range(0.0, 0.5));
  // [parallelism]
  d.push_back(def("parallelism", "data_parallel_replicate_degree", &J::parallelism,
                  &ParallelismSection::data_parallel_replicate_degree, 1,
                  "Replicas (DDP, or HSDP with shard degree > 1)")
                  .range(1.0, kNoMax));
  d.push_back(def("parallelism", "data_parallel_shard_degree", &J::parallelism,
                  &ParallelismSection::data_parallel_shard_degree, -1,
                  "FSDP shard degree; -1: the rest of the world size")
                  .range(-1.0, kNoMax));
  d.push_back(def("parallelism", "fsdp_reshard_after_forward", &J::parallelism,
                  &ParallelismSection::fsdp_reshard_after_forward, "default",
                  "Free gathered parameters after forward: default (yes), always, never")
                  .choices({"default", "always", "never"}));
  d.push_back(def("parallelism", "tensor_parallel_degree", &J::parallelism,
                  &ParallelismSection::tensor_parallel_degree, 1,
                  "Tensor parallelism is not supported: must be 1")
                  .range(1.0, 1.0));
  d.push_back(def("parallelism", "pipeline_parallel_degree", &J::parallelism,
                  &ParallelismSection::pipeline_parallel_degree, 1,
                  "Pipeline parallelism is not supported: must be 1")
                  .range(1.0, 1.0));
  d.push_back(def("parallelism", "context_parallel_degree", &J::parallelism,
                  &ParallelismSection::context_parallel_degree, 1,
                  "Context parallelism is not supported: must be 1")
                  .range(1.0, 1.0));
  d.push_back(def("parallelism", "expert_parallel_degree", &J::parallelism,
                  &ParallelismSection::expert_parallel_degree, 1,
                  "Expert-parallel degree, borrowed from the shard dimension (dp2ep)")
                  .range(1.0, kNoMax));
  // [checkpoint]
  d.push_back(def("checkpoint", "enable", &J::checkpoint, &CheckpointSection::enable, false,
                  "Save checkpoints and resume from the latest one")
                  .alias("checkpoint.enable_checkpoint"));
  d.push_back(def("checkpoint", "folder", &J::checkpoint, &CheckpointSection::folder, "checkpoint",
                  "Checkpoint folder under job.dump_folder"));
  d.push_back(def("checkpoint", "interval", &J::checkpoint, &CheckpointSection::interval, 500,
                  "Save every this many steps")
                  .range(1.0, kNoMax));
  d.push_back(def("checkpoint", "last_save_model_only", &J::checkpoint,
                  &CheckpointSection::last_save_model_only, false,
                  "Final save holds the model only (then it cannot be resumed from)"));
  d.push_back(def("checkpoint", "export_dtype", &J::checkpoint, &CheckpointSection::export_dtype,
                  "float32", "Dtype of model-only and Hugging Face exports")
                  .choices({"float32", "bfloat16", "float16"}));
  d.push_back(def("checkpoint", "async_mode", &J::checkpoint, &CheckpointSection::async_mode,
                  "disabled", "disabled, or async: copy to CPU and write in a background thread")
                  .choices({"disabled", "async", "async_with_pinned_mem"}));
  d.push_back(def("checkpoint", "keep_latest_k", &J::checkpoint, &CheckpointSection::keep_latest_k,
                  10, "Keep only the newest k checkpoints; 0 keeps all")
                  .range(0.0, kNoMax));
  d.push_back(def("checkpoint", "load_step", &J::checkpoint, &CheckpointSection::load_step, -1,
                  "Resume from this step; -1: the latest complete checkpoint")
                  .range(-1.0, kNoMax));
  d.push_back(def("checkpoint", "initial_load_path", &J::checkpoint,
                  &CheckpointSection::initial_load_path, "",
                  "Checkpoint to initialise from when dump_folder has none"));
  d.push_back(def("checkpoint", "initial_load_model_only", &J::checkpoint,
                  &CheckpointSection::initial_load_model_only, true,
                  "Load only the model from initial_load_path"));
  d.push_back(def("checkpoint", "initial_load_in_hf", &J::checkpoint,
                  &CheckpointSection::initial_load_in_hf, false,
                  "initial_load_path is a Hugging Face safetensors folder"));
  d.push_back(def("checkpoint", "last_save_in_hf", &J::checkpoint,
                  &CheckpointSection::last_save_in_hf, false,
                  "Also export the final model in Hugging Face format"));
  d.push_back(def("checkpoint", "exclude_from_loading", &J::checkpoint,
                  &CheckpointSection::exclude_from_loading, Strings{},
                  "Parts not to load: model, optimizer, lr_scheduler, dataloader, train_state")
                  .choices({"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}));
  // [activation_checkpoint]
  d.push_back(def("activation_checkpoint", "mode", &J::activation_checkpoint,
                  &ActivationCheckpointSection::mode, "selective",
                  "Recompute blocks in backward: none, full (every block) or selective")
                  .choices({"none", "full", "selective"}));
  d.push_back(def("activation_checkpoint", "selective_ac_option", &J::activation_checkpoint,
                  &ActivationCheckpointSection::selective_ac_option, "2",
                  "With mode=selective: recompute every Nth block (a positive integer)"));
  // [compile]
  d.push_back(def("compile", "enable", &J::compile, &CompileSection::enable, false,
                  "Capture the train step in CUDA graphs (CUDA only). Not implemented yet: true "
                  "runs eagerly with a warning")
                  .alias("training.compile"));
  d.push_back(def("compile", "components", &J::compile, &CompileSection::components,
                  Strings{"model", "loss"}, "What to capture")
                  .choices({"model", "loss"}));
  // [metrics]
  d.push_back(def("metrics", "log_freq", &J::metrics, &MetricsSection::log_freq, 10,
                  "Log every this many steps")
                  .range(1.0, kNoMax));
  d.push_back(def("metrics", "enable_tensorboard", &J::metrics, &MetricsSection::enable_tensorboard,
                  false, "Write TensorBoard event files"));
  d.push_back(def("metrics", "save_tb_folder", &J::metrics, &MetricsSection::save_tb_folder, "tb",
                  "TensorBoard folder under job.dump_folder"));
  d.push_back(def("metrics", "disable_color_printing", &J::metrics,
                  &MetricsSection::disable_color_printing, false, "Plain log lines"));
  d.push_back(def("metrics", "save_for_all_ranks", &J::metrics, &MetricsSection::save_for_all_ranks,
                  false, "Every rank writes its own metrics files"));
  // [debug]
  d.push_back(def("debug", "seed", &J::debug, &DebugSection::seed, 0,
                  "Seed for initialization and data order")
                  .range(0.0, kNoMax)
                  .alias("training.seed"));
  d.push_back(def("debug", "deterministic", &J::debug, &DebugSection::deterministic, false,
                  "Use deterministic kernels; runs with the same seed repeat exactly")
                  .alias("training.deterministic"));
  // [validation]
  d.push_back(def("validation", "enable", &J::validation, &ValidationSection::enable, false,
                  "Evaluate on the held-out split every freq steps")
                  .alias("validation.enabled"));
  d.push_back(def("validation", "dataset", &J::validation, &ValidationSection::dataset, "",
                  "Validation dataset; empty: the training data's held-out split"));
  d.push_back(def("validation", "dataset_path", &J::validation, &ValidationSection::dataset_path,
                  "", "Validation data file; empty: the training data's held-out split"));
  d.push_back(def("validation", "local_batch_size", &J::validation,
                  &ValidationSection::local_batch_size, 8, "Sequences per validation batch")
                  .range(1.0, kNoMax));
  d.push_back(def("validation", "seq_len", &J::validation, &ValidationSection::seq_len, 2048,
                  "Tokens per validation sequence")
                  .range(1.0, kNoMax));
  d.push_back(def("validation", "freq", &J::validation, &ValidationSection::freq, 10,
                  "Validate every this many steps")
                  .range(1.0, kNoMax));
  d.push_back(def("validation", "steps", &J::validation, &ValidationSection::steps, -1,
                  "Validation batches per evaluation; -1: the whole split")
                  .range(-1.0, kNoMax));
  // [comm]
  d.push_back(def("comm", "init_timeout_seconds", &J::comm, &CommSection::init_timeout_seconds, 300,
                  "Collective timeout until the first step completes")
                  .range(1.0, kNoMax));
  d.push_back(def("comm", "train_timeout_seconds", &J::comm, &CommSection::train_timeout_seconds,
                  100,
                  "Collective timeout after the first step: a dead or hung rank ends every "
                  "rank within this time")
                  .range(1.0, kNoMax));
  // [moe]
  d.push_back(def("moe", "experts_backend", &J::moe, &MoESection::experts_backend, "auto",
                  "Expert GEMMs: grouped_mm (SM90+ CUDA), loop, or auto (grouped_mm where it runs)")
                  .choices({"auto", "grouped_mm", "loop"}));
  d.push_back(def("moe", "load_balance_coeff", &J::moe, &MoESection::load_balance_coeff, 1e-3,
                  "Aux-loss-free expert-bias update speed; 0 turns balancing off")
                  .range(0.0, kNoMax));
  d.push_back(def("moe", "seq_aux_loss_coeff", &J::moe, &MoESection::seq_aux_loss_coeff, 0.0,
                  "Weight of DeepSeek-V3's sequence-wise auxiliary balance loss; 0 disables")
                  .range(0.0, kNoMax));

  std::vector<Option> out;
  out.reserve(d.size());
  for (auto& x : d) out.push_back(std::move(x.o));
  return out;
}

const std::vector<std::string> kIgnored = {
    "profiling.*",
    "float8.*",
    "mx.*",
    "fault_tolerance.*",
    "experimental.*",
    "memory_estimation.*",
    "model.print_after_conversion",
    "optimizer.early_step_in_backward",
    "training.enable_cpu_offload",
    "training.gc_freq",
    "training.gc_debug",
    "parallelism.enable_compiled_autograd",
    "parallelism.disable_loss_parallel",
    "parallelism.enable_async_tensor_parallel",
    "parallelism.pipeline_parallel_split_points",
    "parallelism.pipeline_parallel_layers_per_stage",
    "parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_schedule_csv",
    "parallelism.pipeline_parallel_microbatch_size",
    "parallelism.context_parallel_rotate_method",
    "parallelism.expert_tensor_parallel_degree",
    "checkpoint.create_seed_checkpoint",
    "checkpoint.enable_first_step_checkpoint",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
    "metrics.enable_wandb",
    "comm.trace_buf_size",
    "comm.save_traces_folder",
};

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

std::string format_double(double x) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (std::isnan(x)) return "nan";
  // Shortest text that parses back to the same double, always with a '.' or exponent so
  // that TOML reads it as a float.
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string quote_toml(const std::string& s) {
  std::ostringstream os;
  os << toml::value<std::string>(s);
  return os.str();
}

bool parse_bool_text(const std::string& t, bool& out) {
  std::string l = t;
  std::transform(l.begin(), l.end(), l.begin(), ::tolower);
  if (l == "true" || l == "1" || l == "yes" || l == "on") return out = true, true;
  if (l == "false" || l == "0" || l == "no" || l == "off") return out = false, true;
  return false;
}

std::string describe_toml_node(const toml::node& n) {
  std::ostringstream os;
  switch (n.type()) {
    case toml::node_type::string:
      os << "string " << quote_toml(*n.value<std::string>());
      break;
    case toml::node_type::integer:
      os << "integer " << *n.value<int64_t>();
      break;
    case toml::node_type::floating_point:
      os << "float " << format_double(*n.value<double>());
      break;
    case toml::node_type::boolean:
      os << "boolean " << (*n.value<bool>() ? "true" : "false");
      break;
    case toml::node_type::array:
      os << "an array";
      break;
    case toml::node_type::table:
      os << "a table";
      break;
    default:
      os << "a date/time";
      break;
  }
  return os.str();
}

[[noreturn]] void wrong_type(const Option& opt, const std::string& where,
                             const std::string& found) {
  throw UserError(where + ": " + opt.name() + ": expected " + opt_type_name(opt.type) + ", found " +
                  found);
}

OptValue toml_to_value(const Option& opt, const toml::node& n, const std::string& where) {
  switch (opt.type) {
    case OptType::Bool:
      if (auto b = n.value_exact<bool>()) return *b;
      break;
    case OptType::Int:
      if (auto i = n.value_exact<int64_t>()) return *i;
      break;
    case OptType::Float:
      if (n.is_integer()) return static_cast<double>(*n.value<int64_t>());
      if (auto f = n.value_exact<double>()) return *f;
      break;
    case OptType::String:
      if (auto s = n.value_exact<std::string>()) return *s;
      // torchtitan writes selective_ac_option = '2' but users write 2.
      if (n.is_integer()) return std::to_string(*n.value<int64_t>());
      break;
    case OptType::StringList:
      if (auto* arr = n.as_array()) {
        std::vector<std::string> out;
        for (auto& e : *arr) {
          auto s = e.value_exact<std::string>();
          if (!s) wrong_type(opt, where, "an array holding " + describe_toml_node(e));
          out.push_back(*s);
        }
        return out;
      }
      if (auto s = n.value_exact<std::string>()) {  // "a,b" as in torchtitan's CLI
        std::vector<std::string> out;
        std::stringstream ss(*s);
        for (std::string item; std::getline(ss, item, ',');)
          if (!item.empty()) out.push_back(item);
        return out;
      }
      break;
  }
  wrong_type(opt, where, describe_toml_node(n));
}

std::string allowed_text(const Option& opt) {
  if (!opt.choices.empty()) return "one of " + join(opt.choices, ", ");
  if (opt.type == OptType::StringList) return "an empty list";
  std::ostringstream os;
  auto num = [&](double x) {
    return opt.type == OptType::Int ? std::to_string(static_cast<int64_t>(x)) : format_double(x);
  };
  if (opt.min && opt.max && std::isfinite(*opt.max)) {
    if (*opt.min == *opt.max) return "only " + num(*opt.min);
    os << num(*opt.min) << " <= value <= " << num(*opt.max);
  } else if (opt.min) {
    os << "value >= " << num(*opt.min);
  }
  return os.str();
}

void apply_toml_table(JobConfig& cfg, const toml::table& root, const std::string& source,
                      std::vector<std::string>& warnings) {
  for (auto&& [sec_key, sec_node] : root) {
    std::string section(sec_key.str());
    auto line_of = [&](const toml::node& n) {
      return source + ":" + std::to_string(n.source().begin.line);
    };
    const toml::table* tbl = sec_node.as_table();
    if (!tbl) {
      throw UserError(line_of(sec_node) + ": top-level key '" + section +
                      "': expected a [section] table, found " + describe_toml_node(sec_node) +
                      "; allowed: sections such as [training] (see --help)");
    }
    bool section_known = false;
    for (auto& o : registry())
      if (o.section == section) section_known = true;
    for (auto& a : kIgnored)
      if (a.rfind(section + ".", 0) == 0) section_known = true;
    if (!section_known) {
      std::string near;
      size_t best = std::numeric_limits<size_t>::max();
      for (auto& o : registry()) {
        size_t dd = edit_distance(section, o.section);
        if (dd < best) best = dd, near = o.section;
      }
      throw UserError(line_of(sec_node) + ": unknown section [" + section +
                      "]; nearest valid section: [" + near + "] (see --help)");
    }
    for (auto&& [k, node] : *tbl) {
      std::string full = section + "." + std::string(k.str());
      std::string where = line_of(node);
      const Option* opt = find_option(full);
      if (!opt) {
        if (is_ignored_torchtitan_key(full)) {
          warnings.push_back(where + ": ignoring torchtitan key " + full +
                             " (not used by titan-train)");
          continue;
        }
        throw UserError(where + ": unknown key " + full +
                        "; nearest valid key: " + nearest_option_name(full));
      }
      OptValue v = toml_to_value(*opt, node, where);
      check_option_value(*opt, v, where);
      opt->set(cfg, v);
    }
  }
}

}  // namespace

const char* opt_type_name(OptType t) {
  switch (t) {
    case OptType::Bool:
      return "bool";
    case OptType::Int:
      return "int";
    case OptType::Float:
      return "float";
    case OptType::String:
      return "string";
    case OptType::StringList:
      return "list[string]";
  }
  return "?";
}

const std::vector<Option>& registry() {
  static const std::vector<Option> r = build_registry();
  return r;
}

const Option* find_option(const std::string& full_name) {
  for (auto& o : registry()) {
    if (o.name() == full_name) return &o;
    for (auto& a : o.aliases)
      if (a == full_name) return &o;
  }
  return nullptr;
}

bool is_ignored_torchtitan_key(const std::string& full_name) {
  for (auto& k : kIgnored) {
    if (k == full_name) return true;
    if (k.size() > 2 && k.compare(k.size() - 2, 2, ".*") == 0 &&
        full_name.rfind(k.substr(0, k.size() - 1), 0) == 0)
      return true;
  }
  return false;
}

const std::vector<std::string>& ignored_torchtitan_keys() {
  return kIgnored;
}

std::string nearest_option_name(const std::string& name) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (auto& o : registry()) {
    size_t dd = edit_distance(name, o.name());
    if (dd < best_d) best_d = dd, best = o.name();
  }
  return best;
}

JobConfig default_config() {
  JobConfig c;
  for (auto& o : registry()) o.set(c, o.default_value);
  return c;
}

std::string format_option_value(const OptValue& v) {
  struct V {
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return format_double(d); }
    std::string operator()(const std::string& s) const { return quote_toml(s); }
    std::string operator()(const std::vector<std::string>& l) const {
      std::vector<std::string> q;
      for (auto& s : l) q.push_back(quote_toml(s));
      return "[" + join(q, ", ") + "]";
    }
  };
  return std::visit(V{}, v);
}

void check_option_value(const Option& opt, const OptValue& v, const std::string& where) {
  auto fail = [&](const std::string& found) {
    throw UserError(where + ": " + opt.name() + " = " + found +
                    " is not allowed; allowed: " + allowed_text(opt));
  };
  if (opt.type == OptType::Int || opt.type == OptType::Float) {
    double x =
        opt.type == OptType::Int ? static_cast<double>(std::get<int64_t>(v)) : std::get<double>(v);
    if (std::isnan(x) || (opt.min && x < *opt.min) || (opt.max && x > *opt.max))
      fail(format_option_value(v));
  }
  if (opt.type == OptType::String && !opt.choices.empty()) {
    auto& s = std::get<std::string>(v);
    if (std::find(opt.choices.begin(), opt.choices.end(), s) == opt.choices.end())
      fail(format_option_value(v));
  }
  if (opt.type == OptType::StringList) {
    for (auto& s : std::get<std::vector<std::string>>(v))
      if (std::find(opt.choices.begin(), opt.choices.end(), s) == opt.choices.end())
        fail(format_option_value(v));
  }
}

OptValue parse_option_text(const Option& opt, const std::vector<std::string>& texts,
                           const std::string& where) {
  auto single = [&]() -> const std::string& {
    if (texts.size() != 1)
      throw UserError(where + ": --" + opt.name() + ": expected one " + opt_type_name(opt.type) +
                      " value, found " + std::to_string(texts.size()));
    return texts[0];
  };
  OptValue v;
  switch (opt.type) {
    case OptType::Bool: {
      if (texts.empty() || (texts.size() == 1 && texts[0].empty())) {
        v = true;  // a bare flag
        break;
      }
      bool b;
      if (!parse_bool_text(single(), b))
        throw UserError(where + ": --" + opt.name() + ": expected bool (true/false), found '" +
                        single() + "'");
      v = b;
      break;
    }
    case OptType::Int: {
      const std::string& t = single();
      char* end = nullptr;
      errno = 0;
      long long x = std::strtoll(t.c_str(), &end, 10);
      if (t.empty() || *end || errno)
        throw UserError(where + ": --" + opt.name() + ": expected int, found '" + t + "'");
      v = static_cast<int64_t>(x);
      break;
    }
    case OptType::Float: {
      const std::string& t = single();
      char* end = nullptr;
      double x = std::strtod(t.c_str(), &end);
      if (t.empty() || *end)
        throw UserError(where + ": --" + opt.name() + ": expected float, found '" + t + "'");
      v = x;
      break;
    }
    case OptType::String:
      v = single();
      break;
    case OptType::StringList: {
      std::vector<std::string> out;
      for (auto& t : texts) {
        std::stringstream ss(t);
        for (std::string item; std::getline(ss, item, ',');)
          if (!item.empty()) out.push_back(item);
      }
      v = out;
      break;
    }
  }
  check_option_value(opt, v, where);
  return v;
}

void apply_toml_string(JobConfig& cfg, const std::string& text, const std::string& source_name,
                       std::vector<std::string>& warnings) {
  toml::table root;
  try {
    root = toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    auto& b = e.source().begin;
    throw UserError(source_name + ":" + std::to_string(b.line) + ":" + std::to_string(b.column) +
                    ": TOML syntax error: " + std::string(e.description()));
  }
  apply_toml_table(cfg, root, source_name, warnings);
}

void apply_toml_file(JobConfig& cfg, const std::string& path, std::vector<std::string>& warnings) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UserError("config file '" + path +
                    "': cannot be read (it is a folder); give a TOML "
                    "file with --config FILE");
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw UserError("config file '" + path + "': cannot be read (" + std::strerror(errno) +
                    "); give an existing TOML file with --config FILE");
  std::stringstream ss;
  ss << f.rdbuf();
  apply_toml_string(cfg, ss.str(), path, warnings);
}

DerivedConfig derive_config(const JobConfig& cfg, int64_t world_size) {
  DerivedConfig d;
  const auto& p = cfg.parallelism;
  d.dp_shard = p.data_parallel_shard_degree == -1
                   ? world_size / std::max<int64_t>(1, p.data_parallel_replicate_degree)
                   : p.data_parallel_shard_degree;
  d.dp_degree = p.data_parallel_replicate_degree * d.dp_shard;
  const int64_t per_micro = cfg.training.local_batch_size * d.dp_degree;
  d.global_batch =
      cfg.training.global_batch_size == -1 ? per_micro : cfg.training.global_batch_size;
  d.grad_accum_steps = per_micro > 0 ? d.global_batch / per_micro : 1;
  d.tokens_per_step = d.global_batch * cfg.training.seq_len;
  return d;
}

void validate_config(const JobConfig& cfg, int64_t world_size) {
  const auto& p = cfg.parallelism;
  if (p.data_parallel_shard_degree == 0)
    throw UserError(
        "parallelism.data_parallel_shard_degree = 0 is not allowed; allowed: -1 "
        "(the rest of the world) or a positive degree");
  if (p.data_parallel_shard_degree == -1 && world_size % p.data_parallel_replicate_degree != 0)
    throw UserError("parallelism.data_parallel_replicate_degree = " +
                    std::to_string(p.data_parallel_replicate_degree) +
                    " does not divide the world size " + std::to_string(world_size));
  DerivedConfig d = derive_config(cfg, world_size);
  if (d.dp_degree != world_size)
    throw UserError("parallelism: data_parallel_replicate_degree (" +
                    std::to_string(p.data_parallel_replicate_degree) +
                    ") x data_parallel_shard_degree (" + std::to_string(d.dp_shard) +
                    ") = " + std::to_string(d.dp_degree) + ", but the world size is " +
                    std::to_string(world_size) + "; allowed: a product equal to the world size");
  if (d.dp_shard % p.expert_parallel_degree != 0)
    throw UserError(
        "parallelism.expert_parallel_degree = " + std::to_string(p.expert_parallel_degree) +
        " must divide the shard degree " + std::to_string(d.dp_shard) +
        " (experts borrow ranks from data_parallel_shard_degree)");
  const int64_t per_micro = cfg.training.local_batch_size * d.dp_degree;
  if (d.global_batch % per_micro != 0)
    throw UserError("training.global_batch_size = " + std::to_string(d.global_batch) +
                    " is not a multiple of local_batch_size (" +
                    std::to_string(cfg.training.local_batch_size) + ") x data-parallel degree (" +
                    std::to_string(d.dp_degree) + ") = " + std::to_string(per_micro) +
                    "; allowed: -1 or a multiple of " + std::to_string(per_micro));
  const auto& ac = cfg.activation_checkpoint;
  if (ac.mode == "selective") {
    const std::string& s = ac.selective_ac_option;
    bool ok = !s.empty() && std::all_of(s.begin(), s.end(), ::isdigit) && std::stoll(s) > 0;
    if (!ok)
      throw UserError("activation_checkpoint.selective_ac_option = " + quote_toml(s) +
                      " is not allowed; allowed: a positive integer N (recompute every Nth "
                      "block); per-op selective checkpointing ('op') is not supported");
  }
  if (cfg.checkpoint.last_save_in_hf && cfg.model.name == "llama4")
    throw UserError(
        "checkpoint.last_save_in_hf = true is not supported for model.name = "
        "\"llama4\"; allowed: llama3, deepseek_v3");
}

std::string dump_config_toml(const JobConfig& cfg) {
  std::ostringstream os;
  os << "# titan-train effective config (defaults < TOML < command line)\n";
  std::string cur;
  for (auto& o : registry()) {
    if (o.name() == "job.config_file") continue;  // a pointer to the file, not part of it
    if (o.section != cur) {
      os << (cur.empty() ? "" : "\n") << "[" << o.section << "]\n";
      cur = o.section;
    }
    os << o.key << " = " << format_option_value(o.get(cfg)) << "\n";
  }
  return os.str();
}

std::string config_help_text() {
  std::ostringstream os;
  os << "titan-train: pre-train Llama-3, Llama-4 and DeepSeek-V3 models on LibTorch.\n\n"
        "Usage:\n"
        "  titan-train [--config FILE] [--section.key=value | --section.key value]...\n"
        "  titan-train tokenize --tokenizer FILE --input FILE --output FILE.tok\n"
        "  titan-train convert-hf --model llama3 --flavor F --from-hf DIR --to-safetensors FILE\n"
        "  titan-train convert-hf --model llama3 --flavor F --from-safetensors FILE --to-hf DIR\n"
        "                         [--dtype float32|bfloat16|float16]\n"
        "  titan-train --help | --dump-config\n\n"
        "Precedence: defaults < TOML file < command line. Booleans: --key, --key=true,\n"
        "--key false. Lists: --key a,b or --key a b.\n\n"
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
    if (!allowed.empty() && o.type != OptType::Bool && o.type != OptType::String)
      os << "; allowed: " << allowed;
    else if (!o.choices.empty())
      os << "; allowed: " << allowed;
    if (!o.aliases.empty()) os << "; also accepted as " << join(o.aliases, ", ");
    os << "\n";
  }
  os << "\nAccepted with a warning and ignored (torchtitan keys): " << join(kIgnored, ", ") << "\n";
  return os.str();
}

std::string config_reference_markdown() {
  std::ostringstream os;
  os << "| key | type | default | allowed | description |\n|---|---|---|---|---|\n";
  for (auto& o : registry()) {
    std::string allowed = allowed_text(o);
    if (o.type == OptType::Bool) allowed = "";
    if (o.type == OptType::String && o.choices.empty()) allowed = "";
    std::string help = o.help;
    if (!o.aliases.empty()) help += " (alias: " + join(o.aliases, ", ") + ")";
    std::string def = format_option_value(o.default_value);
    auto esc = [](std::string s) {
      std::string r;
      for (char c : s) r += (c == '|') ? std::string("\\|") : std::string(1, c);
      return r;
    };
    os << "| `" << o.name() << "` | " << opt_type_name(o.type) << " | `" << esc(def) << "` | "
       << esc(allowed) << " | " << esc(help) << " |\n";
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

CliResult parse_command_line(int argc, const char* const* argv) {
  CliResult r;
  r.cfg = default_config();
  CLI::App app{"titan-train"};
  app.set_help_flag();  // our own --help, generated from the registry
  app.allow_extras();
  app.add_flag("-h,--help", r.show_help);
  app.add_flag("--dump-config", r.dump_config);
  std::vector<std::pair<const Option*, CLI::Option*>> bound;
  for (auto& o : registry()) {
    std::string names = "--" + o.name();
    for (auto& a : o.aliases) names += ",--" + a;
    if (o.name() == "job.config_file") names += ",--config";
    CLI::Option* c = app.add_option(names);
    switch (o.type) {
      case OptType::Bool:
        c->expected(0, 1);
        break;
      case OptType::StringList:
        c->expected(1, CLI::detail::expected_max_vector_size)->allow_extra_args();
        break;
      default:
        c->expected(1);
        break;
    }
    c->multi_option_policy(o.type == OptType::StringList ? CLI::MultiOptionPolicy::TakeAll
                                                         : CLI::MultiOptionPolicy::TakeLast);
    bound.emplace_back(&o, c);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string("command line: ") + e.what() + " (see --help)");
  }

  // Unknown arguments: ignored torchtitan keys warn, everything else is an error.
  auto extras = app.remaining();
  for (size_t i = 0; i < extras.size(); ++i) {
    std::string a = extras[i];
    if (a.rfind("--", 0) != 0)
      throw UserError("command line: unexpected argument '" + a +
                      "'; allowed: --section.key=value options (see --help)");
    std::string key =
        a.substr(2, a.find('=') == std::string::npos ? std::string::npos : a.find('=') - 2);
    if (is_ignored_torchtitan_key(key)) {
      r.warnings.push_back("command line: ignoring torchtitan key " + key +
                           " (not used by titan-train)");
      if (a.find('=') == std::string::npos && i + 1 < extras.size() &&
          extras[i + 1].rfind("--", 0) != 0)
        ++i;  // skip its value
      continue;
    }
    throw UserError("command line: unknown option --" + key + "; nearest valid option: --" +
                    nearest_option_name(key));
  }

  // defaults < TOML < command line
  const CLI::Option* cfg_opt = nullptr;
  for (auto& [o, c] : bound)
    if (o->name() == "job.config_file") cfg_opt = c;
  if (cfg_opt->count() > 0) {
    std::string path = cfg_opt->results().back();
    apply_toml_file(r.cfg, path, r.warnings);
  } else {
    r.cfg.job.config_file.clear();
  }
  for (auto& [o, c] : bound) {
    if (c->count() == 0) continue;
    std::vector<std::string> texts = c->results();
    if (o->type != OptType::StringList && texts.size() > 1) texts = {texts.back()};
    OptValue v = parse_option_text(*o, texts, "command line");
    o->set(r.cfg, v);
  }
  return r;
}

}  // namespace titan
