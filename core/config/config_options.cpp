// The option registry: every key titan-train reads, one function per TOML section, and the
// torchtitan keys it accepts and ignores. Everything else in core/config/config.cpp (TOML, command
// line, --help, --dump-config, the README reference, validation) is derived from this table.
#include <limits>
#include <type_traits>

#include "core/config/config.h"

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
  if constexpr (std::is_same_v<T, std::vector<double>>) return OptType::FloatList;
}

using Strings = std::vector<std::string>;
using Floats = std::vector<double>;
constexpr double kNoMax = std::numeric_limits<double>::infinity();

// Chained settings of the entry just added (valid until the next one is added).
struct Def {
  Option* o;
  Def& choices(std::vector<std::string> c) {
    o->choices = std::move(c);
    return *this;
  }
  Def& range(std::optional<double> lo, std::optional<double> hi) {
    o->min = lo;
    o->max = hi;
    return *this;
  }
  // inf is a meaningful value of this float (it is refused for the others unless it is the
  // default).
  Def& infinity() {
    o->allow_inf = true;
    return *this;
  }
  Def& groups() {
    o->string_groups = true;
    return *this;
  }
  Def& alias(std::string a) {
    o->aliases.push_back(std::move(a));
    return *this;
  }
};

// Adds the entries of one TOML section, each bound to a field of JobConfig::*sec.
template <class Sec>
class SectionDefs {
 public:
  SectionDefs(const char* name, Sec JobConfig::*sec, std::vector<Option>& out)
      : name_(name), sec_(sec), out_(out) {}

  template <class T>
  Def add(const char* key, T Sec::*field, typename Identity<T>::type value, const char* help) {
    Option& o = push(key, type_of<T>(), OptValue(std::move(value)), help);
    auto sec = sec_;
    o.get = [sec, field](const JobConfig& c) { return OptValue(c.*sec.*field); };
    o.set = [sec, field](JobConfig& c, const OptValue& v) { c.*sec.*field = std::get<T>(v); };
    return Def{&o};
  }

  // A torchtitan key for a feature titan-train does not have yet: only `value` is accepted.
  template <class T>
  Def later(const char* key, T value, const char* feature, const char* help) {
    Option& o = push(key, type_of<T>(), OptValue(value), help);
    o.later = feature;
    OptValue v(std::move(value));
    o.get = [v](const JobConfig&) { return v; };
    o.set = [](JobConfig&, const OptValue&) {};  // check_option_value admits only the default
    return Def{&o};
  }

 private:
  Option& push(const char* key, OptType type, OptValue value, const char* help) {
    Option o;
    o.section = name_;
    o.key = key;
    o.type = type;
    o.default_value = std::move(value);
    o.help = help;
    out_.push_back(std::move(o));
    return out_.back();
  }

  const char* name_;
  Sec JobConfig::*sec_;
  std::vector<Option>& out_;
};

void job_options(std::vector<Option>& out) {
  SectionDefs<JobSection> s("job", &JobConfig::job, out);
  s.add("config_file", &JobSection::config_file, "", "TOML config file to load (same as --config)");
  s.add("dump_folder", &JobSection::dump_folder, "./outputs",
        "Folder for metrics, TensorBoard events and checkpoints");
  s.add("description", &JobSection::description, "default job", "Free-text description of the job");
  s.add("use_for_integration_test", &JobSection::use_for_integration_test, false,
        "Marks a config as part of the integration suite (informational)");
  s.add("print_config", &JobSection::print_config, false,
        "Also print the merged config as TOML at startup")
      .alias("job.print_args");
}

