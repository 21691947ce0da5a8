// SerialExecutor: one thread that runs posted tasks in order. For work that
// must leave a latency-critical thread (the engine thread, a transport's
// progress thread, gRPC's callback threads) without blocking it: hashing KV
// blocks, starting RPCs.
//
// The destructor runs the tasks already posted, then joins. Thread-safe.
#ifndef TANDEM_COMMON_SERIAL_EXECUTOR_H_
#define TANDEM_COMMON_SERIAL_EXECUTOR_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "common/thread_util.h"

namespace tandem {

class SerialExecutor {
 public:
  // `name` names its thread (thread_util.h).
  explicit SerialExecutor(std::string name = "executor")
      : thread_([this, name = std::move(name)] {
          SetThreadName(name);
          Run();
        }) {}
  ~SerialExecutor() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after the rest is built
};

}  // namespace tandem

#endif  // TANDEM_COMMON_SERIAL_EXECUTOR_H_
