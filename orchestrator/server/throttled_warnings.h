// ThrottledWarnings: one WARNING per kind per 10 s, saying how many were not
// logged, so that a flood of bad keys or refused requests does not flood the
// log.
//
// Thread safety: Warn may be called from any thread.
#ifndef TANDEM_ORCHESTRATOR_SERVER_THROTTLED_WARNINGS_H_
#define TANDEM_ORCHESTRATOR_SERVER_THROTTLED_WARNINGS_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace tandem::router {

class ThrottledWarnings {
 public:
  void Warn(const std::string& kind, const std::string& text) {
    const Clock::time_point now = Clock::now();
    int64_t suppressed = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Entry& e = entries_[kind];
      if (e.logged && now - e.last < std::chrono::seconds(10)) {
        ++e.suppressed;
        return;
      }
      suppressed = e.suppressed;
      e = Entry{true, now, 0};
    }
    LOG(WARNING) << text
                 << (suppressed > 0 ? absl::StrFormat(" (and %d more like it not logged)", suppressed) : std::string());
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    bool logged = false;
    Clock::time_point last;
    int64_t suppressed = 0;
  };
  std::mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_THROTTLED_WARNINGS_H_