void model_options(std::vector<Option>& out) {
  SectionDefs<ModelSection> s("model", &JobConfig::model, out);
  s.add("name", &ModelSection::name, "llama3", "Model family")
      .choices({"llama3", "llama4", "deepseek_v3", "qwen3", "gpt_oss"});
  s.add("flavor", &ModelSection::flavor, "debugmodel",
        "Model size within the family (see docs/models.md); llama3 also takes \"hf:DIR\", the "
        "dimensions of a Hugging Face folder's config.json");
  s.add("hf_assets_path", &ModelSection::hf_assets_path, "",
        "Folder holding tokenizer.json (Hugging Face layout); empty: use tokenizer_path");
  s.add("tokenizer_path", &ModelSection::tokenizer_path, "",
        "tokenizer.json file, or \"bytes\" for the byte tokenizer; empty: the bundled "
        "tokenizer made by scripts/setup.sh");
  s.add("n_layers", &ModelSection::n_layers, 0,
        "Transformer blocks; 0: the flavor's. Another value keeps the flavor's width, e.g. to "
        "benchmark a large flavor's real layers on one device")
      .range(0.0, kNoMax);
  s.add("converters", &ModelSection::converters, Strings{},
        "Model converters: \"quantize.linear.float8\" (or \"float8\") trains the linear "
        "layers with float8 GEMMs ([quantize.linear.float8], docs/float8.md); "
        "\"quantize.grouped_mm.float8\" the MoE routed experts' grouped GEMMs "
        "([quantize.grouped_mm.float8])")
      .choices({"float8", "quantize.linear.float8", "quantize.grouped_mm.float8"});
  s.add("attn_mask_type", &ModelSection::attn_mask_type, "flavor",
        "Attention mask, overriding the flavor's (torchtitan's attn_mask_type): \"causal\" "
        "attends every earlier token of the window; \"block_causal\" only earlier tokens of "
        "the same document (the tokenizer's EOS ends one); \"flavor\": the flavor's "
        "(docs/attention.md)")
      .choices({"flavor", "causal", "block_causal"});
  s.add("attn_type", &ModelSection::attn_type, "flavor",
        "Attention kind, overriding the flavor's (torchtitan's attn_type); titan-train picks "
        "the kernel per device from the mask, so sdpa, flex and varlen train alike "
        "(docs/attention.md)")
      .choices({"flavor", "sdpa", "flex", "varlen"});
  s.add("document_positions", &ModelSection::document_positions, false,
        "RoPE positions restart at 0 in each packed document (as torchtitan's main branch does "
        "with block_causal); off: positions run over the whole window, as torchtitan 0.2.2");
  s.add("document_loss", &ModelSection::document_loss, false,
        "No loss across a document boundary: the label of an EOS input (the next document's "
        "first token) is ignored (as torchtitan's main branch); the loss is still divided by "
        "every token of the step");
}

void optimizer_options(std::vector<Option>& out) {
  SectionDefs<OptimizerSection> s("optimizer", &JobConfig::optimizer, out);
  s.add("name", &OptimizerSection::name, "AdamW",
        "Optimizer: AdamW for every parameter, or Muon for the weight matrices with AdamW for "
        "the embeddings, norms, biases and output head (docs/training.md)")
      .choices({"AdamW", "Muon"});
  s.add("lr", &OptimizerSection::lr, 8e-4, "Peak learning rate").range(0.0, kNoMax);
  s.add("beta1", &OptimizerSection::beta1, 0.9, "AdamW first-moment decay").range(0.0, 1.0);
  s.add("beta2", &OptimizerSection::beta2, 0.95, "AdamW second-moment decay").range(0.0, 1.0);
  s.add("eps", &OptimizerSection::eps, 1e-8, "AdamW epsilon").range(0.0, kNoMax);
  s.add("weight_decay", &OptimizerSection::weight_decay, 0.1,
        "Decoupled weight decay, applied to matrices only (docs/training.md)")
      .range(0.0, kNoMax);
  s.add("weight_decay_scope", &OptimizerSection::weight_decay_scope, "matrices",
        "Parameters weight_decay applies to: matrices (not norm gains or the embedding), or "
        "all of them as torchtitan does")
      .choices({"matrices", "all"});
  s.add("implementation", &OptimizerSection::implementation, "fused",
        "AdamW kernel: fused (one multi-tensor kernel) or for-loop")
      .choices({"fused", "foreach", "for-loop"});
  s.add("muon_lr", &OptimizerSection::muon_lr, 1e-3,
        "Muon's peak learning rate (torch.optim.Muon's lr); the lr schedule scales it as it "
        "scales optimizer.lr")
      .range(0.0, kNoMax);
  s.add("muon_weight_decay", &OptimizerSection::muon_weight_decay, 0.1,
        "Muon's decoupled weight decay, applied to every matrix Muon optimizes")
      .range(0.0, kNoMax);
  s.add("muon_momentum", &OptimizerSection::muon_momentum, 0.95, "Muon's momentum factor")
      .range(0.0, 1.0);
  s.add("muon_enable_nesterov", &OptimizerSection::muon_enable_nesterov, true,
        "Muon orthogonalizes the Nesterov look-ahead g + momentum (buf - g) instead of buf");
  s.add("muon_ns_coefficients", &OptimizerSection::muon_ns_coefficients,
        Floats{3.4445, -4.7750, 2.0315},
        "The three coefficients (a, b, c) of Muon's quintic Newton-Schulz iteration");
  s.add("muon_ns_steps", &OptimizerSection::muon_ns_steps, 5,
        "Newton-Schulz iterations per Muon step (torch.optim.Muon allows 1 to 99)")
      .range(1.0, 99.0);
  s.add("muon_eps", &OptimizerSection::muon_eps, 1e-7,
        "Floor of the norm that scales a matrix before Newton-Schulz")
      .range(0.0, kNoMax);
  s.add("muon_adjust_lr_fn", &OptimizerSection::muon_adjust_lr_fn, "original",
        "Muon's lr per matrix of shape (A, B): original lr sqrt(max(1, A/B)), match_rms_adamw "
        "lr 0.2 sqrt(max(A, B)), spectral_unclamped lr sqrt(A/B)")
      .choices({"original", "match_rms_adamw", "spectral_unclamped"});
  s.add("param_groups", &OptimizerSection::param_groups, Strings{},
        "With optimizer.name = \"Muon\": entries \"REGEX=AdamW\" or \"REGEX=Muon\", each "
        "optionally followed by \":lr=X\" and/or \":weight_decay=Y\" (the group's own peak lr, "
        "scaled by the schedule, and weight decay); the first entry whose regex is found in a "
        "parameter's name picks its optimizer and settings, before the default routing. An "
        "entry matching no parameter exits 2");
}

