// `tandem bench engine`: the decode-sampling flags (--temperature, --top-p,
// --top-k) refuse values outside their ranges with an error naming the flag,
// before any model loads. `tandem bench transfer`: an unknown backend names
// the flag; cuda_ipc without a GPU says so (its forked target reports it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/paged_attention.h"
#include "tests/testing/worker_process.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;

TEST(BenchEngineFlagsTest, BadSamplingFlagsNameTheFlag) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  const std::pair<std::string, std::string> cases[] = {
      {"--top-p 1.5", "--top-p"},
      {"--temperature -1", "--temperature"},
      {"--temperature 3", "--temperature"},
      {"--top-k -3", "--top-k"},
      {"--top-p x", "--top-p"},
      // GPU-only switches on the CPU bench are refused, not ignored.
      {"--device cpu --temperature 0.5", "--temperature"},
      {"--device cpu --host-sampling", "--host-sampling"},
      {"--device cpu --enforce-eager", "--enforce-eager"},
  };
  for (const auto& [flags, name] : cases) {
    std::string out;
    const int rc = RunCommand(absl::StrCat(*bin, " bench engine ", flags), &out);
    ASSERT_NE(rc, -1) << flags;
    EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << flags << ": " << out;
    EXPECT_THAT(out, HasSubstr(name)) << flags;
  }
}

// ucx_staged between two processes over shared memory and over tcp: the
// bench posts the receiver's half, pushes, checks a block, prints its rows.
TEST(BenchEngineFlagsTest, StagedTransferRunsBetweenTwoProcesses) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  for (const char* tls : {"shm", "tcp"}) {
    std::string out;
    const int rc = RunCommand(
        absl::StrCat(*bin, " bench transfer --backend ucx_staged --op push --tls ", tls, " --max-blocks 4 --repeats 1"),
        &out);
    if (out.find("built without UCX") != std::string::npos) GTEST_SKIP() << "this tandem has no UCX";
    ASSERT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("KV push ucx_staged/", tls, " (host pools)")));
    EXPECT_THAT(out, HasSubstr("\n      4       8 "));  // the 4-block row
  }
}

// nccl between two GPUs (skipped with fewer, or where libnccl.so.2 cannot
// be loaded: set TANDEM_NCCL): pairs through the offer, pushes, checks a
// block, prints its rows against cudaMemcpyPeer.
TEST(BenchEngineFlagsTest, NcclTransferRunsBetweenTwoGpus) {
  const char* why = nullptr;
  if (!kernels::cuda::Available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  if (kernels::cuda::DeviceCount() < 2) GTEST_SKIP() << "one GPU";
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  std::string out;
  const int rc =
      RunCommand(absl::StrCat(*bin, " bench transfer --backend nccl --op push --max-blocks 8 --repeats 2"), &out);
  if (out.find("cannot load NCCL") != std::string::npos) GTEST_SKIP() << out;
  ASSERT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << out;
  EXPECT_THAT(out, HasSubstr("KV push nccl (GPU 0 -> GPU 1)"));
  EXPECT_THAT(out, HasSubstr("cudaMemcpyPeer"));
  EXPECT_THAT(out, HasSubstr("\n      8      16 "));  // the 8-block row
}

TEST(BenchEngineFlagsTest, TransferBackendsThatCannotRunSayWhy) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  std::string out;
  int rc = RunCommand(absl::StrCat(*bin, " bench transfer --backend nccl"), &out);
  EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << out;
  EXPECT_THAT(out, HasSubstr("--backend nccl"));
  rc = RunCommand(absl::StrCat(*bin, " bench transfer --backend loopback --target-device 1"), &out);
  EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << out;
  EXPECT_THAT(out, HasSubstr("--target-device is for --backend cuda_ipc or nccl"));
  rc = RunCommand(absl::StrCat(*bin, " bench transfer --backend nccl --op push --target-device 0"), &out);
  EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << out;
  EXPECT_THAT(out, HasSubstr("--backend nccl joins two GPUs: --target-device must not be 0"));
  rc = RunCommand(absl::StrCat(*bin, " bench transfer --backend nccl --op push --pool mmap"), &out);
  EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << out;
  EXPECT_THAT(out, HasSubstr("--pool mmap: want cuda (nccl moves GPU pools)"));
  rc = RunCommand(absl::StrCat(*bin, " bench transfer --backend cuda_ipc --target-device -2"), &out);
  EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << out;
  EXPECT_THAT(out, HasSubstr("--target-device must be >= 0"));
  rc = RunCommand(absl::StrCat(*bin, " bench transfer --backend ucx_staged --op pull"), &out);
  EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << out;
  EXPECT_THAT(out, HasSubstr("--backend ucx_staged only pushes"));
  rc = RunCommand(absl::StrCat(*bin, " bench transfer --backend ucx_staged --op push --pool ucx"), &out);
  EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << out;
  EXPECT_THAT(out, HasSubstr("--pool ucx: want mmap or cuda"));
  const char* why = nullptr;
  if (kernels::cuda::Available(&why)) return;  // a GPU runs it (scripts/gpu_engine_checks.sh)
  rc = RunCommand(absl::StrCat(*bin, " bench transfer --backend cuda_ipc --max-blocks 1"), &out);
  EXPECT_TRUE(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) != 0) << out;
  EXPECT_THAT(out, HasSubstr("cuda_ipc"));
}

}  // namespace
}  // namespace tandem::testing
