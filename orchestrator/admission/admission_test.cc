#include "orchestrator/admission/admission.h"

#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tandem::router {
namespace {

// A request that records what admission did to it. Cancelled, it is
// answered at once (tells admission it finished), as the router's are.
class FakeCall : public Admittable, public std::enable_shared_from_this<FakeCall> {
 public:
  explicit FakeCall(int n, const ApiKeyIdentity* key = nullptr, int64_t tokens = 0)
      : n_(n), key_(key), tokens_(tokens) {}
  int n() const override { return n_; }
  const ApiKeyIdentity* key() const override { return key_; }
  int64_t token_estimate() const override { return tokens_; }
  int64_t TokensUsed() override { return used; }
  void Start() override { ++starts; }
  void Cancel(const absl::Status& why) override {
    cancelled = why;
    if (admission != nullptr) admission->Finished(shared_from_this());
  }
  void Watch(std::chrono::steady_clock::time_point) override { ++watched; }

  int starts = 0;
  absl::Status cancelled;
  std::atomic<int> watched{0};
  int64_t used = 0;
  Admission* admission = nullptr;

 private:
  const int n_;
  const ApiKeyIdentity* const key_;
  const int64_t tokens_;
};

// A call of admission `a`.
template <typename... Args>
std::shared_ptr<FakeCall> Make(Admission& a, Args&&... args) {
  auto call = std::make_shared<FakeCall>(std::forward<Args>(args)...);
  call->admission = &a;
  return call;
}

// Posted tasks run when the test says.
struct Tasks {
  std::deque<std::function<void()>> pending;
  void RunAll() {
    while (!pending.empty()) {
      auto task = std::move(pending.front());
      pending.pop_front();
      task();
    }
  }
};

Admission::Options Limits(Tasks& tasks, int64_t max_in_flight, int64_t max_queue) {
  Admission::Options o;
  o.limits.max_in_flight = max_in_flight;
  o.limits.max_queue = max_queue;
  o.post = [&tasks](std::function<void()> task) { tasks.pending.push_back(std::move(task)); };
  return o;
}

TEST(AdmissionTest, StartsWithinTheSlotsAndQueuesBeyond) {
  Tasks tasks;
  Admission a(Limits(tasks, 4, 8));
  auto c1 = Make(a, 3);
  auto c2 = Make(a, 2);
  Admission::Decision d1 = a.Admit(c1);
  EXPECT_TRUE(d1.admitted());
  EXPECT_TRUE(d1.started);
  EXPECT_EQ(c1->starts, 1);
  // 3 + 2 sequences exceed 4: c2 waits.
  Admission::Decision d2 = a.Admit(c2);
  EXPECT_TRUE(d2.admitted());
  EXPECT_FALSE(d2.started);
  EXPECT_EQ(a.stats().queued, 1);
  EXPECT_EQ(a.stats().in_flight_sequences, 3);
  // c1's generations end: c2 gets its slot, started through `post`.
  a.ReleaseSlot(c1);
  EXPECT_EQ(c2->starts, 0);
  tasks.RunAll();
  EXPECT_EQ(c2->starts, 1);
  EXPECT_EQ(a.stats().in_flight_sequences, 2);
  EXPECT_EQ(a.stats().running_requests, 1);
  a.ReleaseSlot(c1);  // idempotent
  EXPECT_EQ(a.stats().in_flight_sequences, 2);
  a.Finished(c1);
  a.Finished(c2);
  EXPECT_EQ(a.active(), 0u);
  EXPECT_EQ(a.stats().in_flight_sequences, 0);
}

TEST(AdmissionTest, RefusesWhatCouldNeverStartAndAFullQueue) {
  Tasks tasks;
  Admission a(Limits(tasks, 4, 1));
  Admission::Decision big = a.Admit(Make(a, 5));
  EXPECT_EQ(big.refusal, Admission::Refusal::kNOverMaxInFlight);
  EXPECT_NE(big.message.find("n = 5 exceeds"), std::string::npos) << big.message;
  EXPECT_TRUE(a.Admit(Make(a, 4)).started);
  EXPECT_TRUE(a.Admit(Make(a, 1)).admitted());  // queued
  Admission::Decision full = a.Admit(Make(a, 1));
  EXPECT_EQ(full.refusal, Admission::Refusal::kQueueFull);
  EXPECT_NE(full.message.find("4 sequences in flight and 1 requests queued"), std::string::npos) << full.message;
  EXPECT_EQ(a.active(), 2u);  // refused calls are not kept
}

TEST(AdmissionTest, ALargeNIsNotStarvedBySmallOnesBehindIt) {
  Tasks tasks;
  Admission a(Limits(tasks, 4, 8));
  auto running = Make(a, 2);
  auto large = Make(a, 4);
  auto small = Make(a, 1);
  a.Admit(running);
  a.Admit(large);  // needs all 4: waits
  a.Admit(small);  // would fit, but waits behind `large`
  tasks.RunAll();
  EXPECT_EQ(large->starts, 0);
  EXPECT_EQ(small->starts, 0);
  a.ReleaseSlot(running);
  tasks.RunAll();
  EXPECT_EQ(large->starts, 1);
  EXPECT_EQ(small->starts, 0);
  a.ReleaseSlot(large);
  tasks.RunAll();
  EXPECT_EQ(small->starts, 1);
}

TEST(AdmissionTest, KeysShareTheQueueFairly) {
  Tasks tasks;
  ApiKeyIdentity flood{.name = "flood"}, other{.name = "other"};  // outlive `a`
  Admission a(Limits(tasks, 1, 100));
  auto running = Make(a, 1, &flood);
  a.Admit(running);
  std::vector<std::shared_ptr<FakeCall>> floods;
  for (int i = 0; i < 10; ++i) {
    floods.push_back(Make(a, 1, &flood));
    a.Admit(floods.back());
  }
  auto late = Make(a, 1, &other);
  a.Admit(late);
  // One slot: the other key's request runs second, not after the flood.
  a.ReleaseSlot(running);
  tasks.RunAll();
  EXPECT_EQ(floods[0]->starts, 1);
  a.ReleaseSlot(floods[0]);
  tasks.RunAll();
  EXPECT_EQ(late->starts, 1);
  EXPECT_EQ(floods[1]->starts, 0);
}

TEST(AdmissionTest, AKeyLimitRefusesWithRetryAfterAndReleasesOnFinish) {
  Tasks tasks;
  ApiKeyIdentity key{.name = "k", .limits = {.max_concurrent = 1}};
  Admission a(Limits(tasks, 16, 16));
  auto first = Make(a, 1, &key);
  EXPECT_TRUE(a.Admit(first).started);
  Admission::Decision d = a.Admit(Make(a, 1, &key));
  EXPECT_EQ(d.refusal, Admission::Refusal::kKeyLimit);
  EXPECT_EQ(d.key_limit, KeyLimit::kConcurrent);
  EXPECT_GE(d.retry_after_s, 1);
  EXPECT_NE(d.message.find("rate limit reached for this API key (max_concurrent)"), std::string::npos) << d.message;
  a.Finished(first);
  EXPECT_TRUE(a.Admit(Make(a, 1, &key)).started);
}

TEST(AdmissionTest, AQueueFullRefusalReturnsTheKeysCharge) {
  Tasks tasks;
  // A bucket of 100 tokens a minute; each request is estimated at 60.
  ApiKeyIdentity key{.name = "k", .limits = {.tokens_per_min = 100}};
  Admission a(Limits(tasks, 1, 0));
  auto running = Make(a, 1, &key, 60);
  EXPECT_TRUE(a.Admit(running).started);
  // No slot and no queue: refused for room, so its 60 tokens are not spent...
  EXPECT_EQ(a.Admit(Make(a, 1, &key, 30)).refusal, Admission::Refusal::kQueueFull);
  // ...and the 40 left still admit a request of 40 once the slot frees.
  running->used = 60;
  a.Finished(running);
  EXPECT_TRUE(a.Admit(Make(a, 1, &key, 40)).started);
}

TEST(AdmissionTest, ACancelledQueuedCallLeavesTheQueue) {
  Tasks tasks;
  Admission a(Limits(tasks, 1, 4));
  auto running = Make(a, 1);
  auto queued = Make(a, 1);
  a.Admit(running);
  a.Admit(queued);
  a.Dequeue(queued);
  EXPECT_EQ(a.stats().queued, 0);
  EXPECT_EQ(a.active(), 1u);
  a.ReleaseSlot(running);
  tasks.RunAll();
  EXPECT_EQ(queued->starts, 0);
}

TEST(AdmissionTest, RetryBudgetGrowsWithRequests) {
  Tasks tasks;
  Admission::Options o = Limits(tasks, 1000, 0);
  o.retry_budget_ratio = 0.5;
  Admission a(o);
  // It starts with 10 retries.
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(a.TakeRetry());
  EXPECT_FALSE(a.TakeRetry());
  // Two requests add one.
  a.Admit(Make(a, 1));
  a.Admit(Make(a, 1));
  EXPECT_TRUE(a.TakeRetry());
  EXPECT_FALSE(a.TakeRetry());
}

TEST(AdmissionTest, NewLimitsStartWhatNowFits) {
  Tasks tasks;
  Admission a(Limits(tasks, 1, 4));
  auto running = Make(a, 1);
  auto queued = Make(a, 1);
  a.Admit(running);
  a.Admit(queued);
  LimitsConfig wider;
  wider.max_in_flight = 2;
  wider.max_queue = 4;
  a.SetLimits(wider, 0.2);
  tasks.RunAll();
  EXPECT_EQ(queued->starts, 1);
}

TEST(AdmissionTest, StopRefusesNewCallsAndCancelsRunningOnes) {
  Tasks tasks;
  Admission a(Limits(tasks, 4, 4));
  auto running = Make(a, 1);
  a.Admit(running);
  a.Close();
  Admission::Decision d = a.Admit(Make(a, 1));
  EXPECT_EQ(d.refusal, Admission::Refusal::kStopping);
  // Stop cancels it and waits for it to be answered.
  a.Stop();
  EXPECT_EQ(running->cancelled.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(a.active(), 0u);
}

TEST(AdmissionTest, TheWatchdogWatchesEveryCallInProgress) {
  Tasks tasks;
  Admission::Options o = Limits(tasks, 4, 4);
  o.watch_period = std::chrono::milliseconds(1);
  Admission a(o);
  auto c = Make(a, 1);
  a.Admit(c);
  std::atomic<int> ticks{0};
  a.StartWatchdog([&] { ++ticks; });
  while (c->watched < 3) std::this_thread::yield();
  // Closed to new calls, it still watches those in progress (until Stop).
  a.Close();
  const int before = c->watched;
  while (c->watched < before + 3) std::this_thread::yield();
  a.Finished(c);
  a.Stop();
  EXPECT_GE(ticks.load(), 6);
}

}  // namespace
}  // namespace tandem::router
