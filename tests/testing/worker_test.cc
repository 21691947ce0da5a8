#include "tests/testing/worker_test.h"

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>

#include "absl/strings/str_join.h"

namespace tandem::testing {

WorkerProcess* WorkerTest::StartWorker(std::vector<std::string> flags, const LaunchOptions& launch) {
  if (std::find(flags.begin(), flags.end(), "--model") == flags.end()) {
    flags.insert(flags.begin(), {"--model", "builtin:tiny"});
  }
  absl::StatusOr<std::unique_ptr<WorkerProcess>> w = WorkerProcess::Start(flags, std::chrono::seconds(30), launch);
  if (!w.ok()) {
    ADD_FAILURE() << "cannot start a worker with " << absl::StrJoin(flags, " ") << ": " << w.status();
    return nullptr;
  }
  workers_.push_back(std::move(*w));
  return workers_.back().get();
}

void WorkerTest::Kill(WorkerProcess* w) {
  killed_.insert(w);
  ::kill(w->pid(), SIGKILL);
}

void WorkerTest::TearDown() {
  for (const std::unique_ptr<WorkerProcess>& w : workers_) {
    const int status = w->Stop();
    if (killed_.count(w.get()) > 0) continue;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "worker " << w->address() << " did not exit cleanly (wait status " << status << "): see its log above";
  }
  workers_.clear();
}

}  // namespace tandem::testing
