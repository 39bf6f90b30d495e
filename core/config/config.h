// Typed job configuration and the one option registry it is bound to.
//
// Every option is declared once, in config.cpp's registry: name, type, default, help and
// allowed values. TOML loading, command-line overrides, --help, --dump-config, the README
// reference and validation are all derived from that table. The rest of the program reads
// the typed JobConfig below and never looks options up by string.
//
// Names follow torchtitan v0.2.2's TOML configs; v0.1's spellings are aliases that warn
// (docs/config.md).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace titan {

struct JobSection {
  std::string config_file;
  std::string dump_folder;
  std::string description;
  bool use_for_integration_test = false;
  bool print_config = false;
};

struct ModelSection {
  std::string name;
  std::string flavor;
  std::string hf_assets_path;
  std::string tokenizer_path;
  std::vector<std::string> converters;
  int64_t n_layers = 0;  // > 0: the flavor's layers replaced by this many (benchmarks)
  // Packed documents (docs/attention.md). "flavor": the flavor's attn_mask_type / attn_type.
  std::string attn_mask_type;
  std::string attn_type;
  bool document_positions = false;  // RoPE positions restart at 0 in each document
  bool document_loss = false;       // an EOS input's label (the next document) is ignored
};

struct OptimizerSection {
  std::string name;
  double lr = 0;
  double beta1 = 0;
  double beta2 = 0;
  double eps = 0;
  double weight_decay = 0;
  std::string weight_decay_scope;  // "matrices" (ours) or "all" (torchtitan's)
  std::string implementation;
  // Muon (name = "Muon"): torch.optim.Muon's arguments for the matrices it optimizes; the
  // keys above stay AdamW's, for the parameters AdamW keeps (docs/training.md).
  double muon_lr = 0;
  double muon_weight_decay = 0;
  double muon_momentum = 0;
  bool muon_enable_nesterov = true;
  std::vector<double> muon_ns_coefficients;  // (a, b, c) of the quintic Newton-Schulz step
  int64_t muon_ns_steps = 0;
  double muon_eps = 0;
  std::string muon_adjust_lr_fn;  // original, match_rms_adamw or spectral_unclamped
  // "REGEX=AdamW" or "REGEX=Muon": the first entry whose regex is found in a parameter's
  // name picks its optimizer, before the default routing (core/config/param_groups.h).
  std::vector<std::string> param_groups;
};

struct LRSchedulerSection {
  int64_t warmup_steps = 0;
  double decay_ratio = -1;  // < 0: decay over every step after warmup
  std::string decay_type;
  double min_lr_factor = 0;
};

struct TrainingSection {
  std::string dataset;
  std::vector<std::string> dataset_path;  // files or folders; several form a blend
  std::vector<double> dataset_weights;    // one per dataset_path entry; empty: by tokens
  int64_t local_batch_size = 0;
  int64_t global_batch_size = 0;
  int64_t seq_len = 0;
  double max_norm = 0;
  int64_t steps = 0;
  std::string mixed_precision_param;
  std::string mixed_precision_reduce;
  std::string device;  // auto, cuda or cpu (app/trainer.cpp resolves it)
  double holdout_fraction = 0;
};

struct ParallelismSection {
  int64_t data_parallel_replicate_degree = 1;
  int64_t data_parallel_shard_degree = -1;
  std::string fsdp_reshard_after_forward;
  int64_t tensor_parallel_degree = 1;
  bool enable_async_tensor_parallel = false;  // chunked, overlapped TP collectives
  int64_t pipeline_parallel_degree = 1;
  std::string pipeline_parallel_schedule;
  std::string pipeline_parallel_schedule_csv;
  int64_t pipeline_parallel_microbatch_size = 1;
  int64_t pipeline_parallel_layers_per_stage = 0;  // 0: unset (torchtitan's None)
  int64_t pipeline_parallel_first_stage_less_layers = 1;
  int64_t pipeline_parallel_last_stage_less_layers = 1;
  bool pipeline_parallel_expert_parallel_overlap = true;  // DualPipeV pairs overlap EP a2a
  // One entry per stage: its module names separated by spaces (a TOML array of arrays is
  // read into this form).
  std::vector<std::string> module_fqns_per_model_part;
  int64_t context_parallel_degree = 1;
  std::string context_parallel_load_balancer = "headtail";  // headtail | none
  std::string context_parallel_rotate_method = "allgather";
  int64_t expert_parallel_degree = 1;
  int64_t expert_tensor_parallel_degree = 1;
};