void lr_scheduler_options(std::vector<Option>& out) {
  SectionDefs<LRSchedulerSection> s("lr_scheduler", &JobConfig::lr_scheduler, out);
  s.add("warmup_steps", &LRSchedulerSection::warmup_steps, 200, "Linear warmup steps")
      .range(0.0, kNoMax);
  s.add("decay_ratio", &LRSchedulerSection::decay_ratio, -1.0,
        "Fraction of the steps spent decaying (warmup-stable-decay); negative: decay over "
        "every step after warmup")
      .range(-1.0, 1.0);
  s.add("decay_type", &LRSchedulerSection::decay_type, "linear", "Shape of the decay")
      .choices({"linear", "sqrt", "cosine"});
  s.add("min_lr_factor", &LRSchedulerSection::min_lr_factor, 0.0,
        "Floor of the decay as a fraction of the peak lr")
      .range(0.0, 1.0)
      .alias("lr_scheduler.lr_min");
  s.later("total_steps", int64_t{-1}, "a schedule length other than training.steps",
          "Steps the schedule spans instead of training.steps: not supported yet (-1: unset)");
}

void training_options(std::vector<Option>& out) {
  SectionDefs<TrainingSection> s("training", &JobConfig::training, out);
  s.add("dataset", &TrainingSection::dataset, "kjv",
        "Dataset name; \"kjv\" is the bundled King James Bible corpus");
  s.add("dataset_path", &TrainingSection::dataset_path, Strings{},
        "Data files or folders: .txt (blank-line separated documents), .jsonl (\"text\" "
        "field) or .tok (made by `titan-train tokenize`); several form a blend; empty: the "
        "named dataset");
  s.add("dataset_weights", &TrainingSection::dataset_weights, Floats{},
        "Blend weight of each dataset_path entry; empty: proportional to their tokens")
      .range(0.0, kNoMax);
  s.add("local_batch_size", &TrainingSection::local_batch_size, 8,
        "Sequences per micro-batch on each rank")
      .range(1.0, kNoMax)
      .alias("training.batch_size");
  s.add("global_batch_size", &TrainingSection::global_batch_size, -1,
        "Sequences per optimizer step over all ranks; -1: local_batch_size x data-parallel "
        "degree. Larger values accumulate gradients")
      .range(-1.0, kNoMax);
  s.add("seq_len", &TrainingSection::seq_len, 2048, "Tokens per sequence").range(1.0, kNoMax);
  s.add("max_norm", &TrainingSection::max_norm, 1.0,
        "Clip gradients to this global L2 norm; 0 disables clipping")
      .range(0.0, kNoMax);
  s.add("steps", &TrainingSection::steps, 10000, "Optimizer steps to train").range(1.0, kNoMax);
  s.add("mixed_precision_param", &TrainingSection::mixed_precision_param, "bfloat16",
        "Compute dtype of parameters on CUDA (fp32 master weights are kept); CPU runs stay in "
        "float32 except under compile.enable, whose capture check runs the GPU's dtypes")
      .choices({"bfloat16", "float32"});
  s.add("mixed_precision_reduce", &TrainingSection::mixed_precision_reduce, "float32",
        "Dtype of gradient reductions across ranks")
      .choices({"float32", "bfloat16"});
  s.add("device", &TrainingSection::device, "auto",
        "Where to train: \"cuda\" (rank i on GPU LOCAL_RANK i), \"cpu\", or \"auto\" (cuda when "
        "a GPU is visible, else cpu)")
      .choices({"auto", "cuda", "cpu"});
  s.add("holdout_fraction", &TrainingSection::holdout_fraction, 0.01,
        "Fraction of documents held out of training for validation")
      .range(0.0, 0.5);
  s.later("dtype", std::string("float32"), "training without fp32 master weights",
          "Parameter dtype: only float32 masters (use mixed_precision_param for bf16 compute)");
}

