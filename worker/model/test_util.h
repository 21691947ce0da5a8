// Test-only helpers shared by the worker/model tests.
#ifndef TANDEM_WORKER_MODEL_TEST_UTIL_H_
#define TANDEM_WORKER_MODEL_TEST_UTIL_H_

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace tandem::worker {

// A fresh, empty directory under the test temp dir, removed with its contents
// when the object goes out of scope. The pid keeps parallel ctest runs apart.
class ScopedTempDir {
 public:
  explicit ScopedTempDir(const std::string& name) {
    std::string root = ::testing::TempDir();
    while (root.size() > 1 && root.back() == '/') root.pop_back();
    path_ = root + "/tandem_model_test_" + std::to_string(getpid()) + "/" + name;
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScopedTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    std::filesystem::remove(std::filesystem::path(path_).parent_path(), ec);  // if now empty
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_TEST_UTIL_H_
