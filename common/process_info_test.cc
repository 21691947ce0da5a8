// ProcessStartTime against processes this test starts: running (its start
// time, the same on every read, whatever its command name holds), exited
// but not reaped (a zombie: 0), reaped (0), and pids that never were.
#include "common/process_info.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace tandem {
namespace {

// A child that renames itself `name` and waits to be killed.
pid_t Child(const char* name) {
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_NAME, name);
    while (true) pause();
  }
  return pid;
}

// Waits until /proc shows `pid` under `name`, so the rename has happened.
void WaitForName(pid_t pid, const std::string& name) {
  for (int i = 0; i < 500; ++i) {
    FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/comm").c_str(), "r");
    char buf[64] = {};
    if (f != nullptr) {
      std::fgets(buf, sizeof(buf), f);
      std::fclose(f);
      if (std::string(buf) == name + "\n") return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ADD_FAILURE() << "pid " << pid << " never took the name " << name;
}

TEST(ProcessStartTimeTest, TellsARunningProcessFromAnExitedOne) {
  const std::optional<uint64_t> own = ProcessStartTime(getpid());
  ASSERT_TRUE(own.has_value());
  EXPECT_GT(*own, 0u);
  EXPECT_EQ(OwnStartTime(), *own);
  EXPECT_FALSE(PidNamespace().empty());
  EXPECT_EQ(HostBootId().size(), 36u) << HostBootId();  // a UUID

  // A command name with the separators the parser must not split on.
  const pid_t pid = Child("a) b (c) Z 1");
  ASSERT_GT(pid, 0);
  WaitForName(pid, "a) b (c) Z 1");
  const std::optional<uint64_t> start = ProcessStartTime(pid);
  ASSERT_TRUE(start.has_value());
  EXPECT_GE(*start, *own);                  // started after this process
  EXPECT_EQ(ProcessStartTime(pid), start);  // the same on every read
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  // Exited, not reaped yet: a zombie, 0.
  std::optional<uint64_t> zombie;
  for (int i = 0; i < 500; ++i) {
    zombie = ProcessStartTime(pid);
    if (zombie == std::optional<uint64_t>(0)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(zombie, std::optional<uint64_t>(0));
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_EQ(ProcessStartTime(pid), std::optional<uint64_t>(0));  // reaped
  EXPECT_EQ(ProcessStartTime(0), std::optional<uint64_t>(0));
  EXPECT_EQ(ProcessStartTime(-5), std::optional<uint64_t>(0));
  EXPECT_EQ(ProcessStartTime(int64_t{1} << 40), std::optional<uint64_t>(0));  // past pid_max
}

}  // namespace
}  // namespace tandem