void parallelism_options(std::vector<Option>& out) {
  SectionDefs<ParallelismSection> s("parallelism", &JobConfig::parallelism, out);
  s.add("data_parallel_replicate_degree", &ParallelismSection::data_parallel_replicate_degree, 1,
        "Replicas (DDP, or HSDP with shard degree > 1)")
      .range(1.0, kNoMax);
  s.add("data_parallel_shard_degree", &ParallelismSection::data_parallel_shard_degree, -1,
        "FSDP shard degree; -1: the rest of the world size")
      .range(-1.0, kNoMax);
  s.add("fsdp_reshard_after_forward", &ParallelismSection::fsdp_reshard_after_forward, "default",
        "Free gathered parameters after forward: default (yes), always, never")
      .choices({"default", "always", "never"});
  s.add("tensor_parallel_degree", &ParallelismSection::tensor_parallel_degree, 1,
        "Tensor (and sequence) parallel degree: the innermost mesh dimension, inside a node")
      .range(1.0, kNoMax);
  s.add("enable_async_tensor_parallel", &ParallelismSection::enable_async_tensor_parallel, false,
        "Async tensor parallelism: TP's all-gathers and reduce-scatters run in chunks that "
        "overlap the GEMMs beside them (needs tensor_parallel_degree > 1)");
  s.add("pipeline_parallel_degree", &ParallelismSection::pipeline_parallel_degree, 1,
        "Pipeline stages' ranks, the outermost mesh dimension (data, context, tensor, expert "
        "parallel inside)")
      .range(1.0, kNoMax);
  s.add("pipeline_parallel_schedule", &ParallelismSection::pipeline_parallel_schedule, "1F1B",
        "Pipeline schedule (any case): GPipe, 1F1B, LoopedBFS, Interleaved1F1B, "
        "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV");
  s.add("pipeline_parallel_schedule_csv", &ParallelismSection::pipeline_parallel_schedule_csv, "",
        "A schedule as CSV (one row per rank of actions like 0F1, 1B0); empty: generated");
  s.add("pipeline_parallel_microbatch_size", &ParallelismSection::pipeline_parallel_microbatch_size,
        1, "Sequences per pipeline micro-batch; local_batch_size / this = micro-batches")
      .range(1.0, kNoMax);
  s.add("pipeline_parallel_layers_per_stage",
        &ParallelismSection::pipeline_parallel_layers_per_stage, 0,
        "Weighted layers per stage (gives the number of stages); 0: 1 stage per rank for "
        "GPipe and 1F1B, else 2")
      .range(0.0, kNoMax);
  s.add("pipeline_parallel_first_stage_less_layers",
        &ParallelismSection::pipeline_parallel_first_stage_less_layers, 1,
        "Layers the embeddings count as in the stage split")
      .range(0.0, kNoMax);
  s.add("pipeline_parallel_last_stage_less_layers",
        &ParallelismSection::pipeline_parallel_last_stage_less_layers, 1,
        "Layers the final norm and output count as in the stage split")
      .range(0.0, kNoMax);
  s.add("pipeline_parallel_expert_parallel_overlap",
        &ParallelismSection::pipeline_parallel_expert_parallel_overlap, true,
        "DualPipeV with expert_parallel_degree > 1: each forward + backward pair runs "
        "overlapped, one half's expert all-to-all in flight while the other computes");
  s.add("module_fqns_per_model_part", &ParallelismSection::module_fqns_per_model_part, Strings{},
        "Explicit stage split: per stage, its modules (tok_embeddings, layers.N, norm, output) "
        "in forward order; TOML: an array of arrays; command line: stages separated by commas, "
        "modules by spaces; empty: the rule above")
      .groups();
  s.add("context_parallel_degree", &ParallelismSection::context_parallel_degree, 1,
        "Context-parallel degree: ranks that each hold a slice of every sequence (folded into "
        "the FSDP shard dimension)")
      .range(1.0, kNoMax);
  s.add("context_parallel_load_balancer", &ParallelismSection::context_parallel_load_balancer,
        "headtail",
        "headtail: rank r holds chunks r and 2 cp - 1 - r of 2 cp (equal causal work); none "
        "(torchtitan's None): the contiguous chunk r; ptrr is not implemented")
      .choices({"headtail", "none", "None", "ptrr"});
  s.add("context_parallel_rotate_method", &ParallelismSection::context_parallel_rotate_method,
        "allgather",
        "How context parallel attention exchanges keys and values: allgather (alltoall is not "
        "implemented)")
      .choices({"allgather", "alltoall"});
  s.add("expert_parallel_degree", &ParallelismSection::expert_parallel_degree, 1,
        "Expert-parallel degree, borrowed from the shard dimension (dp2ep)")
      .range(1.0, kNoMax);
  s.add("expert_tensor_parallel_degree", &ParallelismSection::expert_tensor_parallel_degree, 1,
        "Tensor parallelism inside the routed experts: 1, or equal to tensor_parallel_degree")
      .range(1.0, kNoMax);
}

