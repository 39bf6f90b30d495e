#include "core/base/log.h"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>

namespace titan {
namespace {
int64_t g_rank = 0;
bool g_quiet = false;  // QuietInfoScope

std::string stamp() {
  auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char buf[32];
  std::tm tm{};
  localtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}
}  // namespace

void log_set_rank(int64_t rank) {
  g_rank = rank;
}
int64_t log_rank() {
  return g_rank;
}

void log_info(const std::string& msg) {
  if (g_rank != 0 || g_quiet) return;
  std::fprintf(stdout, "[titan %s] %s\n", stamp().c_str(), msg.c_str());
  std::fflush(stdout);
}

void log_warn(const std::string& msg) {
  std::fprintf(stderr, "[titan %s rank %lld] warning: %s\n", stamp().c_str(),
               static_cast<long long>(g_rank), msg.c_str());
  std::fflush(stderr);
}

QuietInfoScope::QuietInfoScope() : was_(g_quiet) {
  g_quiet = true;
}
QuietInfoScope::~QuietInfoScope() {
  g_quiet = was_;
}

bool log_is_tty() {
  return ::isatty(STDOUT_FILENO) != 0;
}

}  // namespace titan
