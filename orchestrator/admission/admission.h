// Admission: which requests run on the workers now, which wait, and which
// are refused. It owns the router's admission slots (limits.max_in_flight
// sequences: a request with n choices takes n), the queue shared fairly
// between API keys (FairQueue, with each key's priority as its weight), the
// per-key limits (KeyLimiter), the retry budget, the set of requests in
// progress and the watchdog thread that checks their deadlines. It knows
// requests only as Admittable, so it is tested without gRPC or HTTP
// (admission_test.cc); the router's ApiCall is the one implementation.
//
// A request's life: Admit (refused; started at once; or queued, started when
// a slot frees) -> ReleaseSlot when its generations end (the next queued
// ones start) -> Finished when it is answered (its key's charge settles).
// A queued request that is cancelled leaves through Dequeue.
//
// Thread safety: every method may be called from any thread. Admittable's
// Start and Cancel are never called with admission's lock held; Start of a
// request taken from the queue runs through `post` (the router's task
// thread), since the caller of ReleaseSlot may hold a generation's lock.
#ifndef TANDEM_ORCHESTRATOR_ADMISSION_ADMISSION_H_
#define TANDEM_ORCHESTRATOR_ADMISSION_ADMISSION_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "orchestrator/admission/api_keys.h"
#include "orchestrator/admission/fair_queue.h"
#include "orchestrator/admission/key_limiter.h"
#include "orchestrator/config/router_config.h"

namespace tandem::router {

// A request as admission sees it.
class Admittable {
 public:
  virtual ~Admittable() = default;
  // Sequences it runs on the workers (its n): its share of max_in_flight.
  virtual int n() const = 0;
  // Its caller's API key; null when the router has no keys.
  virtual const ApiKeyIdentity* key() const = 0;
  // Tokens it may use (prompt + n x max_tokens): its key's tokens_per_min
  // charge at admission.
  virtual int64_t token_estimate() const = 0;
  // Tokens it used (prompt + generated): its key's charge settles to this.
  virtual int64_t TokensUsed() = 0;
  // It holds a slot: run it.
  virtual void Start() = 0;
  // End it with `why` (the router is stopping).
  virtual void Cancel(const absl::Status& why) = 0;
  // The watchdog's periodic look (every Options::watch_period).
  virtual void Watch(std::chrono::steady_clock::time_point now) = 0;
};

class Admission {
 public:
  using Clock = std::chrono::steady_clock;

  // Why Admit refused a request.
  enum class Refusal {
    kNone,
    kStopping,          // 503: the router is shutting down
    kNOverMaxInFlight,  // 400 (param n): it could never start
    kKeyLimit,          // 429 with Retry-After: a limit of its key
    kQueueFull,         // 429: limits.max_queue requests wait already
  };

  struct Decision {
    Refusal refusal = Refusal::kNone;
    std::string message;                   // refused: what the client is told
    KeyLimit key_limit = KeyLimit::kNone;  // kKeyLimit: which
    int64_t retry_after_s = 0;             // kKeyLimit: the Retry-After header
    bool started = false;                  // admitted and started (false: queued, or refused)
    bool admitted() const { return refusal == Refusal::kNone; }
  };

  struct Stats {
    int64_t running_requests = 0;
    int64_t in_flight_sequences = 0;  // against max_in_flight
    int64_t queued = 0;
  };

  struct Options {
    LimitsConfig limits;
    double retry_budget_ratio = 0.2;  // retries.budget_ratio
    // Runs a task later on another thread, not under the caller's locks.
    std::function<void(std::function<void()>)> post;
    std::chrono::milliseconds watch_period{100};
  };

  explicit Admission(Options options);
  ~Admission();  // Stop()s

  // New limits (a reload); queued requests that now fit start.
  void SetLimits(const LimitsConfig& limits, double retry_budget_ratio);

  // Admits `call`: refused (the decision says why: the caller answers the
  // client), started (Start was called before this returns), or queued.
  Decision Admit(const std::shared_ptr<Admittable>& call);
  // The call's generations ended: its slot frees and queued calls that fit
  // start. Idempotent.
  void ReleaseSlot(const std::shared_ptr<Admittable>& call);
  // The call's generations ended having used `tokens_used`: what it took
  // from its key's limits (a concurrent place, the token charge beyond use)
  // goes back now, before the client sees the end, so the key's next request
  // never finds this one still counted. Idempotent; Finished does it (with
  // the call's TokensUsed) for a call that did not.
  void ReleaseKey(const std::shared_ptr<Admittable>& call, int64_t tokens_used);
  // A queued call was cancelled: it leaves the queue (a call already given a
  // slot still gets Start, and ends through Finished). Idempotent.
  void Dequeue(const std::shared_ptr<Admittable>& call);
  // The call is answered: its slot and its key's charge are released and it
  // is forgotten. Idempotent.
  void Finished(const std::shared_ptr<Admittable>& call);

  // Takes one retry from the budget (each admitted request adds
  // retry_budget_ratio, capped); false when it is spent.
  bool TakeRetry();

  // Starts the watchdog: every watch_period, `before_watch` runs once and
  // then Watch on each call in progress (off admission's lock).
  void StartWatchdog(std::function<void()> before_watch);
  // Refuses new calls from now on (503); those in progress go on, still
  // watched (their deadlines, their waits for a worker) until Stop.
  void Close();
  // Close()s, cancels the calls in progress and waits up to `grace` for
  // them to be answered; joins the watchdog. Idempotent.
  void Stop(std::chrono::milliseconds grace = std::chrono::seconds(10));

  Stats stats() const;
  // Calls admitted and not yet Finished (queued or running).
  size_t active() const;

 private:
  struct Entry {
    bool slot = false;      // holds n of in_flight_
    bool key_held = false;  // holds a place in its key's limits
    int64_t charged_tokens = 0;
  };

  // Pops queued calls while the next one's sequences fit; they get slots.
  void DrainQueueLocked(std::vector<std::shared_ptr<Admittable>>* next) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartLater(std::vector<std::shared_ptr<Admittable>> calls);
  void WatchdogLoop(const std::function<void()>& before_watch);

  const std::function<void(std::function<void()>)> post_;
  const std::chrono::milliseconds watch_period_;
  KeyLimiter limiter_;

  mutable std::mutex mu_;
  LimitsConfig limits_ ABSL_GUARDED_BY(mu_);
  double budget_ratio_ ABSL_GUARDED_BY(mu_) = 0.2;
  double retry_tokens_ ABSL_GUARDED_BY(mu_) = 10;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // sequences
  int64_t running_requests_ ABSL_GUARDED_BY(mu_) = 0;
  FairQueue<std::shared_ptr<Admittable>> queue_ ABSL_GUARDED_BY(mu_);
  std::map<std::shared_ptr<Admittable>, Entry> active_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;           // closed to new calls
  bool watchdog_stopping_ ABSL_GUARDED_BY(mu_) = false;  // Stop: the watchdog ends
  std::condition_variable idle_cv_;                      // active_ emptied: Stop waits for it
  std::condition_variable stop_cv_;                      // watchdog_stopping_ set: wakes the watchdog
                                                         // (apart, so finishing calls do not wake it)
  std::thread watchdog_;
  std::once_flag stopped_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ADMISSION_ADMISSION_H_