void checkpoint_options(std::vector<Option>& out) {
  using C = CheckpointSection;
  SectionDefs<C> s("checkpoint", &JobConfig::checkpoint, out);
  s.add("enable", &C::enable, false, "Save checkpoints and resume from the latest one")
      .alias("checkpoint.enable_checkpoint");
  s.add("folder", &C::folder, "checkpoint", "Checkpoint folder under job.dump_folder");
  s.add("interval", &C::interval, 500, "Save every this many steps").range(1.0, kNoMax);
  s.add("last_save_model_only", &C::last_save_model_only, false,
        "Final save holds the model only (then it cannot be resumed from)")
      .alias("checkpoint.last_save_model_weights_only")
      .alias("checkpoint.model_weights_only");
  s.add("export_dtype", &C::export_dtype, "float32", "Dtype of model-only and Hugging Face exports")
      .choices({"float32", "bfloat16", "float16"});
  s.add("async_mode", &C::async_mode, "disabled",
        "disabled, or async: copy to CPU and write in a background thread")
      .choices({"disabled", "async", "async_with_pinned_mem"});
  s.add("keep_latest_k", &C::keep_latest_k, 10, "Keep only the newest k checkpoints; 0 keeps all")
      .range(0.0, kNoMax);
  s.add("load_step", &C::load_step, -1, "Resume from this step; -1: the latest complete checkpoint")
      .range(-1.0, kNoMax);
  s.add("initial_load_path", &C::initial_load_path, "",
        "Checkpoint to initialise from when dump_folder has none");
  s.add("initial_load_model_only", &C::initial_load_model_only, true,
        "Load only the model from initial_load_path")
      .alias("checkpoint.initial_load_model_weights_only");
  s.add("initial_load_in_hf", &C::initial_load_in_hf, false,
        "initial_load_path is a Hugging Face safetensors folder");
  s.add("last_save_in_hf", &C::last_save_in_hf, false,
        "Also export the final model in Hugging Face format");
  s.add("exclude_from_loading", &C::exclude_from_loading, Strings{},
        "Parts not to load: model, optimizer, lr_scheduler, dataloader, train_state")
      .choices({"model", "optimizer", "lr_scheduler", "dataloader", "train_state"});
  s.later("initial_load_in_hf_quantized", false, "loading quantized Hugging Face weights",
          "initial_load_path holds quantized weights: not supported yet");
  s.later("load_only", false, "load-only runs (no saves)",
          "Load checkpoints but never save: not supported yet");
  s.add("create_seed_checkpoint", &C::create_seed_checkpoint, false,
        "Initialise the model, save it as step 0 and exit (one process, checkpoint.enable)");
}

void activation_checkpoint_options(std::vector<Option>& out) {
  using A = ActivationCheckpointSection;
  SectionDefs<A> s("activation_checkpoint", &JobConfig::activation_checkpoint, out);
  s.add("mode", &A::mode, "selective",
        "Recompute in backward: none, full (every block) or selective")
      .choices({"none", "full", "selective"});
  s.add("selective_ac_option", &A::selective_ac_option, "2",
        "With mode=selective: a positive integer N (recompute every Nth block), or op (save "
        "the GEMM and attention outputs, recompute the ops between them)");
  s.add("per_op_sac_force_recompute_mm_shapes_by_fqns",
        &A::per_op_sac_force_recompute_mm_shapes_by_fqns, Strings{"moe.router.gate"},
        "With selective_ac_option=op: matmuls with the weight shape of these modules are "
        "recomputed rather than saved");
}

void compile_options(std::vector<Option>& out) {
  SectionDefs<CompileSection> s("compile", &JobConfig::compile, out);
  s.add("enable", &CompileSection::enable, false,
        "Capture the train step as CUDA graphs (on the CPU: run it eagerly under the capture "
        "check, which exits 2 naming what would break capture; docs/compile.md)")
      .alias("training.compile");
  s.add("components", &CompileSection::components, Strings{"model", "loss"},
        "What torchtitan compiles; titan-train captures the whole step, so only both "
        "(the default) is allowed with compile.enable")
      .choices({"model", "loss"});
}

void metrics_options(std::vector<Option>& out) {
  SectionDefs<MetricsSection> s("metrics", &JobConfig::metrics, out);
  s.add("log_freq", &MetricsSection::log_freq, 10, "Log every this many steps").range(1.0, kNoMax);
  s.add("enable_tensorboard", &MetricsSection::enable_tensorboard, false,
        "Write TensorBoard event files");
  s.add("save_tb_folder", &MetricsSection::save_tb_folder, "tb",
        "TensorBoard folder under job.dump_folder");
  s.add("disable_color_printing", &MetricsSection::disable_color_printing, false,
        "Plain log lines");
  s.add("save_for_all_ranks", &MetricsSection::save_for_all_ranks, false,
        "Every rank writes its own metrics files");
}

void profiling_options(std::vector<Option>& out) {
  using P = ProfilingSection;
  SectionDefs<P> s("profiling", &JobConfig::profiling, out);
  s.add("enable_profiling", &P::enable_profiling, false,
        "Record Kineto traces of the train step (Chrome trace JSON, loadable in Perfetto)");
  s.add("save_traces_folder", &P::save_traces_folder, "profile_traces",
        "Trace folder under job.dump_folder: iteration_N/rank<R>_trace.json per window");
  s.add("profile_freq", &P::profile_freq, 10,
        "Profile the last profiler_active steps of every this many steps")
      .range(1.0, kNoMax);
  s.add("profiler_active", &P::profiler_active, 1, "Steps recorded per window").range(1.0, kNoMax);
  s.add("profiler_warmup", &P::profiler_warmup, 3,
        "Steps before each window with the profiler prepared but not recording")
      .range(0.0, kNoMax);
}

