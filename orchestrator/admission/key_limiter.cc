#include "orchestrator/admission/key_limiter.h"

#include <algorithm>

namespace tandem::router {

std::string_view KeyLimitName(KeyLimit limit) {
  switch (limit) {
    case KeyLimit::kRequestsPerSecond:
      return "requests_per_s";
    case KeyLimit::kTokensPerMinute:
      return "tokens_per_min";
    case KeyLimit::kConcurrent:
      return "max_concurrent";
    case KeyLimit::kNone:
      break;
  }
  return "none";
}

void KeyLimiter::Bucket::Refill(double capacity, double rate, Clock::time_point now) {
  if (!initialized) {
    // A key's first request finds its buckets full.
    level = capacity;
    updated = now;
    initialized = true;
    return;
  }
  if (now > updated) {
    level += rate * std::chrono::duration<double>(now - updated).count();
    updated = now;
  }
  level = std::min(level, capacity);
}

namespace {

// The requests bucket: one second's worth, at least one request.
double RequestCapacity(const KeyLimitsConfig& l) { return std::max(1.0, l.requests_per_s); }
double TokenRate(const KeyLimitsConfig& l) { return static_cast<double>(l.tokens_per_min) / 60.0; }

}  // namespace

KeyLimiter::Decision KeyLimiter::TryAcquire(const std::string& key, const KeyLimitsConfig& limits, int64_t tokens,
                                            Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  State& s = keys_[key];
  Decision d;
  if (limits.max_concurrent > 0 && s.concurrent >= limits.max_concurrent) {
    d.refused = KeyLimit::kConcurrent;
    d.retry_after_s = 1;
    return d;
  }
  if (limits.requests_per_s > 0) {
    s.requests.Refill(RequestCapacity(limits), limits.requests_per_s, now);
    if (s.requests.level < 1) {
      d.refused = KeyLimit::kRequestsPerSecond;
      d.retry_after_s = (1 - s.requests.level) / limits.requests_per_s;
      return d;
    }
  }
  int64_t charge = 0;
  if (limits.tokens_per_min > 0) {
    const double capacity = static_cast<double>(limits.tokens_per_min);
    s.tokens.Refill(capacity, TokenRate(limits), now);
    charge = std::clamp<int64_t>(tokens, 0, limits.tokens_per_min);
    if (s.tokens.level < static_cast<double>(charge)) {
      d.refused = KeyLimit::kTokensPerMinute;
      d.retry_after_s = (static_cast<double>(charge) - s.tokens.level) / TokenRate(limits);
      return d;
    }
    s.tokens.level -= static_cast<double>(charge);
  }
  if (limits.requests_per_s > 0) s.requests.level -= 1;
  ++s.concurrent;
  d.charged_tokens = charge;
  return d;
}

void KeyLimiter::Release(const std::string& key, const KeyLimitsConfig& limits, int64_t charged_tokens,
                         int64_t used_tokens, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = keys_.find(key);
  if (it == keys_.end()) return;
  State& s = it->second;
  s.concurrent = std::max<int64_t>(0, s.concurrent - 1);
  if (limits.tokens_per_min > 0 && s.tokens.initialized) {
    s.tokens.Refill(static_cast<double>(limits.tokens_per_min), TokenRate(limits), now);
    // Settled to the real use: a refund, or the excess taken.
    s.tokens.level += static_cast<double>(charged_tokens - std::max<int64_t>(0, used_tokens));
    s.tokens.level = std::min(s.tokens.level, static_cast<double>(limits.tokens_per_min));
  }
}

int64_t KeyLimiter::concurrent(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = keys_.find(key);
  return it == keys_.end() ? 0 : it->second.concurrent;
}

}  // namespace tandem::router
