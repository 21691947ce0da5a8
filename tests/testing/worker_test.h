// WorkerTest: a gtest fixture for tests that start `tandem worker`
// processes. It owns them, stops them at the end, and fails the test if one
// did not exit cleanly (status 0): a crash, an abort or a sanitizer report
// in a worker is a failure even when every response looked right. Workers a
// test kills on purpose are exempt (Kill).
#ifndef TANDEM_TESTS_TESTING_WORKER_TEST_H_
#define TANDEM_TESTS_TESTING_WORKER_TEST_H_

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "tests/testing/worker_process.h"

namespace tandem::testing {

class WorkerTest : public ::testing::Test {
 protected:
  // Starts a worker with `flags` (builtin:tiny unless they name --model);
  // null, and a test failure, if it does not come up.
  WorkerProcess* StartWorker(std::vector<std::string> flags = {}, const LaunchOptions& launch = {});
  // SIGKILLs `w` now; its exit status is not checked.
  void Kill(WorkerProcess* w);
  void TearDown() override;

 private:
  std::vector<std::unique_ptr<WorkerProcess>> workers_;
  std::set<WorkerProcess*> killed_;
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_WORKER_TEST_H_