void debug_options(std::vector<Option>& out) {
  SectionDefs<DebugSection> s("debug", &JobConfig::debug, out);
  s.add("seed", &DebugSection::seed, 0, "Seed for initialization and data order")
      .range(0.0, kNoMax)
      .alias("training.seed");
  s.add("deterministic", &DebugSection::deterministic, false,
        "Use deterministic kernels; runs with the same seed repeat exactly")
      .alias("training.deterministic");
  s.add("float8_plant_slow_scaled_mm_ms", &DebugSection::float8_plant_slow_scaled_mm_ms, 0.0,
        "Test seam: milliseconds added to each _scaled_mm call of the start-up float8 CPU "
        "probe, a stand-in for a processor whose CPU _scaled_mm is slow (docs/float8.md)")
      .range(0.0, 10000.0);
  s.add("plant_error", &DebugSection::plant_error, "",
        "Test seam: raise this kind of error where a run starts (internal, oom, std), or read "
        "each step's loss on the host (host_read), the break the capture check must refuse")
      .choices({"", "internal", "oom", "std", "host_read"});
  s.add("force_fsdp", &DebugSection::force_fsdp, false,
        "Test seam: shard with FSDP even over one rank, so FSDP's collectives run (and are "
        "captured) on a single GPU");
  s.add("force_ep", &DebugSection::force_ep, false,
        "Test seam: run the expert-parallel exchange over a world of one rank (MoE models)");
  s.add("comm_overlap", &DebugSection::comm_overlap, true,
        "Test seam: false turns off the FSDP prefetches, the early reduce-scatter and the DDP "
        "backward hooks (the blocking schedule), to measure what the overlap buys");
  s.add("checkpoint_delay_ms", &DebugSection::checkpoint_delay_ms, 0,
        "Test seam: sleep this long before a checkpoint's folder is renamed into place (a slow "
        "disk)")
      .range(0.0, 600000.0);
  s.add("capture_check_context", &DebugSection::capture_check_context, 0,
        "Debugging aid: on a capture-check break, print the N ops before and after it in both "
        "steps, with their shapes")
      .range(0.0, kNoMax);
  s.later("moe_force_load_balance", false, "forced round-robin expert routing",
          "Route tokens round-robin to balance experts (a debugging aid): not supported yet");
}

void validation_options(std::vector<Option>& out) {
  SectionDefs<ValidationSection> s("validation", &JobConfig::validation, out);
  s.add("enable", &ValidationSection::enable, false,
        "Evaluate on the held-out split every freq steps; the other validation keys are read "
        "only when this is set")
      .alias("validation.enabled");
  s.add("dataset", &ValidationSection::dataset, "",
        "Validation dataset; empty: the training data's held-out split");
  s.add("dataset_path", &ValidationSection::dataset_path, Strings{},
        "Validation data file; empty: the training data's held-out split");
  s.add("local_batch_size", &ValidationSection::local_batch_size, 8,
        "Sequences per validation batch")
      .range(1.0, kNoMax);
  s.add("seq_len", &ValidationSection::seq_len, 2048, "Tokens per validation sequence")
      .range(1.0, kNoMax);
  s.add("freq", &ValidationSection::freq, 10, "Validate every this many steps").range(1.0, kNoMax);
  s.add("steps", &ValidationSection::steps, -1,
        "Validation batches per evaluation; -1: the whole split")
      .range(-1.0, kNoMax);
}

void comm_options(std::vector<Option>& out) {
  SectionDefs<CommSection> s("comm", &JobConfig::comm, out);
  s.add("init_timeout_seconds", &CommSection::init_timeout_seconds, 300,
        "Collective timeout until the first step completes")
      .range(1.0, kNoMax);
  s.add("train_timeout_seconds", &CommSection::train_timeout_seconds, 100,
        "Collective timeout after the first step: a dead or hung rank ends every rank within "
        "this time")
      .range(1.0, kNoMax);
  s.later("mode", std::string("default"), "fake or local-tensor process groups (dry runs)",
          "Process-group kind: only real ones (default)");
}

