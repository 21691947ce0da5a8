#include "orchestrator/server/latency_window.h"

#include <algorithm>
#include <cmath>

namespace tandem::router {

LatencyWindow::LatencyWindow(size_t capacity) : capacity_(std::max<size_t>(1, capacity)) {}

void LatencyWindow::Record(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  if (samples_.size() < capacity_) {
    samples_.push_back(seconds);
  } else {
    samples_[next_] = seconds;
  }
  next_ = (next_ + 1) % capacity_;
  ++count_;
}

size_t LatencyWindow::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

std::optional<double> LatencyWindow::Quantile(double q, size_t min_samples) const {
  std::vector<double> copy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (samples_.empty() || count_ < min_samples) return std::nullopt;
    copy = samples_;
  }
  q = std::clamp(q, 0.0, 1.0);
  // The nearest-rank quantile: the smallest sample with at least q of the
  // samples at or below it.
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(copy.size())));
  const size_t k = rank == 0 ? 0 : rank - 1;
  std::nth_element(copy.begin(), copy.begin() + static_cast<std::ptrdiff_t>(k), copy.end());
  return copy[k];
}

double AttemptDeadlineSeconds(const AttemptDeadlineConfig& config, const RetriesConfig& retries,
                              const LatencyWindow& window) {
  if (!config.automatic) return config.seconds;
  const std::optional<double> p99 = window.Quantile(0.99, kAutoDeadlineMinSamples);
  if (!p99.has_value()) return 0;
  return std::max(retries.auto_floor_s, retries.auto_multiplier * *p99);
}

}  // namespace tandem::router
