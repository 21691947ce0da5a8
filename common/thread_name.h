// SetThreadName: names the calling thread, so that top -H, perf and
// /proc/PID/task/*/comm tell a process's threads apart. Linux keeps the
// first 15 characters.
#ifndef TANDEM_COMMON_THREAD_NAME_H_
#define TANDEM_COMMON_THREAD_NAME_H_

#include <pthread.h>

#include <string>

namespace tandem {

inline void SetThreadName(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace tandem

#endif  // TANDEM_COMMON_THREAD_NAME_H_
