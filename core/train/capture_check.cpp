#include "core/train/capture_check.h"

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <cstdio>
#include <cstdlib>
#include <atomic>
#include <set>
#include <unordered_map>

#include "core/base/errors.h"

namespace titan {

struct CaptureCheck::Recording {
  std::vector<CapturedOp> ops;
  std::vector<std::string> host_reads;                  // "aten::nonzero in layers.1.moe"
  std::unordered_map<int64_t, std::string> seq_module;  // autograd node seq nr -> module
  at::CallbackHandle handle = 0;
};

namespace {

// Per-thread state of the recording thread (the step's thread, where CPU backward also runs).
thread_local CaptureCheck::Recording* t_rec = nullptr;
thread_local std::vector<std::string> t_modules;      // ModuleScope names, outermost first
thread_local std::vector<std::string> t_bwd_modules;  // modules of the running backward nodes
thread_local int t_device_reader = 0;                 // depth inside an op of device_reader_ops()

// Ops whose result size or value is read on the host: a graph can hold none of them.
const std::set<std::string>& host_read_ops() {
  static const std::set<std::string> s = {"aten::_local_scalar_dense",
                                          "aten::item",
                                          "aten::is_nonzero",
                                          "aten::nonzero",
                                          "aten::masked_select",
                                          "aten::unique",
                                          "aten::_unique",
                                          "aten::_unique2",
                                          "aten::unique_consecutive",
                                          "aten::unique_dim",
                                          "aten::bincount",
                                          "aten::equal",
                                          "aten::allclose",
                                          "aten::_assert_async",
                                          "aten::_assert_async.msg"};
  return s;
}

// Ops whose CUDA kernels read their small operands (lr, group offsets, float8 scales) in
// device memory.
const std::set<std::string>& device_reader_ops() {
  static const std::set<std::string> s = {"aten::_fused_adamw_", "aten::_grouped_mm",
                                          "aten::_scaled_mm"};
  return s;
}

std::string current_module() {
  std::string m;
  for (const auto& s : t_modules) m += (m.empty() ? "" : ".") + s;
  if (!m.empty()) return t_bwd_modules.empty() ? m : m + " (recompute in backward)";
  if (!t_bwd_modules.empty() && !t_bwd_modules.back().empty())
    return t_bwd_modules.back() + " (backward)";
  return m;
}

void describe(const c10::IValue& v, std::string& shapes, std::string& scalars) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      shapes += "_ ";
      return;
    }
    shapes += c10::toString(t.scalar_type());
    shapes += t.sizes().empty() ? "[]" : c10::str(t.sizes());
    shapes += ' ';
  } else if (v.isTensorList()) {
    shapes += "{";
    for (const at::Tensor& t : v.toTensorVector()) describe(c10::IValue(t), shapes, scalars);
    shapes += "} ";
  } else if (v.isIntList()) {
    shapes += c10::str(v.toIntVector()) + " ";
  } else if (v.isDouble()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g ", v.toDouble());
    scalars += buf;
  } else if (v.isInt() || v.isBool()) {
    scalars += c10::str(v) + " ";
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) describe(e, shapes, scalars);
  } else if (v.isNone()) {
    shapes += "_ ";
  }
}

// The context handed from enter to exit: what enter pushed.
struct Pushed : at::ObserverContext {
  bool bwd = false, device_reader = false;
};

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  CaptureCheck::Recording* r = t_rec;
  if (r == nullptr) return nullptr;
  const std::string name = fn.name();
  // c10d's own trace record of a collective carries its running sequence number, which
  // grows by design; our collective scopes carry the sizes.
  if (name == "record_param_comms") return nullptr;
  // Inside such an op its CPU kernel runs ops of its own (the grouped GEMM's per-group slices,
  // sized by the offsets it read); on CUDA it is one kernel, so they are not recorded.
  if (t_device_reader > 0 && name != "titan::host_read") return nullptr;
  auto ctx = std::make_unique<Pushed>();
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    auto it = r->seq_module.find(fn.seqNr());
    t_bwd_modules.push_back(it == r->seq_module.end() ? "" : it->second);
    ctx->bwd = true;
  }
  const std::string module = current_module();
  // Reads inside these ops are their CPU kernels reading their own CPU operands (the fused
  // AdamW's lr, the grouped GEMM's offsets, the float8 GEMM's scales, which oneDNN takes as
  // host values); their CUDA kernels read device memory, so such a read is no break. (Where
  // _grouped_mm would sync on a GPU, below SM90, the experts backend never picks it:
  // moe/experts.cpp.)
  if (name == "titan::host_read" || (host_read_ops().count(name) && t_device_reader == 0))
    r->host_reads.push_back(name + (module.empty() ? " (in the step itself)" : " in " + module));
  if (device_reader_ops().count(name)) {
    ++t_device_reader;
    ctx->device_reader = true;
  }
  if (fn.scope() == at::RecordScope::FUNCTION && fn.seqNr() >= 0 && !t_modules.empty() &&
      at::GradMode::is_enabled())
    r->seq_module[fn.seqNr()] = module;
  CapturedOp op;
  op.name = name;
  op.module = module;
  if (fn.scope() != at::RecordScope::BACKWARD_FUNCTION)  // grads: their ops are recorded
    for (const c10::IValue& v : fn.inputs()) describe(v, op.shapes, op.scalars);
  r->ops.push_back(std::move(op));
  return ctx;
}

void on_exit(const at::RecordFunction&, at::ObserverContext* c) {
  auto* ctx = static_cast<Pushed*>(c);
  if (ctx == nullptr) return;
  if (ctx->bwd && !t_bwd_modules.empty()) t_bwd_modules.pop_back();
  if (ctx->device_reader) --t_device_reader;
}

