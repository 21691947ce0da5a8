// Minimal leveled logging to stderr: LOG(INFO) << "..."; and CHECK(cond).
// Debian 12's Abseil predates absl/log, so tandem keeps this small stand-in
// with the same spelling. Thread-safe: each message is written with one call.
// CHECK is for true invariants only; anything a peer, the network or a config
// can cause is an absl::Status instead.
#ifndef TANDEM_COMMON_LOGGING_H_
#define TANDEM_COMMON_LOGGING_H_

#include <sstream>

namespace tandem {

enum class LogSeverity { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

// Messages below this severity are dropped. Default: kInfo, or the value of
// the TANDEM_LOG_LEVEL environment variable (debug|info|warning|error).
LogSeverity MinLogSeverity();
void SetMinLogSeverity(LogSeverity severity);

namespace logging_internal {

class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  ~LogMessage();  // writes the line; aborts for kFatal
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};

// Swallows the stream when the severity is disabled.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace logging_internal
}  // namespace tandem

#define TANDEM_LOG_SEVERITY_DEBUG ::tandem::LogSeverity::kDebug
#define TANDEM_LOG_SEVERITY_INFO ::tandem::LogSeverity::kInfo
#define TANDEM_LOG_SEVERITY_WARNING ::tandem::LogSeverity::kWarning
#define TANDEM_LOG_SEVERITY_ERROR ::tandem::LogSeverity::kError
#define TANDEM_LOG_SEVERITY_FATAL ::tandem::LogSeverity::kFatal

#define LOG(severity)                                           \
  (TANDEM_LOG_SEVERITY_##severity < ::tandem::MinLogSeverity()) \
      ? (void)0                                                 \
      : ::tandem::logging_internal::Voidify() &                 \
            ::tandem::logging_internal::LogMessage(__FILE__, __LINE__, TANDEM_LOG_SEVERITY_##severity).stream()

#define CHECK(cond)                                                                                               \
  (cond) ? (void)0                                                                                                \
         : ::tandem::logging_internal::Voidify() &                                                                \
               ::tandem::logging_internal::LogMessage(__FILE__, __LINE__, ::tandem::LogSeverity::kFatal).stream() \
                   << "Check failed: " #cond " "

#endif  // TANDEM_COMMON_LOGGING_H_
