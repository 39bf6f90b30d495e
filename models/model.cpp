#include "models/model.h"

#include "core/errors.h"
#include "models/deepseek_v3.h"
#include "models/layers.h"
#include "models/llama3.h"
#include "models/llama4.h"

namespace titan {

namespace {
thread_local bool g_defer_params = false;  // set by build_model(defer_params = true)
}  // namespace

int64_t ParamStore::add(const std::string& name, at::Tensor value, bool weight_decay) {
  TORCH_CHECK(index_of(name) < 0, "duplicate parameter ", name);
  const at::Device device = value.device();
  if (g_defer_params) value = at::empty(value.sizes(), value.options().device(at::kMeta));
  Param p{name, value.requires_grad_(true), weight_decay};
  p.device = device;
  params_.push_back(std::move(p));
  return static_cast<int64_t>(params_.size()) - 1;
}

void ParamStore::assign(int64_t i, const at::Tensor& full) {
  at::NoGradGuard ng;
  Param& p = params_[static_cast<size_t>(i)];
  TORCH_CHECK(full.sizes().vec() == p.full_shape(), "assign: ", p.name, " has another shape");
  TORCH_CHECK(!p.value.is_meta(), "assign: ", p.name, " is not materialized");
  if (!p.sharded()) {
    p.value.copy_(full);
  } else if (p.dim0_rows > 0) {
    p.value.narrow(0, 0, p.dim0_rows).copy_(full.narrow(0, p.dim0_offset, p.dim0_rows));
  }
}

void ParamStore::fill(int64_t i, double v) {
  at::NoGradGuard ng;
  Param& p = params_[static_cast<size_t>(i)];
  p.valid(p.value).fill_(v);
}

int64_t ParamStore::index_of(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) return static_cast<int64_t>(i);
  return -1;
}

int64_t ParamStore::numel() const {
  int64_t n = 0;
  for (auto& p : params_) n += p.value.numel();
  return n;
}

std::vector<at::Tensor> ParamStore::tensors() const {
  std::vector<at::Tensor> t;
  for (auto& p : params_) t.push_back(p.value);
  return t;
}

ParamInit::ParamInit(ParamStore& store, uint64_t seed)
    : store_(store), gen_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

void ParamInit::normal(int64_t i, double std) {
  at::NoGradGuard ng;
  at::Tensor cpu = at::empty(store_[i].full_shape(), at::kFloat);
  cpu.normal_(0.0, std, gen_);
  store_.assign(i, cpu);
}

void ParamInit::trunc_normal(int64_t i, double std, double a, double b) {
  at::NoGradGuard ng;
  at::Tensor cpu = at::empty(store_[i].full_shape(), at::kFloat);
  trunc_normal_(cpu, 0.0, std, a, b, gen_);
  store_.assign(i, cpu);
}

void ParamInit::ones(int64_t i) {
  store_.fill(i, 1.0);
}

at::Tensor Model::weight(int64_t i) const {
  if (weight_fn_) return weight_fn_(i);
  const at::Tensor& p = params_[i].value;
  return p.scalar_type() == compute_dtype_ ? p : p.to(compute_dtype_);
}

void Model::add_block(std::vector<int64_t> params, BlockFn fn) {
  block_params_.push_back(std::move(params));
  block_fns_.push_back(std::move(fn));
}

at::Tensor Model::run_blocks(at::Tensor h) const {
  for (size_t l = 0; l < block_fns_.size(); ++l) {
    std::vector<at::Tensor> w;
    for (int64_t i : block_params_[l]) w.push_back(weight(i));
    const int64_t li = static_cast<int64_t>(l);
    h = recompute_block(li) ? checkpoint_block(block_fns_[l], h, w) : block_fns_[l](h, w);
    h = block_done(li, h);
  }
  return h;
}

ModelInfo Model::base_info(const std::string& name, int64_t vocab_size, int64_t max_seq_len,
                           int64_t dim, int64_t n_layers) const {
  ModelInfo info;
  info.name = name;
  info.vocab_size = vocab_size;
  info.max_seq_len = max_seq_len;
  info.dim = dim;
  info.n_layers = n_layers;
  info.n_params = params_.numel();
  info.n_params_embedding = vocab_size * dim;
  return info;
}

std::vector<std::string> model_flavors(const std::string& name) {
  if (name == "llama3") return llama3_flavor_names();
  if (name == "llama4") return llama4_flavor_names();
  if (name == "deepseek_v3") return deepseek_v3_flavor_names();
  return {};
}

std::unique_ptr<Model> build_model(const JobConfig& cfg, at::Device device, bool defer_params) {
  struct DeferGuard {
    explicit DeferGuard(bool on) { g_defer_params = on; }
    ~DeferGuard() { g_defer_params = false; }
  } defer(defer_params);
  std::unique_ptr<Model> m;
  if (cfg.model.name == "llama3") {
    m = std::make_unique<Llama3>(llama3_flavor(cfg.model.flavor), device);
  } else if (cfg.model.name == "llama4") {
    Llama4Args a = llama4_flavor(cfg.model.flavor);
    // Like torchtitan's update_from_config: the RoPE table covers the run's sequences.
    a.max_seq_len = run_max_seq_len(cfg);
    configure_moe(a.moe, cfg, device);
    m = std::make_unique<Llama4>(a, device);
  } else if (cfg.model.name == "deepseek_v3") {
    DeepSeekV3Args a = deepseek_v3_flavor(cfg.model.flavor);
    // As torchtitan: YaRN and its softmax mscale apply when the run's sequences are longer
    // than original_seq_len.
    a.max_seq_len = run_max_seq_len(cfg);
    configure_moe(a.moe, cfg, device);
    m = std::make_unique<DeepSeekV3>(a, device);
  } else {
    throw UserError("model.name = \"" + cfg.model.name +
                    "\" is not a model; allowed: llama3, llama4, deepseek_v3");
  }
  if (!defer_params) m->init_weights(static_cast<uint64_t>(cfg.debug.seed));
  return m;
}

}  // namespace titan
