// LatencyWindow: the last N latency samples of one kind (an attempt's time
// to its first token, the gap between two token messages of a stream), and
// the deadline they suggest. The router's per-attempt deadlines
// (retries.attempt_first_token_s / attempt_idle_s: auto) are a multiple of
// the window's p99 with a floor, so they follow the pool's own latency: a
// cluster serving long prompts gets longer first-token deadlines than one
// serving chat turns, and a worker that is merely slow is not mistaken for a
// frozen one.
//
// Thread safety: all methods are thread-safe (one mutex; Record is a store
// into a ring, Quantile copies and partially sorts at most `capacity`
// samples: the watchdog calls it once per 100 ms tick).
#ifndef TANDEM_ORCHESTRATOR_SERVER_LATENCY_WINDOW_H_
#define TANDEM_ORCHESTRATOR_SERVER_LATENCY_WINDOW_H_

#include <cstddef>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "orchestrator/config/router_config.h"

namespace tandem::router {

class LatencyWindow {
 public:
  // REQUIRES: capacity >= 1.
  explicit LatencyWindow(size_t capacity = 1000);

  void Record(double seconds);
  // Samples recorded so far (not capped by the capacity).
  size_t count() const;
  // The q-quantile (q in [0, 1]) of the samples held; nullopt when fewer
  // than `min_samples` were ever recorded.
  std::optional<double> Quantile(double q, size_t min_samples = 1) const;

 private:
  const size_t capacity_;
  mutable std::mutex mu_;
  std::vector<double> samples_ ABSL_GUARDED_BY(mu_);  // a ring once full
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  size_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Samples an `auto` deadline needs before it applies.
inline constexpr size_t kAutoDeadlineMinSamples = 20;

// The deadline `config` sets, in seconds, given the window of its latency;
// 0 means off (a fixed 0, or `auto` before kAutoDeadlineMinSamples samples).
double AttemptDeadlineSeconds(const AttemptDeadlineConfig& config, const RetriesConfig& retries,
                              const LatencyWindow& window);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_LATENCY_WINDOW_H_
