// Per-thread helpers.
//   SetThreadName: names the calling thread, so that top -H, perf and
//     /proc/PID/task/*/comm tell a process's threads apart. Linux keeps the
//     first 15 characters.
//   ThreadCpuSeconds: the calling thread's CPU time so far (user + system),
//     for costs that must not count the time the thread was preempted.
#ifndef TANDEM_COMMON_THREAD_UTIL_H_
#define TANDEM_COMMON_THREAD_UTIL_H_

#include <pthread.h>
#include <time.h>

#include <string>

namespace tandem {

inline void SetThreadName(const std::string& name) { pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

inline double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace tandem

#endif  // TANDEM_COMMON_THREAD_UTIL_H_