struct CheckpointSection {
  bool enable = false;
  std::string folder;
  int64_t interval = 0;
  bool last_save_model_only = false;
  std::string export_dtype;
  std::string async_mode;
  int64_t keep_latest_k = 0;
  int64_t load_step = -1;
  std::string initial_load_path;
  bool initial_load_model_only = true;
  bool initial_load_in_hf = false;
  bool last_save_in_hf = false;
  std::vector<std::string> exclude_from_loading;
  bool create_seed_checkpoint = false;  // write step-0 and exit (one process)
};

struct ActivationCheckpointSection {
  std::string mode;
  std::string selective_ac_option;  // "op" or a positive integer N (every Nth block)
  std::vector<std::string> per_op_sac_force_recompute_mm_shapes_by_fqns;
};

struct CompileSection {
  bool enable = false;
  std::vector<std::string> components;
};

struct MetricsSection {
  int64_t log_freq = 0;
  bool enable_tensorboard = false;
  std::string save_tb_folder;
  bool disable_color_printing = false;
  bool save_for_all_ranks = false;
};

struct ProfilingSection {
  bool enable_profiling = false;
  std::string save_traces_folder;
  int64_t profile_freq = 0;
  int64_t profiler_active = 0;
  int64_t profiler_warmup = 0;
};

struct DebugSection {
  int64_t seed = 0;
  bool deterministic = false;
  // Test seams (docs/design.md, "Test seams"): nothing a training run should set.
  double float8_plant_slow_scaled_mm_ms = 0;
  std::string plant_error;            // "", internal, oom, std, host_read
  bool force_fsdp = false;            // FSDP's collectives over a world of one rank
  bool force_ep = false;              // the expert exchange over a world of one rank
  bool comm_overlap = true;           // false: FSDP/DDP's blocking schedule, for comparisons
  int64_t checkpoint_delay_ms = 0;    // a slow disk: sleep before a checkpoint's rename
  int64_t capture_check_context = 0;  // on a capture break, print N ops around it
};

struct ValidationSection {
  bool enable = false;
  std::string dataset;
  std::vector<std::string> dataset_path;
  int64_t local_batch_size = 0;
  int64_t seq_len = 0;
  int64_t freq = 0;
  int64_t steps = 0;
};

struct CommSection {
  int64_t init_timeout_seconds = 0;
  int64_t train_timeout_seconds = 0;
};

struct MoESection {
  std::string experts_backend;
  std::string ep_exchange;            // auto, static or exact (docs/moe.md)
  double ep_capacity_factor = 0;      // x the balanced share; inf: the worst case (docs/moe.md)
  double ep_capacity_factor_max = 0;  // the cap of its growth after repeated overflows
  std::string ep_drop_policy;         // none (re-run overflowed steps exactly) or probs
  double load_balance_coeff = 0;
  double seq_aux_loss_coeff = 0;
};

// [quantize.linear.float8] (torchtitan v0.2.2; v0.1's [float8]): read when model.converters
// holds "float8" (docs/float8.md).
struct Float8Section {
  std::string recipe_name;               // tensorwise, rowwise or rowwise_with_gw_hp
  std::vector<std::string> filter_fqns;  // substrings of linear fqns left in high precision;
                                         // "auto_filter_small_kn": torchao's size rule
  bool emulate = false;
  // Not implemented yet: refused when the converter is on (inert otherwise, as in torchtitan).
  bool enable_fsdp_float8_all_gather = false;
  bool precompute_float8_dynamic_scale_for_fsdp = false;
  std::vector<std::string> grouped_mm_fqns;  // [quantize.grouped_mm.float8] fqns
};

struct JobConfig {
  JobSection job;
  MetricsSection metrics;
  ProfilingSection profiling;
  ModelSection model;
  OptimizerSection optimizer;
  LRSchedulerSection lr_scheduler;
  TrainingSection training;
  ParallelismSection parallelism;
  CheckpointSection checkpoint;
  ActivationCheckpointSection activation_checkpoint;
  CompileSection compile;
  DebugSection debug;
  ValidationSection validation;
  CommSection comm;
  MoESection moe;
  Float8Section float8;
};

// model.converters turns on the float8 linears: torchtitan v0.2.2's converter name
// "quantize.linear.float8", or "float8" as its shipped configs and earlier releases write it.
bool float8_linear_enabled(const JobConfig& cfg);
// model.converters holds "quantize.grouped_mm.float8": the routed experts' grouped GEMMs
// named by quantize.grouped_mm.float8.fqns run in float8 (docs/float8.md).
bool float8_grouped_enabled(const JobConfig& cfg);

// ---- The registry ------------------------------------------------------------------------

enum class OptType { Bool, Int, Float, String, StringList, FloatList };
const char* opt_type_name(OptType t);

using OptValue =
    std::variant<bool, int64_t, double, std::string, std::vector<std::string>, std::vector<double>>;