void moe_options(std::vector<Option>& out) {
  SectionDefs<MoESection> s("moe", &JobConfig::moe, out);
  s.add("experts_backend", &MoESection::experts_backend, "auto",
        "Expert GEMMs: grouped_mm (CUDA 9.x/10.x), cutlass (CUDA 8.0+), loop (syncs once per "
        "layer), or auto (grouped_mm, else cutlass on CUDA; loop on the CPU)")
      .choices({"auto", "grouped_mm", "cutlass", "loop"});
  s.add("ep_exchange", &MoESection::ep_exchange, "auto",
        "Expert-parallel token exchange: static (fixed-size all-to-alls, no host sync), exact "
        "(variable splits, one host read of the counts per layer), or auto (static when "
        "compile.enable, else exact)")
      .choices({"auto", "static", "exact"});
  s.add("ep_capacity_factor", &MoESection::ep_capacity_factor, 2.0,
        "Static exchange: rows per (source, destination) pair = ceil(factor * tokens * top_k / "
        "ep), i.e. factor x the balanced share, at most the worst case; a step that overflows "
        "is run again with the exact exchange (unless ep_drop_policy drops); inf: the worst "
        "case, which never overflows")
      .range(0.0, kNoMax)
      .infinity();
  s.add("ep_capacity_factor_max", &MoESection::ep_capacity_factor_max, 4.0,
        "Static exchange: repeated overflows (4 in 100 steps) grow the capacity factor x1.5 up "
        "to this cap (at least ep_capacity_factor); past it the run continues eagerly with the "
        "exact exchange")
      .range(0.0, kNoMax);
  s.add("ep_drop_policy", &MoESection::ep_drop_policy, "none",
        "Static exchange, rows over a pair's capacity: none (never dropped: the step is run "
        "again with the exact exchange) or probs (dropped, lowest router probability first; "
        "counted in moe_dropped_tokens)")
      .choices({"none", "probs"});
  s.add("load_balance_coeff", &MoESection::load_balance_coeff, 1e-3,
        "Aux-loss-free expert-bias update speed; 0 turns balancing off")
      .range(0.0, kNoMax);
  s.add("seq_aux_loss_coeff", &MoESection::seq_aux_loss_coeff, 0.0,
        "Weight of DeepSeek-V3's sequence-wise auxiliary balance loss; 0 disables")
      .range(0.0, kNoMax);
}

// torchtitan v0.2.2's Float8Linear and Float8GroupedMM; v0.1's [float8] names are aliases.
void float8_options(std::vector<Option>& out) {
  using F = Float8Section;
  SectionDefs<F> s("quantize.linear.float8", &JobConfig::float8, out);
  // torchtitan's default (no recipe) is torchao's default config, which is tensorwise.
  s.add("recipe_name", &F::recipe_name, "tensorwise",
        "Float8 scaling recipe (torchao's): tensorwise (one scale per tensor), rowwise (per "
        "row, power-of-2 scales) or rowwise_with_gw_hp (rowwise; weight gradient in high "
        "precision)")
      .choices({"tensorwise", "rowwise", "rowwise_with_gw_hp"})
      .alias("float8.recipe_name");
  s.add("filter_fqns", &F::filter_fqns, Strings{},
        "Linear layers left in high precision: those whose fully qualified name contains one "
        "of these; \"auto_filter_small_kn\" also leaves those too small to gain (torchao's "
        "K/N thresholds). The output layer, embedding and router always stay high precision")
      .alias("float8.filter_fqns");
  s.add("emulate", &F::emulate, false,
        "Quantize and dequantize, then multiply in high precision, on every device (needed "
        "on CUDA below SM89; the CPU emulates what its kernel lacks by itself)")
      .alias("float8.emulate");
  s.add("enable_fsdp_float8_all_gather", &F::enable_fsdp_float8_all_gather, false,
        "FSDP gathers the float8 linears' weights in float8 e4m3 (1 byte per element), cast "
        "with the whole weight's tensorwise scale; recipe_name tensorwise only. Without FSDP "
        "sharding there is nothing to gather")
      .alias("float8.enable_fsdp_float8_all_gather");
  s.add("precompute_float8_dynamic_scale_for_fsdp", &F::precompute_float8_dynamic_scale_for_fsdp,
        false,
        "With enable_fsdp_float8_all_gather: every float8 weight's scale computed after the "
        "optimizer step with one fused amax and one all-reduce, instead of an all-reduce per "
        "FSDP unit at each gather")
      .alias("float8.precompute_float8_dynamic_scale_for_fsdp");
  SectionDefs<F> g("quantize.grouped_mm.float8", &JobConfig::float8, out);
  g.add("fqns", &F::grouped_mm_fqns, Strings{},
        "MoE modules whose routed experts' grouped GEMMs run in float8 rowwise (converter "
        "quantize.grouped_mm.float8): an entry converts layers.<l>.moe.experts when it is a "
        "substring of that name, e.g. \"experts\"; an entry matching none exits 2");
}