std::string where(const CapturedOp& op) {
  return op.name + (op.module.empty() ? " (in the step itself)" : " in " + op.module);
}

// debug.capture_check_context = N: on a break, the N ops before and after the first
// difference in both steps, with their shapes, on stderr (the message names one op).
void print_context(const std::vector<CapturedOp>& want, const std::vector<CapturedOp>& got,
                   size_t at, int64_t n) {
  if (n <= 0) return;
  const size_t lo = at > static_cast<size_t>(n) ? at - static_cast<size_t>(n) : 0;
  for (const auto* ops : {&want, &got}) {
    std::fprintf(stderr, "capture check: %s step, ops %zu..%zu:\n",
                 ops == &want ? "reference" : "this", lo, at + static_cast<size_t>(n));
    for (size_t i = lo; i < std::min(ops->size(), at + static_cast<size_t>(n) + 1); ++i) {
      const CapturedOp& op = (*ops)[i];
      std::fprintf(stderr, "%s %zu %s | %s| %s\n", i == at ? ">>" : "  ", i, where(op).c_str(),
                   op.shapes.c_str(), op.scalars.c_str());
    }
  }
}

}  // namespace

ModuleScope::ModuleScope(const char* name) {
  if (t_rec == nullptr) return;
  t_modules.emplace_back(name);
  pushed_ = true;
}

ModuleScope::ModuleScope(const char* prefix, int64_t index) {
  if (t_rec == nullptr) return;
  t_modules.push_back(std::string(prefix) + "." + std::to_string(index));
  pushed_ = true;
}

ModuleScope::~ModuleScope() {
  if (pushed_ && !t_modules.empty()) t_modules.pop_back();
}

namespace {
std::atomic<int> g_live_checks{0};
}  // namespace

bool capture_check_active() {
  return g_live_checks.load(std::memory_order_relaxed) > 0;
}

CaptureCheck::CaptureCheck(int64_t warmup_steps) : warmup_(warmup_steps) {
  ++g_live_checks;
}

CaptureCheck::~CaptureCheck() {
  --g_live_checks;
  if (rec_ && rec_->handle != 0) at::removeCallback(rec_->handle);
  if (t_rec == rec_.get()) t_rec = nullptr;
}

void CaptureCheck::begin_step(const std::string& inputs_key) {
  if (inputs_key != key_) {  // a new input shape: a real capture re-captures here
    key_ = inputs_key;
    step_ = 0;
    reference_.clear();
  }
  ++step_;
  if (step_ <= warmup_) return;
  rec_ = std::make_unique<Recording>();
  start_recording();
}

// Records this thread's ops into rec_ from here (a new step, or after a pause).
void CaptureCheck::start_recording() {
  t_rec = rec_.get();
  t_modules.clear();
  t_bwd_modules.clear();
  t_device_reader = 0;
  rec_->handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_enter, &on_exit)
          .needsInputs(true)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                   at::RecordScope::USER_SCOPE}));
}

void CaptureCheck::pause() {
  if (!rec_ || rec_->handle == 0) return;
  at::removeCallback(rec_->handle);
  rec_->handle = 0;
  t_rec = nullptr;
}

void CaptureCheck::resume() {
  if (!rec_ || rec_->handle != 0) return;
  start_recording();
}

bool CaptureCheck::end_step() {
  if (!rec_) return false;  // a warm-up step
  if (rec_->handle != 0) at::removeCallback(rec_->handle);
  t_rec = nullptr;
  std::unique_ptr<Recording> rec = std::move(rec_);
  if (!rec->host_reads.empty())
    fail(rec->host_reads.front() +
         ": reads a device value on the host (a CUDA graph cannot contain a synchronization)");
  if (reference_.empty()) {
    reference_ = std::move(rec->ops);
    return false;
  }
  const std::vector<CapturedOp>& ops = rec->ops;
  for (size_t i = 0; i < std::min(ops.size(), reference_.size()); ++i) {
    const CapturedOp &got = ops[i], &want = reference_[i];
    const std::string at = "op " + std::to_string(i) + " ";
    if (got.name != want.name || got.shapes != want.shapes || got.scalars != want.scalars)
      print_context(reference_, ops, i, context_ops_);
    if (got.name != want.name)
      fail(at + where(got) + ": the op sequence changed between steps (the reference step ran " +
           where(want) + " here; control flow depends on data or host state)");
    const bool collective = got.name.rfind("titan::collective", 0) == 0;
    if (got.shapes != want.shapes)
      fail(at + where(got) +
           (collective ? ": a collective changes size between steps ("
                       : ": input shapes changed between steps (") +
           want.shapes + "-> " + got.shapes + ")");
    if (got.scalars != want.scalars)
      fail(at + where(got) + ": a host scalar argument changed between steps (" + want.scalars +
           "-> " + got.scalars + "); a graph replays the captured value");
  }
  if (ops.size() != reference_.size())
    fail("the step dispatched " + std::to_string(ops.size()) + " ops, the reference step " +
         std::to_string(reference_.size()) + " (first extra: " +
         where(ops.size() > reference_.size() ? ops[reference_.size()] : reference_[ops.size()]) +
         ")");
  ++compared_;
  return true;
}

std::string CaptureCheck::summary() const {
  return "capture check: " + std::to_string(ops_per_step()) + " ops per step, static";
}

void CaptureCheck::fail(const std::string& what) const {
  throw UserError("compile.enable = true: the step breaks CUDA-graph capture: " + what +
                  " (docs/compile.md)");
}

}  // namespace titan
