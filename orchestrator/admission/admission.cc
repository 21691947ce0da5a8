#include "orchestrator/admission/admission.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"
#include "common/thread_util.h"

namespace tandem::router {

Admission::Admission(Options options) : post_(std::move(options.post)), watch_period_(options.watch_period) {
  limits_ = options.limits;
  budget_ratio_ = options.retry_budget_ratio;
}

Admission::~Admission() { Stop(); }

void Admission::SetLimits(const LimitsConfig& limits, double retry_budget_ratio) {
  std::vector<std::shared_ptr<Admittable>> next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    limits_ = limits;
    budget_ratio_ = retry_budget_ratio;
    DrainQueueLocked(&next);
  }
  StartLater(std::move(next));
}

Admission::Decision Admission::Admit(const std::shared_ptr<Admittable>& call) {
  Decision d;
  std::vector<std::shared_ptr<Admittable>> next;
  const ApiKeyIdentity* key = call->key();
  const int64_t n = call->n();
  Entry entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      d.refusal = Refusal::kStopping;
      d.message = "the router is shutting down";
      return d;
    }
    if (n > limits_.max_in_flight) {
      d.refusal = Refusal::kNOverMaxInFlight;
      d.message = absl::StrFormat(
          "n = %d exceeds this server's limit of %d sequences in flight (limits.max_in_flight); ask "
          "for fewer choices",
          n, limits_.max_in_flight);
      return d;
    }
    if (key != nullptr) {
      const KeyLimiter::Decision k = limiter_.TryAcquire(key->name, key->limits, call->token_estimate(), Clock::now());
      if (k.refused != KeyLimit::kNone) {
        d.refusal = Refusal::kKeyLimit;
        d.key_limit = k.refused;
        d.retry_after_s = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(k.retry_after_s)));
        d.message = absl::StrFormat("rate limit reached for this API key (%s); retry in %d s", KeyLimitName(k.refused),
                                    d.retry_after_s);
        return d;
      }
      entry.key_held = true;
      entry.charged_tokens = k.charged_tokens;
    }
    // The retry budget: each request adds budget_ratio retries (capped).
    retry_tokens_ = std::min(retry_tokens_ + budget_ratio_, std::max(10.0, 100 * budget_ratio_));
    if (queue_.empty() && in_flight_ + n <= limits_.max_in_flight) {
      in_flight_ += n;
      ++running_requests_;
      entry.slot = true;
      d.started = true;
      active_.emplace(call, entry);
    } else if (static_cast<int64_t>(queue_.size()) < limits_.max_queue) {
      active_.emplace(call, entry);
      queue_.Push(key != nullptr ? key->name : std::string(), key != nullptr ? key->priority : 1, n, call);
      DrainQueueLocked(&next);
    } else {
      d.refusal = Refusal::kQueueFull;
      d.message =
          absl::StrFormat("the router is at its limits: %d sequences in flight and %d requests queued; retry later",
                          in_flight_, queue_.size());
    }
  }
  if (!d.admitted()) {
    // Refused for want of room: the key's place and its charge go back whole.
    if (entry.key_held) limiter_.Release(key->name, key->limits, entry.charged_tokens, 0, Clock::now());
    return d;
  }
  if (d.started) call->Start();
  StartLater(std::move(next));
  return d;
}

void Admission::DrainQueueLocked(std::vector<std::shared_ptr<Admittable>>* next) {
  // The next call in fair order waits for room for all its sequences; those
  // behind it wait too, so a large n is not starved by small ones.
  while (!queue_.empty() && in_flight_ + queue_.FrontCost() <= limits_.max_in_flight) {
    in_flight_ += queue_.FrontCost();
    ++running_requests_;
    next->push_back(queue_.Pop());
    active_[next->back()].slot = true;
  }
}

void Admission::StartLater(std::vector<std::shared_ptr<Admittable>> calls) {
  // Not inline: the caller may hold a generation's lock, and a start routes
  // (hashing, index lookups), which would hold up the thread it runs on.
  for (auto& c : calls) post_([c] { c->Start(); });
}

void Admission::ReleaseSlot(const std::shared_ptr<Admittable>& call) {
  std::vector<std::shared_ptr<Admittable>> next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = active_.find(call);
    if (it == active_.end() || !it->second.slot) return;
    it->second.slot = false;
    in_flight_ -= call->n();
    --running_requests_;
    DrainQueueLocked(&next);
  }
  StartLater(std::move(next));
}

void Admission::ReleaseKey(const std::shared_ptr<Admittable>& call, int64_t tokens_used) {
  int64_t charged = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = active_.find(call);
    if (it == active_.end() || !it->second.key_held) return;
    it->second.key_held = false;
    charged = it->second.charged_tokens;
  }
  const ApiKeyIdentity* key = call->key();
  if (key == nullptr) return;
  limiter_.Release(key->name, key->limits, charged, tokens_used, Clock::now());
}

void Admission::Dequeue(const std::shared_ptr<Admittable>& call) {
  bool forget = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.Remove(call);
    // A call already given a slot still runs Start, which finds it finished
    // and ends it through Finished.
    auto it = active_.find(call);
    forget = it != active_.end() && !it->second.slot;
  }
  if (forget) Finished(call);
}

void Admission::Finished(const std::shared_ptr<Admittable>& call) {
  ReleaseSlot(call);
  ReleaseKey(call, call->TokensUsed());
  std::lock_guard<std::mutex> lock(mu_);
  queue_.Remove(call);
  if (active_.erase(call) > 0 && active_.empty()) idle_cv_.notify_all();
}

bool Admission::TakeRetry() {
  std::lock_guard<std::mutex> lock(mu_);
  if (retry_tokens_ < 1) return false;
  retry_tokens_ -= 1;
  return true;
}

void Admission::StartWatchdog(std::function<void()> before_watch) {
  watchdog_ = std::thread([this, before_watch = std::move(before_watch)] {
    SetThreadName("watchdog");
    WatchdogLoop(before_watch);
  });
}

void Admission::WatchdogLoop(const std::function<void()>& before_watch) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!watchdog_stopping_) {
    stop_cv_.wait_for(lock, watch_period_, [&] { return watchdog_stopping_; });
    std::vector<std::shared_ptr<Admittable>> calls;
    calls.reserve(active_.size());
    for (const auto& [call, entry] : active_) calls.push_back(call);
    lock.unlock();
    if (before_watch) before_watch();
    const Clock::time_point now = Clock::now();
    for (const auto& call : calls) call->Watch(now);
    calls.clear();
    lock.lock();
  }
}

void Admission::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  stopping_ = true;
}

void Admission::Stop(std::chrono::milliseconds grace) {
  std::call_once(stopped_, [&] {
    Close();
    std::vector<std::shared_ptr<Admittable>> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [call, entry] : active_) calls.push_back(call);
    }
    for (const auto& call : calls) call->Cancel(absl::UnavailableError("the router is shutting down"));
    calls.clear();
    {
      std::unique_lock<std::mutex> lock(mu_);
      idle_cv_.wait_for(lock, grace, [&] { return active_.empty(); });
      watchdog_stopping_ = true;
    }
    stop_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  });
}

Admission::Stats Admission::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {.running_requests = running_requests_,
          .in_flight_sequences = in_flight_,
          .queued = static_cast<int64_t>(queue_.size())};
}

size_t Admission::active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return active_.size();
}

}  // namespace tandem::router