// torchtitan switches whose feature titan-train does not have: accepted at torchtitan's
// default (what titan-train does), any other value exits 2 naming the key (issue 41: no key
// may change memory or behaviour silently). Their sub-settings, inert while the switch is
// off, are in kIgnored. Only later() is used: no JobConfig field is bound.
void unsupported_torchtitan_options(std::vector<Option>& out) {
  auto section = [&out](const char* name) {
    return SectionDefs<DebugSection>(name, &JobConfig::debug, out);
  };
  using Strings = std::vector<std::string>;
  section("job").later("save_config_file", std::string(""), "saving the config as JSON",
                       "torchtitan's JSON copy of the config (use --dump-config)");
  section("job").later("custom_config_module", std::string(""), "Python config modules",
                       "torchtitan's Python config extension");
  section("profiling")
      .later("enable_memory_snapshot", false, "CUDA memory snapshots",
             "torchtitan's CUDA caching-allocator snapshots");
  section("metrics").later("enable_wandb", false, "Weights & Biases logging",
                           "torchtitan's wandb logger (metrics.jsonl and TensorBoard exist)");
  section("model").later("print_after_conversion", false, "printing the converted model",
                         "torchtitan's print of the model after its converters");
  section("optimizer")
      .later("early_step_in_backward", false, "stepping the optimizer inside backward",
             "torchtitan's per-parameter step during backward");
  section("training")
      .later("enable_cpu_offload", false, "CPU offload of FSDP state",
             "torchtitan's FSDP CPU offload of parameters and optimizer state");
  section("parallelism")
      .later("enable_compiled_autograd", false, "compiled autograd",
             "torchtitan v0.1's compiled autograd");
  section("parallelism")
      .later("disable_loss_parallel", false, "a loss on gathered logits under tensor parallelism",
             "torchtitan's switch off the vocabulary-parallel loss");
  section("parallelism")
      .later("pipeline_parallel_split_points", Strings{},
             "split points (use pipeline_parallel_layers_per_stage)",
             "torchtitan v0.1's explicit stage boundaries");
  section("parallelism")
      .later("expert_parallel_comm_backend", std::string("standard"), "the DeepEP all-to-all",
             "torchtitan's expert-parallel all-to-all: standard or deepep");
  section("checkpoint")
      .later("enable_first_step_checkpoint", false, "a checkpoint after the first step",
             "torchtitan's save right after step 1");
  section("activation_checkpoint")
      .later("early_stop", false, "early-stopped recomputation",
             "torch.utils.checkpoint's early stop");
  section("fault_tolerance")
      .later("enable", false, "TorchFT fault tolerance", "torchtitan's TorchFT integration");
  section("experimental")
      .later("custom_import", std::string(""), "importing Python modules",
             "torchtitan's import of a Python model module");
  section("experimental")
      .later("custom_args_module", std::string(""), "Python config modules",
             "torchtitan's deprecated Python config extension");
  section("memory_estimation")
      .later("enable", false, "torchtitan's FSDP memory estimator", "use `titan-train estimate`");
}

std::vector<Option> build_registry() {
  std::vector<Option> out;
  job_options(out);
  model_options(out);
  optimizer_options(out);
  lr_scheduler_options(out);
  training_options(out);
  parallelism_options(out);
  checkpoint_options(out);
  activation_checkpoint_options(out);
  compile_options(out);
  metrics_options(out);
  profiling_options(out);
  debug_options(out);
  validation_options(out);
  comm_options(out);
  moe_options(out);
  float8_options(out);
  unsupported_torchtitan_options(out);
  return out;
}

// torchtitan (v0.1 and v0.2.2) keys that change nothing titan-train computes: Python-side
// tuning (gc, dataloader workers, flight-recorder buffers, inductor) and sub-settings of
// features whose switch is refused while on (memory snapshot folders, TorchFT details, MX
// recipes: the mx converter is refused). v0.1's float8.force_recompute_fp8_weight_in_bwd is what
// titan-train's float8 op always does. "x.*" covers x and below.
const std::vector<std::string> kIgnored = {
    "profiling.save_memory_snapshot_folder",
    "float8.force_recompute_fp8_weight_in_bwd",
    "mx.*",
    "fault_tolerance.process_group",
    "fault_tolerance.process_group_timeout_ms",
    "fault_tolerance.replica_id",
    "fault_tolerance.group_size",
    "fault_tolerance.min_replica_size",
    "fault_tolerance.semi_sync_method",
    "memory_estimation.disable_fake_mode",
    "quantize.linear.mx.*",
    "quantize.grouped_mm.mx.*",
    "training.gc_freq",
    "training.gc_debug",
    "training.dataloader.*",
    "checkpoint.enable_ft_dataloader_checkpoints",
    "activation_checkpoint.memory_budget",
    "activation_checkpoint.visualize_memory_budget_pareto",
    "activation_checkpoint.preserve_rng_state",
    "activation_checkpoint.determinism_check",
    "activation_checkpoint.debug",
    "compile.backend",
    "comm.trace_buf_size",
    "comm.save_traces_folder",
    "comm.save_traces_file_prefix",
    "debug.deterministic_warn_only",
    "validation.dataloader.*",
};

}  // namespace

const std::vector<Option>& registry() {
  static const std::vector<Option> r = build_registry();
  return r;
}

const std::vector<std::string>& ignored_torchtitan_keys() {
  return kIgnored;
}

}  // namespace titan
