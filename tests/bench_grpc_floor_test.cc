// `tandem bench grpc-floor` as the overhead benchmark uses it: its server
// answers Generate in the two messages a zero-timing sim worker sends, on its
// poller or handed to a writer thread, with or without gRPC's minimal stack;
// its client measures every call and writes the JSON the script reads; an
// unreachable server and bad flags are clear errors, and SIGTERM stops the
// server with status 0.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/v1/worker.grpc.pb.h"
#include "tests/testing/worker_process.h"

namespace tandem::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

class GrpcFloorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tandem-floor-test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    absl::StatusOr<std::string> bin = TandemBinary();
    ASSERT_TRUE(bin.ok()) << bin.status();
    bin_ = *bin;
  }
  void TearDown() override {
    server_.reset();  // SIGKILL if still running
    std::filesystem::remove_all(dir_);
  }

  // Starts `tandem bench grpc-floor --serve <flags>`; its host:port.
  std::string Serve(const std::vector<std::string>& flags = {}) {
    std::filesystem::remove(dir_ + "/addr");  // the previous server's
    std::vector<std::string> args = {"bench", "grpc-floor", "--serve", "--ready-file", dir_ + "/addr"};
    args.insert(args.end(), flags.begin(), flags.end());
    absl::StatusOr<std::string> addr =
        StartTandem(args, dir_ + "/addr", std::chrono::seconds(30), "grpc-floor", &server_);
    if (!addr.ok()) {
      ADD_FAILURE() << addr.status();
      return "";
    }
    return *addr;
  }

  // Runs the client against `target`; its exit status, output and JSON.
  int Measure(const std::string& target, const std::string& flags, std::string* out, json* j) {
    const std::string path = dir_ + "/floor.json";
    std::filesystem::remove(path);
    const int rc =
        RunCommand(absl::StrCat(bin_, " bench grpc-floor --target ", target, " ", flags, " --json ", path), out);
    std::ifstream in(path);
    *j = in ? json::parse(in, nullptr, false) : json();
    return rc;
  }

  std::string dir_;
  std::string bin_;
  std::unique_ptr<ChildProcess> server_;
};

