#include "app/fatal.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <new>
#include <sstream>
#include <string>

#include "core/base/errors.h"
#include "core/telemetry/cuda_info.h"

namespace titan {
namespace {

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

// MemAvailable of /proc/meminfo in bytes (0 where it cannot be read).
int64_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

std::string first_line(const std::string& s) {
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// c10's CPU allocator words its failure "DefaultCPUAllocator: can't allocate memory: you tried
// to allocate N bytes" (older releases: "not enough memory").
bool is_host_allocation_failure(const std::string& what) {
  return what.find("DefaultCPUAllocator") != std::string::npos &&
         (what.find("can't allocate memory") != std::string::npos ||
          what.find("not enough memory") != std::string::npos);
}

// What the allocator asked for and what was free, then the keys that lower the footprint.
int report_oom(const std::string& what, const JobConfig* cfg) {
  std::string where;
  if (const DeviceMemory m = cuda_free_and_total(); m.total > 0)
    where = "; the GPU has " + gib(m.free) + " free of " + gib(m.total);
  else if (const int64_t avail = host_available_bytes(); avail > 0)
    where = "; the host has " + gib(avail) + " available";
  std::string hint =
      "lower training.local_batch_size or training.seq_len, set activation_checkpoint.mode = "
      "\"full\" or \"selective\", or shard over more ranks "
      "(parallelism.data_parallel_shard_degree)";
  if (cfg) {
    std::ostringstream os;
    os << "lower training.local_batch_size (now " << cfg->training.local_batch_size
       << ") or training.seq_len (now " << cfg->training.seq_len
       << "), set activation_checkpoint.mode (now \"" << cfg->activation_checkpoint.mode
       << "\") to \"full\" or \"selective\", or shard over more ranks "
          "(parallelism.data_parallel_shard_degree)";
    hint = os.str();
  }
  std::fprintf(stderr, "titan-train: out of memory: %s%s\n  hint: %s\n", first_line(what).c_str(),
               where.c_str(), hint.c_str());
  return kExitOutOfMemory;
}

}  // namespace

int report_current_exception(const JobConfig* cfg) {
  try {
    throw;
  } catch (const UserError& e) {
    std::fprintf(stderr, "titan-train: error: %s\n", e.what());
    return kExitUserError;
  } catch (const c10::OutOfMemoryError& e) {
    return report_oom(e.what_without_backtrace(), cfg);
  } catch (const std::bad_alloc& e) {
    return report_oom(std::string("host allocation failed (") + e.what() + ")", cfg);
  } catch (const c10::Error& e) {
    // c10's CPU allocator reports a failed host allocation as a plain c10::Error
    // ("[enforce fail at alloc_cpu.cpp] ... DefaultCPUAllocator: can't allocate memory"), not
    // as OutOfMemoryError: it is the host running out of memory, not a bug.
    if (is_host_allocation_failure(e.what_without_backtrace()))
      return report_oom(e.what_without_backtrace(), cfg);
    // A TORCH_CHECK that failed: a bug of ours or LibTorch's, not of the input. c10 attaches
    // the C++ stack when it can (TORCH_SHOW_CPP_STACKTRACES=1 adds symbols).
    const std::string msg = e.what_without_backtrace();
    const std::string full = e.what();
    std::fprintf(stderr, "titan-train: internal error: %s\n", first_line(msg).c_str());
    const std::string rest =
        full.size() > first_line(msg).size() ? full.substr(first_line(msg).size()) : "";
    if (!rest.empty()) std::fprintf(stderr, "  details and stack:%s\n", rest.c_str());
    std::fprintf(stderr, "  please report it with the command line and config\n");
    return kExitInternalError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "titan-train: internal error: %s\n", e.what());
    return kExitInternalError;
  } catch (...) {
    std::fprintf(stderr, "titan-train: internal error: an exception of unknown type\n");
    return kExitInternalError;
  }
}

void maybe_plant_error(const JobConfig& cfg) {
  const std::string& kind = cfg.debug.plant_error;  // the registry admits only its choices
  if (kind == "internal") TORCH_CHECK(false, "planted invariant failure");
  if (kind == "oom")
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     "planted: tried to allocate 1.00 TiB (debug.plant_error = \"oom\")");
  if (kind == "std") throw std::runtime_error("planted std::runtime_error");
}

}  // namespace titan
