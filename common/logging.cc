#include "common/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace tandem {
namespace {

LogSeverity SeverityFromEnv() {
  const char* env = std::getenv("TANDEM_LOG_LEVEL");
  if (env == nullptr) return LogSeverity::kInfo;
  std::string v(env);
  if (v == "debug") return LogSeverity::kDebug;
  if (v == "warning") return LogSeverity::kWarning;
  if (v == "error") return LogSeverity::kError;
  return LogSeverity::kInfo;
}

std::atomic<int>& MinSeverity() {
  static std::atomic<int> min(static_cast<int>(SeverityFromEnv()));
  return min;
}

}  // namespace

LogSeverity MinLogSeverity() { return static_cast<LogSeverity>(MinSeverity().load()); }
void SetMinLogSeverity(LogSeverity severity) { MinSeverity().store(static_cast<int>(severity)); }

namespace logging_internal {

LogMessage::LogMessage(const char* file, int line, LogSeverity severity) : severity_(severity) {
  static const char kLetters[] = "DIWEF";
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm tm;
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%m%d %H:%M:%S", &tm);
  const char* base = std::strrchr(file, '/');
  char frac[16];
  std::snprintf(frac, sizeof(frac), ".%06d", static_cast<int>(us));
  stream_ << kLetters[static_cast<int>(severity)] << buf << frac << ' ' << (base ? base + 1 : file) << ':' << line
          << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  std::string s = stream_.str();
  std::fwrite(s.data(), 1, s.size(), stderr);
  if (severity_ == LogSeverity::kFatal) {
    std::fflush(stderr);
    std::abort();
  }
}

}  // namespace logging_internal
}  // namespace tandem
