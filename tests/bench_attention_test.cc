// `tandem bench attention`: bad flags are errors that name the flag (before
// any GPU work); without a usable GPU it exits 2 with the reason
// cuda::Available gives; on a GPU a tiny grid writes JSON holding every field
// the benchmark promises (ours, the copy and torch baselines, the ratios, the
// device and the command line).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/paged_attention.h"
#include "nlohmann/json.hpp"
#include "tests/testing/worker_process.h"

namespace tandem::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

class BenchAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::string> bin = TandemBinary();
    ASSERT_TRUE(bin.ok()) << bin.status();
    bin_ = *bin;
    char tmpl[] = "/tmp/tandem-bench-attention-test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Exit code (or -1 if it did not exit) and output of `tandem bench attention <flags>`.
  int Run(const std::string& flags, std::string* out) {
    const int rc = RunCommand(absl::StrCat(bin_, " bench attention ", flags), out);
    return rc != -1 && WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }

  std::string bin_;
  std::string dir_;
};

TEST_F(BenchAttentionTest, BadFlagsNameTheFlag) {
  const std::pair<std::string, std::string> cases[] = {
      {"--page-size 48", "--page-size"},      {"--decode-page-sizes 16,24", "--decode-page-sizes"},
      {"--seqlens 3000", "--seqlens"},  // does not divide --tokens 16384
      {"--seqlens 0", "--seqlens"},           {"--head-dims 96", "--head-dims"},
      {"--models 13b", "--models"},           {"--mode both", "--mode"},
      {"--causal maybe", "--causal"},         {"--gqa 3", "--gqa"},  // does not divide 16 or 32 heads
      {"--copy-bytes 12xyz", "--copy-bytes"}, {"--reps 0", "--reps"},
      {"--batches 0", "--batches"},
  };
  for (const auto& [flags, name] : cases) {
    std::string out;
    const int rc = Run(flags, &out);
    EXPECT_NE(rc, 0) << flags << ": " << out;
    EXPECT_NE(rc, 2) << flags << ": a flag error, not the no-GPU exit: " << out;
    EXPECT_THAT(out, HasSubstr(name)) << flags;
  }
}

TEST_F(BenchAttentionTest, WithoutAGpuItExitsTwoWithTheReason) {
  const char* why = nullptr;
  if (kernels::cuda::Available(&why)) GTEST_SKIP() << "a usable GPU is present";
  std::string out;
  const int rc = Run("--mode decode --batches 1 --contexts 1024 --no-torch", &out);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_THAT(out, HasSubstr("no usable GPU"));
  EXPECT_THAT(out, HasSubstr(why));
}

TEST_F(BenchAttentionTest, ATinyGridWritesEveryField) {
  const char* why = nullptr;
  if (!kernels::cuda::Available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  std::string script_flag;
  if (const char* s = std::getenv("TANDEM_BENCH_ATTENTION_TORCH_SCRIPT"); s != nullptr && *s != '\0') {
    script_flag = absl::StrCat(" --torch-script ", s);
  }
  const std::string path = dir_ + "/attn.json";
  std::string out;
  const int rc = Run(absl::StrCat("--seqlens 128,256 --tokens 512 --head-dims 64 --batches 1,2 --contexts 1000 "
                                  "--models 8b --decode-page-sizes 16 --reps 5 --copy-bytes 64MiB --json ",
                                  path, script_flag),
                     &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("tandem bench attention on"));
  EXPECT_THAT(out, HasSubstr("command:"));
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const json j = json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_THAT(j["command"].get<std::string>(), HasSubstr("bench attention"));
  EXPECT_FALSE(j["device"]["name"].get<std::string>().empty());
  EXPECT_GT(j["device"]["sms"].get<int>(), 0);
  EXPECT_GT(j["copy"]["gbps_read_plus_write"].get<double>(), 0);
  ASSERT_TRUE(j["torch"].contains("available"));
  const bool torch = j["torch"]["available"].get<bool>();
  if (!torch) {
    EXPECT_FALSE(j["torch"]["why"].get<std::string>().empty());
  }

  // 2 lengths x causal and not, at head dim 64 (32 heads).
  ASSERT_EQ(j["prefill"].size(), 4u) << j["prefill"].dump();
  for (const json& r : j["prefill"]) {
    for (const char* key :
         {"causal", "head_dim", "heads", "kv_heads", "seqlen", "batch", "page_size", "flops", "input_sets", "reps"}) {
      EXPECT_TRUE(r.contains(key)) << key;
    }
    EXPECT_EQ(r["heads"], 32);
    EXPECT_EQ(r["batch"].get<int>() * r["seqlen"].get<int>(), 512);
    EXPECT_GT(r["ours"]["ms"].get<double>(), 0) << r.dump();
    EXPECT_GT(r["ours"]["tflops"].get<double>(), 0);
    EXPECT_TRUE(r["torch"].contains("cudnn") && r["torch"].contains("flash"));
    ASSERT_TRUE(r.contains("ratio_to_best_torch"));
    if (torch) {
      EXPECT_GT(r["ratio_to_best_torch"].get<double>(), 0) << r.dump();
    } else {
      EXPECT_TRUE(r["ratio_to_best_torch"].is_null());
    }
  }
  ASSERT_EQ(j["decode"].size(), 2u) << j["decode"].dump();
  for (const json& r : j["decode"]) {
    for (const char* key : {"model", "heads", "kv_heads", "head_dim", "batch", "context", "page_size", "kv_bytes",
                            "input_sets", "reps", "torch_best_backend"}) {
      EXPECT_TRUE(r.contains(key)) << key;
    }
    EXPECT_EQ(r["heads"], 32);
    EXPECT_EQ(r["kv_heads"], 8);
    EXPECT_EQ(r["kv_bytes"].get<int64_t>(), r["batch"].get<int64_t>() * 1000 * 8 * 128 * 4);
    EXPECT_GT(r["ours"]["us"].get<double>(), 0) << r.dump();
    EXPECT_GT(r["ours"]["gbps"].get<double>(), 0);
    EXPECT_GT(r["ratio_to_copy"].get<double>(), 0);
    for (const char* b : {"default", "cudnn", "flash"}) EXPECT_TRUE(r["torch"].contains(b)) << b;
    if (torch) {
      EXPECT_GT(r["ratio_to_torch"].get<double>(), 0) << r.dump();
    } else {
      EXPECT_TRUE(r["ratio_to_torch"].is_null());
    }
  }
}

TEST_F(BenchAttentionTest, WithoutTorchTheTableSaysSoAndRatiosAreBlank) {
  const char* why = nullptr;
  if (!kernels::cuda::Available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  const std::string path = dir_ + "/attn.json";
  std::string out;
  const int rc = Run(absl::StrCat("--mode decode --batches 1 --contexts 512 --models 8b --decode-page-sizes 64 "
                                  "--reps 3 --copy-bytes 16MiB --torch-python /nonexistent/python --json ",
                                  path),
                     &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("torch baselines unavailable"));
  std::ifstream in(path);
  const json j = json::parse(in, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_FALSE(j["torch"]["available"].get<bool>());
  ASSERT_EQ(j["decode"].size(), 1u);
  EXPECT_TRUE(j["decode"][0]["ratio_to_torch"].is_null());
  EXPECT_GT(j["decode"][0]["ours"]["gbps"].get<double>(), 0);
}

}  // namespace
}  // namespace tandem::testing
