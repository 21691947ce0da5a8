// Tests for GrpcPoller's RunAfterThisCompletion, driven by gRPC alarms on a
// poller's own completion queue.
#include "common/grpc_poller.h"

#include <grpcpp/alarm.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

// A tag that runs a function when its alarm fires.
class FnTag final : public GrpcTag {
 public:
  explicit FnTag(std::function<void()> fn) : fn_(std::move(fn)) {}
  void Done(bool /*ok*/) override { fn_(); }

 private:
  std::function<void()> fn_;
};

void FireNow(grpc::Alarm& alarm, GrpcPoller& poller, GrpcTag* tag) {
  alarm.Set(poller.cq(), std::chrono::system_clock::now(), tag);
}

TEST(GrpcPollerTest, TasksRunOnThePollerAfterTheCompletionInOrder) {
  GrpcPoller poller;
  std::mutex held_by_done;
  std::vector<std::string> log;  // written on the poller thread only
  std::thread::id poller_thread;
  absl::Notification finished;
  FnTag tag([&] {
    std::lock_guard<std::mutex> lock(held_by_done);
    poller_thread = std::this_thread::get_id();
    std::function<void()> first = [&] {
      // Done has returned: its lock is free.
      const bool unlocked = held_by_done.try_lock();
      if (unlocked) held_by_done.unlock();
      log.push_back(unlocked ? "first, unlocked" : "first, under Done's lock");
      std::function<void()> third = [&] {
        log.push_back("third");
        finished.Notify();
      };
      EXPECT_TRUE(GrpcPoller::RunAfterThisCompletion(third));  // queued by a task
    };
    std::function<void()> second = [&] {
      log.push_back(std::this_thread::get_id() == poller_thread ? "second, poller" : "second, elsewhere");
    };
    EXPECT_TRUE(GrpcPoller::RunAfterThisCompletion(first));
    EXPECT_TRUE(GrpcPoller::RunAfterThisCompletion(second));
    EXPECT_FALSE(first);  // taken
    log.push_back("done");
  });
  grpc::Alarm alarm;
  FireNow(alarm, poller, &tag);
  ASSERT_TRUE(finished.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(log, (std::vector<std::string>{"done", "first, unlocked", "second, poller", "third"}));
}

TEST(GrpcPollerTest, OffThePollerThreadTheTaskIsLeftToTheCaller) {
  GrpcPoller poller;
  bool ran = false;
  std::function<void()> task = [&] { ran = true; };
  EXPECT_FALSE(GrpcPoller::RunAfterThisCompletion(task));
  ASSERT_TRUE(task);
  task();
  EXPECT_TRUE(ran);
}

}  // namespace
}  // namespace tandem
