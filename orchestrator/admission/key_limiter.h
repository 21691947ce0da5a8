// KeyLimiter: the per-API-key limits of the router's admission: requests per
// second, tokens per minute and requests admitted at once (KeyLimitsConfig).
// A request is checked against all three before anything is taken, so a
// refused request costs its key nothing; the refusal says which limit
// refused and how long until it would admit the request (Retry-After).
//
// Requests per second is a token bucket refilled at that rate, holding one
// second's worth (at least one request): a burst of up to that many, then
// the rate. Tokens per minute is a bucket of tokens_per_min tokens refilled
// over a minute; a request is charged an estimate when admitted, capped at
// a full bucket so that any request can eventually run, and Release settles
// the charge to what it really used (the bucket may go below zero, which
// then refuses until it refills). The caller decides what a request costs
// (the router: prompt + n x max_tokens; see router_config.h).
//
// State is kept per key name, across limit changes (a reload): a bucket
// keeps its level, clamped to its new size.
//
// Thread safety: all methods are thread-safe (one mutex).
#ifndef TANDEM_ORCHESTRATOR_ADMISSION_KEY_LIMITER_H_
#define TANDEM_ORCHESTRATOR_ADMISSION_KEY_LIMITER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "orchestrator/config/router_config.h"

namespace tandem::router {

enum class KeyLimit { kNone, kRequestsPerSecond, kTokensPerMinute, kConcurrent };

// A metrics label: "requests_per_s", "tokens_per_min", "max_concurrent".
std::string_view KeyLimitName(KeyLimit limit);

class KeyLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  struct Decision {
    KeyLimit refused = KeyLimit::kNone;  // kNone: admitted
    // Refused: seconds until the limit would admit this request (for
    // max_concurrent, unknown: 1).
    double retry_after_s = 0;
    // Admitted: the tokens charged (pass them to Release).
    int64_t charged_tokens = 0;
  };

  // Admits one request of `key` that is estimated to use `tokens` tokens,
  // or says which limit refuses it.
  Decision TryAcquire(const std::string& key, const KeyLimitsConfig& limits, int64_t tokens, Clock::time_point now);

  // An admitted request ended: its concurrency slot frees and its charge
  // becomes `used_tokens` (what it did not use returns to the bucket).
  void Release(const std::string& key, const KeyLimitsConfig& limits, int64_t charged_tokens, int64_t used_tokens,
               Clock::time_point now);

  // Requests of `key` admitted and not yet released.
  int64_t concurrent(const std::string& key) const;

 private:
  struct Bucket {
    double level = 0;
    Clock::time_point updated;
    bool initialized = false;
    // Refills up to `capacity` at `rate` per second since the last update.
    void Refill(double capacity, double rate, Clock::time_point now);
  };
  struct State {
    Bucket requests;
    Bucket tokens;
    int64_t concurrent = 0;
  };

  mutable std::mutex mu_;
  std::map<std::string, State, std::less<>> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ADMISSION_KEY_LIMITER_H_