TEST_F(GrpcFloorTest, TheServerAnswersInTwoMessagesAsAZeroTimingWorkerDoes) {
  for (const std::vector<std::string>& flags : {std::vector<std::string>{}, {"--handoff"}, {"--minimal-stack"}}) {
    const std::string addr = Serve(flags);
    ASSERT_FALSE(addr.empty());
    auto stub = tandem::v1::Worker::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
    tandem::v1::GenerateRequest req;
    for (int i = 0; i < 7; ++i) req.add_prompt_token_ids(i + 1);
    req.mutable_sampling()->set_max_tokens(5);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto reader = stub->Generate(&ctx, req);
    std::vector<tandem::v1::GenerateResponse> got;
    tandem::v1::GenerateResponse m;
    while (reader->Read(&m)) got.push_back(m);
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(got.size(), 2u) << (flags.empty() ? "" : flags[0]);
    EXPECT_EQ(got[0].tokens_size(), 1);
    EXPECT_EQ(got[0].finish_reason(), tandem::v1::FINISH_REASON_UNSPECIFIED);
    EXPECT_EQ(got[1].tokens_size(), 4);
    EXPECT_EQ(got[1].finish_reason(), tandem::v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(got[1].usage().prompt_tokens(), 7);
    EXPECT_EQ(got[1].usage().completion_tokens(), 5);
    server_.reset();
  }
}

TEST_F(GrpcFloorTest, TheClientMeasuresEveryCall) {
  for (const bool minimal : {false, true}) {
    const std::string addr =
        Serve(minimal ? std::vector<std::string>{"--minimal-stack"} : std::vector<std::string>{"--handoff"});
    ASSERT_FALSE(addr.empty());
    std::string out;
    json j;
    const int rc = Measure(addr,
                           absl::StrCat("--num-prompts 30 --warmups 2 --request-rate 300 "
                                        "--input-len 64 --max-tokens 8 --seed 3",
                                        minimal ? " --minimal-stack" : ""),
                           &out, &j);
    ASSERT_EQ(rc, 0) << out;
    ASSERT_TRUE(j.is_object()) << out;
    EXPECT_EQ(j["completed"], 30) << out;
    EXPECT_EQ(j["failed"], 0) << out;
    EXPECT_GT(j["duration_s"].get<double>(), 0);
    for (const char* key : {"first_ms", "end_ms"}) {
      const json& d = j[key];
      EXPECT_GT(d["median"].get<double>(), 0) << key;
      EXPECT_LE(d["median"].get<double>(), d["p90"].get<double>()) << key;
      EXPECT_LE(d["p90"].get<double>(), d["p99"].get<double>()) << key;
    }
    // The first message comes before the stream's end.
    EXPECT_LE(j["first_ms"]["median"].get<double>(), j["end_ms"]["median"].get<double>());
    EXPECT_THAT(out, HasSubstr("30 calls ok, 0 failed"));
    server_.reset();
  }
}

TEST_F(GrpcFloorTest, AnUnreachableServerFailsTheRun) {
  // A port nothing listens on: the server started and stopped.
  const std::string addr = Serve();
  ASSERT_FALSE(addr.empty());
  server_->Signal(SIGTERM);
  ASSERT_TRUE(server_->Wait(std::chrono::seconds(15)).ok());
  std::string out;
  json j;
  EXPECT_NE(Measure(addr, "--num-prompts 3 --warmups 0 --request-rate 100", &out, &j), 0);
  EXPECT_THAT(out, HasSubstr("3 calls failed"));
}

TEST_F(GrpcFloorTest, StopsWithStatusZeroOnSigterm) {
  ASSERT_FALSE(Serve({"--handoff"}).empty());
  server_->Signal(SIGTERM);
  absl::StatusOr<int> status = server_->Wait(std::chrono::seconds(15));
  ASSERT_TRUE(status.ok()) << "grpc-floor did not stop after SIGTERM";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "wait status " << *status;
}

TEST_F(GrpcFloorTest, StopsOnSigtermWhileAClientKeepsItsConnection) {
  const std::string addr = Serve({"--handoff"});
  ASSERT_FALSE(addr.empty());
  auto stub = tandem::v1::Worker::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 3; ++i) {
    tandem::v1::GenerateRequest req;
    req.add_prompt_token_ids(1);
    req.mutable_sampling()->set_max_tokens(2);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto reader = stub->Generate(&ctx, req);
    tandem::v1::GenerateResponse m;
    while (reader->Read(&m)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  // The channel stays open.
  server_->Signal(SIGTERM);
  absl::StatusOr<int> status = server_->Wait(std::chrono::seconds(15));
  ASSERT_TRUE(status.ok()) << "grpc-floor did not stop after SIGTERM";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "wait status " << *status;
}

TEST_F(GrpcFloorTest, BadFlagsAreClearErrors) {
  std::string out;
  json j;
  EXPECT_NE(RunCommand(bin_ + " bench grpc-floor --num-prompts 3", &out), 0);
  EXPECT_THAT(out, HasSubstr("--target"));
  EXPECT_NE(Measure("127.0.0.1:1", "--max-tokens 1", &out, &j), 0);
  EXPECT_THAT(out, HasSubstr("--max-tokens"));
  EXPECT_NE(Measure("127.0.0.1:1", "--request-rate 0", &out, &j), 0);
  EXPECT_THAT(out, HasSubstr("--request-rate"));
  EXPECT_NE(RunCommand(bin_ + " bench grpc-floor --handoff --target 127.0.0.1:1", &out), 0);
  EXPECT_THAT(out, HasSubstr("--handoff requires --serve"));
  EXPECT_NE(RunCommand(bin_ + " bench grpc-floor --serve --target 127.0.0.1:1", &out), 0);
  EXPECT_THAT(out, HasSubstr("excludes"));
  EXPECT_NE(RunCommand(bin_ + " bench grpc-floor --serve --host 999.1.1.1", &out), 0);
  EXPECT_THAT(out, HasSubstr("999.1.1.1"));
}

}  // namespace
}  // namespace tandem::testing