struct Option {
  std::string section;
  std::string key;
  OptType type = OptType::String;
  OptValue default_value;
  std::string help;
  std::vector<std::string> choices;  // strings (and list items) must be one of these
  std::optional<double> min, max;    // numbers (and list items) must lie in [min, max]
  bool allow_inf = false;            // floats: inf is a meaningful value (else only a default)
  // Older torchtitan spellings ("section.key"): accepted, with one warning naming this name.
  std::vector<std::string> aliases;
  // A list of string lists (torchtitan's list[list[str]]), each inner list kept as one item
  // with its strings joined by spaces. In TOML an array of arrays; on the command line a
  // comma-separated list of space-separated groups.
  bool string_groups = false;
  // Non-empty: a torchtitan feature titan-train does not have yet ("tensor parallelism").
  // Only the default is accepted; anything else is an error naming the feature. Such options
  // have no JobConfig field and are left out of --dump-config and the startup table.
  std::string later;
  std::function<OptValue(const JobConfig&)> get;
  std::function<void(JobConfig&, const OptValue&)> set;

  std::string name() const { return section + "." + key; }
};

// Every option, in section order. Built once.
const std::vector<Option>& registry();
// The option whose name or alias is `full_name`, or nullptr.
const Option* find_option(const std::string& full_name);
// torchtitan keys (or whole sections, as "float8.*") that are accepted with one warning each
// and ignored. This list is the only place they are named.
bool is_ignored_torchtitan_key(const std::string& full_name);
const std::vector<std::string>& ignored_torchtitan_keys();
// The entry of ignored_torchtitan_keys() that covers `full_name` ("quantize.*"), or "".
std::string ignored_torchtitan_entry(const std::string& full_name);
// The registry name closest to `name` by edit distance.
std::string nearest_option_name(const std::string& name);

// Defaults from the registry.
JobConfig default_config();

// Parse a value given as text (command line) for `opt`; range and choices are checked.
// Lists take several texts, each split at commas; an empty text is an empty list.
// `where` names the source in error messages, e.g. "command line".
OptValue parse_option_text(const Option& opt, const std::vector<std::string>& texts,
                           const std::string& where);
// Check range / choices of a typed value. Throws UserError.
void check_option_value(const Option& opt, const OptValue& v, const std::string& where);

// Merge a TOML file into cfg. Unknown keys throw. Ignored torchtitan keys and old spellings
// add a warning, once per key (or per ignored section) over everything in `warnings`.
void apply_toml_file(JobConfig& cfg, const std::string& path, std::vector<std::string>& warnings);
void apply_toml_string(JobConfig& cfg, const std::string& text, const std::string& source_name,
                       std::vector<std::string>& warnings);

// Cross-key consistency that holds for any world size (run for --dump-config and at
// launch). Validation keys are checked only when validation.enable is set. Throws UserError.
void validate_config(const JobConfig& cfg);
// validate_config, plus the parallel degrees and batch sizes against `world_size` ranks.
// Run at launch only: --dump-config has no world. Throws UserError.
void validate_for_world(const JobConfig& cfg, int64_t world_size);

// Derived quantities that the startup table reports.
struct DerivedConfig {
  int64_t dp_degree = 1;         // data-parallel ranks (replicate x shard); world = dp x cp x tp
  int64_t dp_shard = 1;          // resolved data_parallel_shard_degree
  int64_t global_batch = 0;      // sequences per optimizer step
  int64_t grad_accum_steps = 1;  // micro-batches per optimizer step on each rank
  int64_t tokens_per_step = 0;   // global_batch * seq_len
};
DerivedConfig derive_config(const JobConfig& cfg, int64_t world_size);

// Text forms, all generated from the registry.
std::string dump_config_toml(const JobConfig& cfg);
std::string config_help_text();
// The short usage: the invocations, the subcommands and the two most common runs. Printed
// for a bare `titan-train` (no config and no overrides would start a 10,000-step run).
std::string usage_text();
std::string config_reference_markdown();
std::string config_table(const JobConfig& cfg);
std::string format_option_value(const OptValue& v);
// A 64-bit FNV-1a hash of the dumped config, compared across ranks at startup.
uint64_t config_hash(const JobConfig& cfg);

// Result of parsing argv for a training run.
struct CliResult {
  JobConfig cfg;
  bool show_help = false;
  bool dump_config = false;
  bool dump_schedule = false;  // print the pipeline stages and schedule, then exit
  std::vector<std::string> warnings;
};
// defaults < TOML (--config / --job.config_file) < command-line overrides.
CliResult parse_command_line(int argc, const char* const* argv);

}  // namespace titan
