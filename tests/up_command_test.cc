// `tandem up` as a user runs it: a local cluster of real child processes
// that serves OpenAI requests, stops cleanly on Ctrl-C, stops everything
// when one of its processes dies, and rejects bad flags with a message.
// And `tandem bench --url` against such a cluster (of simulated workers):
// its JSON and HTML reports as a user reads them.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/tls.h"
#include "kernels/paged_attention.h"
#include "nlohmann/json.hpp"
#include "tests/testing/http_client.h"
#include "tests/testing/worker_process.h"

namespace tandem::testing {
namespace {

using std::chrono::seconds;
using ::testing::HasSubstr;
using ::testing::Not;

// Processes whose parent is `parent`, with their command lines.
std::vector<std::pair<pid_t, std::string>> ChildrenOf(pid_t parent) {
  std::vector<std::pair<pid_t, std::string>> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::optional<ProcStat> st = ReadProcStat(std::atoi(name.c_str()));
    if (!st.has_value() || st->ppid != parent) continue;
    std::ifstream cmdline_file(entry.path() / "cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(cmdline_file)), {});
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    out.emplace_back(std::atoi(name.c_str()), cmdline);
  }
  return out;
}

bool Alive(pid_t pid) { return ::kill(pid, 0) == 0; }

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

class UpCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tandem-up-test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    up_.reset();  // SIGKILL if still running (its children die with it: PDEATHSIG)
    std::filesystem::remove_all(dir_);
  }

  // Starts `tandem up` with `flags`; the router's URL once it is ready.
  std::string Start(const std::vector<std::string>& flags) {
    // The run directory does not exist yet: up creates it.
    std::vector<std::string> args = {
        "up", "--port", "0", "--ready-file", dir_ + "/url", "--run-dir", dir_ + "/run/nested", "--worker-threads", "1"};
    args.insert(args.end(), flags.begin(), flags.end());
    absl::StatusOr<std::string> url = StartTandem(args, dir_ + "/url", std::chrono::seconds(60), "tandem up", &up_);
    if (!url.ok()) {
      ADD_FAILURE() << url.status();
      return "";
    }
    return *url;
  }

  // `kv_transport`: "" for the default of the device.
  void SplitServesLikeAggregated(const std::string& device, const std::string& kv_transport = "");

  std::string dir_;
  std::unique_ptr<ChildProcess> up_;
};

TEST_F(UpCommandTest, AggregatedClusterServesAndStopsCleanlyOnCtrlC) {
  // --device cpu, named: the workers get no GPU flags.
  const std::string url = Start({"--aggregated", "2", "--policy", "round_robin", "--device", "cpu"});
  ASSERT_FALSE(url.empty());
  const std::vector<std::pair<pid_t, std::string>> children = ChildrenOf(up_->pid());
  ASSERT_EQ(children.size(), 3u) << "two workers and a router";
  // Up once one worker is healthy; round robin reaches both once both are.
  const std::string ready0 = ReadFirstLine(dir_ + "/run/nested/worker-0.addr");
  const std::string ready1 = ReadFirstLine(dir_ + "/run/nested/worker-1.addr");
  for (const std::string& address : {ready0, ready1}) {
    const std::string healthy = absl::StrCat("tandem_router_worker_healthy{pool=\"decode\",worker=\"", address, "\"}");
    EXPECT_TRUE(WaitUntil([&] { return ScrapeMetric(url, healthy) == 1; }, seconds(20))) << address;
  }
  std::set<std::string> served;
  for (int i = 0; i < 4; ++i) {
    const HttpResponse r =
        HttpPost(url, "/v1/chat/completions",
                 R"({"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.Header("x-tandem-prefill-worker"), r.Header("x-tandem-decode-worker"));
    served.insert(r.Header("x-tandem-decode-worker"));
  }
  EXPECT_EQ(served.size(), 2u) << "round robin over both aggregated workers";

  up_->Signal(SIGINT);
  absl::StatusOr<int> status = up_->Wait(seconds(30));
  ASSERT_TRUE(status.ok()) << "tandem up did not stop after SIGINT";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "wait status " << *status;
  for (const auto& [pid, cmdline] : children) EXPECT_FALSE(Alive(pid)) << cmdline;
}

// On GPUs (the GPU machine; skipped elsewhere): a prefill and a decode
// worker on `device` (cuda:0: one GPU shared, each worker taking half of 0.9
// of its memory; cuda: GPUs 0 and 1, 0.9 each, the KV crossing by peer
// access), the KV moving over cuda_ipc, serve the same greedy completions
// as one aggregated worker on GPU 0 (--batch-invariant: a sequence's tokens
// do not depend on its batch).
void UpCommandTest::SplitServesLikeAggregated(const std::string& device, const std::string& kv_transport) {
  const bool gpu = device != "cpu";
  // Send/receive transports: the workers push.
  const bool staged = kv_transport == "ucx_staged" || kv_transport == "nccl";
  const std::vector<std::string> prompts = {"The capital of France is", "def fib(n):", "Once upon a time",
                                            "1, 2, 3, 4,"};
  // The completions of `prompts` (greedy, 24 tokens), and the workers that
  // served them.
  auto complete = [&](const std::string& url, std::set<std::string>* prefill, std::set<std::string>* decode) {
    std::vector<std::string> texts;
    for (const std::string& prompt : prompts) {
      const nlohmann::json body = {
          {"model", "builtin:small"}, {"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}};
      const HttpResponse r = HttpPost(url, "/v1/completions", body.dump());
      EXPECT_EQ(r.status, 200) << r.body;
      if (r.status != 200) return texts;
      const nlohmann::json j = nlohmann::json::parse(r.body);
      texts.push_back(j["choices"][0]["text"].get<std::string>());
      EXPECT_EQ(j["usage"]["completion_tokens"], 24) << r.body;
      prefill->insert(r.Header("x-tandem-prefill-worker"));
      decode->insert(r.Header("x-tandem-decode-worker"));
    }
    return texts;
  };
  auto stop = [&] {
    up_->Signal(SIGINT);
    absl::StatusOr<int> status = up_->Wait(seconds(60));
    ASSERT_TRUE(status.ok()) << "tandem up did not stop after SIGINT";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "wait status " << *status;
    up_.reset();
  };
  std::vector<std::string> common = {"--model", "builtin:small", "--insecure"};
  if (gpu) common.push_back("--worker-arg=--batch-invariant");
  std::vector<std::string> split = {"--prefill", "1", "--decode", "1", "--device", device};
  if (!kv_transport.empty()) split.insert(split.end(), {"--kv-transport", kv_transport});
  split.insert(split.end(), common.begin(), common.end());
  const std::string split_url = Start(split);
  ASSERT_FALSE(split_url.empty());
  std::set<std::string> devices;
  for (const auto& [pid, cmdline] : ChildrenOf(up_->pid())) {
    if (cmdline.find(" worker ") == std::string::npos) continue;
    EXPECT_THAT(cmdline, HasSubstr("--kv-transport " + (kv_transport.empty() ? "cuda_ipc" : kv_transport))) << cmdline;
    if (staged) {
      EXPECT_THAT(cmdline, HasSubstr("--kv-delivery push")) << cmdline;  // send/receive: push only
    }
    if (!gpu) continue;
    EXPECT_THAT(cmdline,
                HasSubstr(device == "cuda" ? "--gpu-memory-utilization 0.9 " : "--gpu-memory-utilization 0.45 "))
        << cmdline;
    const size_t at = cmdline.find("--device ");
    if (at != std::string::npos) devices.insert(cmdline.substr(at, cmdline.find(' ', at + 9) - at));
  }
  const std::set<std::string> want_devices = device == "cuda"
                                                 ? std::set<std::string>{"--device cuda:0", "--device cuda:1"}
                                             : device == "cpu" ? std::set<std::string>{}  // not looked at
                                                               : std::set<std::string>{"--device cuda:0"};
  EXPECT_EQ(devices, want_devices);
  std::set<std::string> split_prefill, split_decode;
  const std::vector<std::string> split_texts = complete(split_url, &split_prefill, &split_decode);
  EXPECT_EQ(split_prefill.size(), 1u);
  EXPECT_EQ(split_decode.size(), 1u);
  EXPECT_NE(*split_prefill.begin(), *split_decode.begin()) << "the prefill ran on the decode worker";
  {
    // The KV moved GPU to GPU for every request (a failed transfer would
    // fall back to a local prefill, with the same text).
    auto decode =
        tandem::v1::Worker::NewStub(grpc::CreateChannel(*split_decode.begin(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
    tandem::v1::LoadReport load;
    ASSERT_TRUE(decode->GetLoad(&ctx, tandem::v1::LoadRequest(), &load).ok());
    EXPECT_EQ(staged ? load.kv_pushes_received() : load.kv_pulls(), static_cast<int64_t>(prompts.size()))
        << "the KV did not move between the workers";
    if (!staged) {
      EXPECT_GT(load.kv_bytes_pulled(), 0);
    }
    EXPECT_EQ(load.local_prefill_fallbacks(), 0);
  }
  stop();
  std::filesystem::remove(dir_ + "/url");  // else the next Start reads this cluster's URL
  std::filesystem::remove_all(dir_ + "/run");

  std::vector<std::string> aggregated = {"--aggregated", "1", "--device", gpu ? "cuda:0" : "cpu"};
  aggregated.insert(aggregated.end(), common.begin(), common.end());
  const std::string agg_url = Start(aggregated);
  ASSERT_FALSE(agg_url.empty());
  std::set<std::string> agg_prefill, agg_decode;
  EXPECT_EQ(complete(agg_url, &agg_prefill, &agg_decode), split_texts);
  EXPECT_EQ(agg_prefill, agg_decode);
  stop();
}

TEST_F(UpCommandTest, GpuSplitClusterServesLikeAnAggregatedOne) {
  const char* why = nullptr;
  if (!kernels::cuda::Available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  SplitServesLikeAggregated("cuda:0");
}

// Send/receive through host staging (GPU pools across hosts; here one GPU
// and shared memory): up makes the workers push.
TEST_F(UpCommandTest, GpuSplitClusterOverUcxStagedServesLikeAnAggregatedOne) {
  const char* why = nullptr;
  if (!kernels::cuda::Available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  SplitServesLikeAggregated("cuda:0", "ucx_staged");
}

// The same on CPU workers (host pools staged with memcpy).
TEST_F(UpCommandTest, SplitClusterOverUcxStagedServesLikeAnAggregatedOne) {
  SplitServesLikeAggregated("cpu", "ucx_staged");
}

TEST_F(UpCommandTest, TwoGpuSplitClusterServesLikeAnAggregatedOne) {
  const char* why = nullptr;
  if (!kernels::cuda::Available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  if (kernels::cuda::DeviceCount() < 2) GTEST_SKIP() << "one GPU";
  SplitServesLikeAggregated("cuda");
}

// Two GPUs with the KV moving over NCCL (libnccl.so.2 on the loader path or
// $TANDEM_NCCL; the GPU machine has torch's).
TEST_F(UpCommandTest, TwoGpuSplitClusterOverNcclServesLikeAnAggregatedOne) {
  const char* why = nullptr;
  if (!kernels::cuda::Available(&why)) GTEST_SKIP() << "no usable GPU: " << why;
  if (kernels::cuda::DeviceCount() < 2) GTEST_SKIP() << "one GPU";
  SplitServesLikeAggregated("cuda", "nccl");
}

TEST_F(UpCommandTest, DefaultClusterRunsOverMutualTlsWithAThrowawayCa) {
  const std::string url = Start({});
  ASSERT_FALSE(url.empty());
  const std::vector<std::pair<pid_t, std::string>> children = ChildrenOf(up_->pid());
  ASSERT_EQ(children.size(), 3u);
  // The value after `flag` on a command line.
  auto flag = [](const std::string& cmdline, const std::string& name) {
    const size_t at = cmdline.find(name + " ");
    if (at == std::string::npos) return std::string();
    const size_t from = at + name.size() + 1;
    return cmdline.substr(from, cmdline.find(' ', from) - from);
  };
  tandem::tls::TlsFiles worker_files;
  for (const auto& [pid, cmdline] : children) {
    if (cmdline.find(" worker ") == std::string::npos) continue;
    EXPECT_EQ(cmdline.find("--insecure"), std::string::npos) << cmdline;
    worker_files = {
        .ca = flag(cmdline, "--tls-ca"), .cert = flag(cmdline, "--tls-cert"), .key = flag(cmdline, "--tls-key")};
    ASSERT_FALSE(worker_files.ca.empty()) << cmdline;
  }
  const std::string ca = worker_files.ca;
  ASSERT_TRUE(std::filesystem::exists(ca)) << ca;
  // A split request: router -> both workers, prefill -> decode (KvReady), all mTLS.
  const HttpResponse ok =
      HttpPost(url, "/v1/completions", R"({"model": "builtin:tiny", "prompt": "hello", "max_tokens": 3})");
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_NE(ok.Header("x-tandem-prefill-worker"), ok.Header("x-tandem-decode-worker"));
  // The decode worker pulled the KV (asked with the cluster's worker identity).
  absl::StatusOr<tandem::tls::TlsMaterial> material =
      tandem::tls::LoadTlsMaterial(worker_files, {.ca = "ca", .cert = "cert", .key = "key"});
  ASSERT_TRUE(material.ok()) << material.status();
  auto peer = tandem::v1::Worker::NewStub(
      tandem::tls::ChannelFactory::Mutual(*material)->Create(ok.Header("x-tandem-decode-worker")));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
    tandem::v1::LoadReport load;
    ASSERT_TRUE(peer->GetLoad(&ctx, tandem::v1::LoadRequest(), &load).ok());
    EXPECT_EQ(load.kv_pulls(), 1) << "the KV did not move between the workers";
    EXPECT_EQ(load.local_prefill_fallbacks(), 0);
  }
  // An insecure client cannot reach the workers.
  const std::string decode = ok.Header("x-tandem-decode-worker");
  auto stub = tandem::v1::Worker::NewStub(grpc::CreateChannel(decode, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
  tandem::v1::ClearKvCacheResponse cleared;
  EXPECT_FALSE(stub->ClearKvCache(&ctx, tandem::v1::ClearKvCacheRequest(), &cleared).ok());

  up_->Signal(SIGINT);
  absl::StatusOr<int> status = up_->Wait(seconds(30));
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "wait status " << *status;
  EXPECT_FALSE(std::filesystem::exists(ca)) << "the throwaway CA outlived the cluster";
}

TEST_F(UpCommandTest, InsecureIsOnlyByName) {
  const std::string url = Start({"--insecure", "--aggregated", "1"});
  ASSERT_FALSE(url.empty());
  for (const auto& [pid, cmdline] : ChildrenOf(up_->pid())) {
    if (cmdline.find(" worker ") == std::string::npos) continue;
    EXPECT_NE(cmdline.find("--insecure"), std::string::npos) << cmdline;
    EXPECT_EQ(cmdline.find("--tls-"), std::string::npos) << cmdline;
  }
  const HttpResponse ok =
      HttpPost(url, "/v1/completions", R"({"model": "builtin:tiny", "prompt": "hello", "max_tokens": 2})");
  EXPECT_EQ(ok.status, 200) << ok.body;
}

TEST_F(UpCommandTest, WithoutRestartsAWorkerThatDiesStopsTheCluster) {
  // The default cluster: one prefill and one decode worker, disaggregated.
  const std::string url = Start({"--max-restarts", "0"});
  ASSERT_FALSE(url.empty());
  const std::vector<std::pair<pid_t, std::string>> children = ChildrenOf(up_->pid());
  ASSERT_EQ(children.size(), 3u);
  pid_t decode = -1;
  for (const auto& [pid, cmdline] : children) {
    if (cmdline.find(" worker ") != std::string::npos && cmdline.find("--role decode") != std::string::npos) {
      decode = pid;
    }
  }
  ASSERT_GT(decode, 0);
  const HttpResponse ok =
      HttpPost(url, "/v1/completions", R"({"model": "builtin:tiny", "prompt": "hello", "max_tokens": 3})");
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_NE(ok.Header("x-tandem-prefill-worker"), ok.Header("x-tandem-decode-worker"));

  ::kill(decode, SIGKILL);
  absl::StatusOr<int> status = up_->Wait(seconds(30));
  ASSERT_TRUE(status.ok()) << "tandem up kept running without its decode worker";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) != 0) << "wait status " << *status;
  for (const auto& [pid, cmdline] : children) EXPECT_FALSE(Alive(pid)) << cmdline;
}

// The worker of `up_pid` started with `ready_file` (its --ready-file), or -1.
pid_t WorkerWithReadyFile(pid_t up_pid, const std::string& ready_file) {
  for (const auto& [pid, cmdline] : ChildrenOf(up_pid)) {
    if (cmdline.find(" worker ") != std::string::npos && cmdline.find(ready_file + " ") != std::string::npos) {
      return pid;
    }
  }
  return -1;
}

// SIGKILLs `victim`, the worker of `up_pid` with `ready_file`; true once
// another process runs in its place.
bool KillAndAwaitRestart(pid_t up_pid, pid_t victim, const std::string& ready_file) {
  ::kill(victim, SIGKILL);
  return WaitUntil(
      [&] {
        const pid_t restarted = WorkerWithReadyFile(up_pid, ready_file);
        return restarted > 0 && restarted != victim;
      },
      seconds(20));
}

// A streamed completion that ended with [DONE] and no error event.
bool CompleteStream(const HttpResponse& r) {
  return r.status == 200 && r.body.find("\"error\"") == std::string::npos && r.body.find("[DONE]") != std::string::npos;
}

TEST_F(UpCommandTest, AWorkerThatDiesIsRestartedOnItsPortWhileTheOthersServe) {
  const std::string url = Start({"--aggregated", "2", "--engine", "sim", "--policy", "round_robin",
                                 "--worker-arg=--sim-step-ms", "--worker-arg=1"});
  ASSERT_FALSE(url.empty());
  const std::string ready = dir_ + "/run/nested/worker-0.addr";
  const std::string address = ReadFirstLine(ready);
  ASSERT_FALSE(address.empty());
  const pid_t victim = WorkerWithReadyFile(up_->pid(), ready);
  ASSERT_GT(victim, 0);
  const std::string healthy = absl::StrCat("tandem_router_worker_healthy{pool=\"decode\",worker=\"", address, "\"}");
  ASSERT_TRUE(WaitUntil([&] { return ScrapeMetric(url, healthy) == 1; }, seconds(20)));

  // Requests keep coming while the worker dies and comes back.
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  std::thread client([&] {
    for (int i = 0; !stop.load(); ++i) {
      const HttpResponse r = HttpPost(url, "/v1/completions",
                                      absl::StrCat(R"({"model": "builtin:tiny", "prompt": "keep going )", i,
                                                   R"(", "max_tokens": 40, "stream": true, "ignore_eos": true})"));
      (CompleteStream(r) ? ok : failed)++;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  // A new process on the same port, admitted again by the router.
  EXPECT_TRUE(KillAndAwaitRestart(up_->pid(), victim, ready));
  EXPECT_TRUE(WaitUntil([&] { return ReadFirstLine(ready) == address; }, seconds(30)))
      << "the restarted worker is not on " << address;
  EXPECT_TRUE(WaitUntil([&] { return ScrapeMetric(url, healthy) == 1; }, seconds(30)));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  stop = true;
  client.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_GE(ok.load(), 5);
  EXPECT_TRUE(up_->Running());
  // It serves again (round robin reaches it).
  std::set<std::string> served;
  for (int i = 0; i < 4; ++i) {
    const HttpResponse r =
        HttpPost(url, "/v1/completions", R"({"model": "builtin:tiny", "prompt": "back?", "max_tokens": 2})");
    EXPECT_EQ(r.status, 200) << r.body;
    served.insert(r.Header("x-tandem-decode-worker"));
  }
  EXPECT_TRUE(served.count(address)) << "the restarted worker serves no request";
}

// The only worker killed under streaming load: the streams it was running
// fail over to it once it is restarted (tried, but admitted again since),
// and requests that came meanwhile wait for it; no client sees an error.
TEST_F(UpCommandTest, TheOnlyWorkerKilledUnderLoadFailsNoRequest) {
  const std::string url =
      Start({"--aggregated", "1", "--engine", "sim", "--worker-arg=--sim-step-ms", "--worker-arg=20"});
  ASSERT_FALSE(url.empty());
  const std::string ready = dir_ + "/run/nested/worker-0.addr";
  const pid_t victim = WorkerWithReadyFile(up_->pid(), ready);
  ASSERT_GT(victim, 0);
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0};
  std::mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; !stop.load(); ++i) {
        const HttpResponse r =
            HttpPost(url, "/v1/completions",
                     absl::StrCat(R"({"model": "builtin:tiny", "prompt": "still here )", c, " ", i,
                                  R"(", "max_tokens": 30, "stream": true, "ignore_eos": true, "seed": 1})"));
        if (CompleteStream(r)) {
          ++ok;
        } else {
          std::lock_guard<std::mutex> lock(mu);
          failures.push_back(absl::StrCat(r.status, " ", r.body.substr(0, 300)));
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(800));  // streams in flight
  EXPECT_TRUE(KillAndAwaitRestart(up_->pid(), victim, ready));
  const std::string placed = "tandem_router_worker_waits_total{outcome=\"placed\"}";
  EXPECT_TRUE(WaitUntil([&] { return ScrapeMetric(url, placed).value_or(0) >= 1; }, seconds(30)));
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // served again
  stop = true;
  for (std::thread& t : clients) t.join();
  EXPECT_TRUE(failures.empty()) << failures.size() << " failed, the first: " << failures.front();
  EXPECT_GE(ok.load(), 6);
  // The streams it was running moved (retried before their first token, failed over after it).
  EXPECT_GE(ScrapeMetric(url, "tandem_router_failovers_total{reason=\"error\"}").value_or(0) +
                ScrapeMetric(url, "tandem_router_retries_total").value_or(0),
            1);
  EXPECT_EQ(ScrapeMetric(url, "tandem_router_worker_waits_total{outcome=\"expired\"}").value_or(0), 0);
}

TEST_F(UpCommandTest, AWorkerThatKeepsDyingIsGivenUpOnAndTheRestServe) {
  const std::string url = Start({"--aggregated", "2", "--engine", "sim", "--max-restarts", "1"});
  ASSERT_FALSE(url.empty());
  const std::string ready = dir_ + "/run/nested/worker-0.addr";
  const pid_t first = WorkerWithReadyFile(up_->pid(), ready);
  ASSERT_GT(first, 0);
  ::kill(first, SIGKILL);
  pid_t second = -1;
  ASSERT_TRUE(WaitUntil(
      [&] {
        second = WorkerWithReadyFile(up_->pid(), ready);
        return second > 0 && second != first;
      },
      seconds(20)));
  ::kill(second, SIGKILL);
  // Not restarted again; the cluster serves with the other worker.
  std::this_thread::sleep_for(seconds(3));
  const pid_t third = WorkerWithReadyFile(up_->pid(), ready);
  EXPECT_TRUE(third < 0 || third == second) << "restarted past --max-restarts";
  EXPECT_TRUE(up_->Running());
  for (int i = 0; i < 4; ++i) {
    const HttpResponse r =
        HttpPost(url, "/v1/completions", R"({"model": "builtin:tiny", "prompt": "still", "max_tokens": 2})");
    EXPECT_EQ(r.status, 200) << r.body;
  }
}

// --served-model-name: the name clients use, on /v1/models and in requests.
TEST_F(UpCommandTest, ServedModelNameIsTheNameClientsUse) {
  const std::string url = Start({"--aggregated", "1", "--served-model-name", "acme/tiny-chat"});
  ASSERT_FALSE(url.empty());
  const HttpResponse models = HttpGet(url, "/v1/models");
  ASSERT_EQ(models.status, 200) << models.body;
  EXPECT_EQ(nlohmann::json::parse(models.body)["data"][0]["id"], "acme/tiny-chat");
  EXPECT_EQ(HttpGet(url, "/v1/models/acme%2Ftiny-chat").status, 200);
  HttpResponse r =
      HttpPost(url, "/v1/chat/completions",
               R"({"model": "acme/tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})");
  EXPECT_EQ(r.status, 200) << r.body;
  r = HttpPost(url, "/v1/chat/completions",
               R"({"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})");
  EXPECT_EQ(r.status, 404) << r.body;
}

TEST_F(UpCommandTest, BadFlagsAreClearErrors) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  struct Case {
    std::string flags;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"--disaggregation sometimes", "--disaggregation must be never, always or auto"},
      {"--decode 0", "at least one decode"},
      {"--policy fastest", "fastest"},
      {"--config /nonexistent/router.yaml", "/nonexistent/router.yaml"},
      {"--max-restarts -1", "--max-restarts"},
      // Refused before any process starts, naming the flag:
      {"--policy fastest", "--policy fastest: "},
      {"--model builtin:huge",
       "--model: no built-in model 'builtin:huge' (builtin:tiny, builtin:small, builtin:llama-3.2-1b, "
       "builtin:llama-3.1-8b)"},
      {"--model /nonexistent", "--model: '/nonexistent' is neither a built-in model"},
      {"--kv-cache-memory 5lots", "--kv-cache-memory: '5lots' is not a size"},
      {"--device tpu", "--device must be cpu, cuda or cuda:N, got 'tpu'"},
      {"--device cuda:x", "--device must be cpu, cuda or cuda:N, got 'cuda:x'"},
      {"--device cuda --prefill 1 --decode 1 --kv-transport ucx",
       "--kv-transport ucx cannot move the KV cache of cuda workers (GPU memory): use --kv-transport cuda_ipc"},
      {"--prefill 1 --decode 1 --kv-transport cuda_ipc",
       "--kv-transport cuda_ipc cannot move the KV cache of cpu workers (host memory): use --kv-transport ucx"},
      {"--prefill 1 --decode 1 --kv-transport gloo",
       "--kv-transport must be one of cuda_ipc, nccl, ucx, ucx_staged, got 'gloo'"},
      {"--prefill 1 --decode 1 --kv-transport nccl",
       "--kv-transport nccl joins the prefill and decode workers' GPUs, which must differ: --device cuda (worker k on "
       "GPU k), not cpu"},
      {"--device cuda:0 --prefill 1 --decode 1 --kv-transport nccl", "--device cuda (worker k on GPU k), not cuda:0"},
      {"--aggregated 1 --kv-transport ucx", "--kv-transport is for disaggregated clusters"},
      {"--gpu-memory-utilization 0.5", "--gpu-memory-utilization is for GPU workers"},
      {"--device cuda:0 --gpu-memory-utilization 1.5", "--gpu-memory-utilization must be in (0, 1], got 1.5"},
      {"--device cuda:0 --gpu-memory-utilization 0.5 --kv-cache-memory 1GiB",
       "--gpu-memory-utilization and --kv-cache-memory exclude each other"},
  };
  std::vector<Case> all = cases;
  if (!kernels::cuda::Available()) {
    // Without a GPU (CI), GPU workers are refused before any starts.
    all.push_back({"--device cuda --aggregated 2", "--device cuda: "});
    all.push_back({"--device cuda:0 --prefill 1 --decode 1", "--device cuda:0: "});
  } else {
    // On a GPU: more workers than GPUs, and shares that add up past one GPU.
    all.push_back({"--device cuda --aggregated 64", "--device cuda: 64 workers need GPUs 0..63, and this machine has"});
    all.push_back({"--device cuda:0 --prefill 1 --decode 1 --gpu-memory-utilization 0.6",
                   "--gpu-memory-utilization 0.6 for each of 2 workers on GPU 0 is more than the whole GPU"});
  }
  for (const Case& c : all) {
    std::string out;
    const int rc = RunCommand(absl::StrCat(*bin, " up --port 0 --run-dir ", dir_, " ", c.flags), &out);
    EXPECT_NE(rc, 0) << c.flags;
    EXPECT_THAT(out, HasSubstr(c.message)) << c.flags;
    EXPECT_THAT(out, Not(HasSubstr("stopping"))) << c.flags << ": refused only after starting processes";
  }
  {
    // A router port in use is refused before anything starts.
    const int taken = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(bind(taken, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(listen(taken, 1), 0);
    socklen_t len = sizeof(addr);
    getsockname(taken, reinterpret_cast<sockaddr*>(&addr), &len);
    const int port = ntohs(addr.sin_port);
    std::string out;
    EXPECT_NE(RunCommand(absl::StrCat(*bin, " up --port ", port, " --run-dir ", dir_), &out), 0);
    EXPECT_THAT(out, HasSubstr(absl::StrCat("--port ", port, ": 127.0.0.1:", port, " is in use")));
    close(taken);
  }
  std::string out;
  EXPECT_NE(RunCommand(absl::StrCat(*bin, " up --port 0 --run-dir /proc/no/such/dir"), &out), 0);
  EXPECT_THAT(out, HasSubstr("cannot create the run directory /proc/no/such/dir")) << out;
}

// A ready file left by an earlier run (a reused run directory, a cached image
// root) is removed as up starts, whether or not this start then succeeds, so
// it never outlives the run it announced. (Who starts up and polls the file
// still removes it first: up can only remove it once it runs.)
TEST_F(UpCommandTest, AStaleReadyFileIsRemovedBeforeStarting) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  const std::string ready = dir_ + "/url";
  std::ofstream(ready) << "http://127.0.0.1:1\n";
  std::string out;
  EXPECT_NE(RunCommand(absl::StrCat(*bin, " up --port 0 --run-dir ", dir_, " --decode 0 --ready-file ", ready), &out),
            0);
  EXPECT_FALSE(std::filesystem::exists(ready)) << out;

  // A ready file that cannot be removed is an error naming the flag.
  EXPECT_NE(RunCommand(absl::StrCat(*bin, " up --port 0 --run-dir ", dir_, " --ready-file /proc/self"), &out), 0);
  EXPECT_THAT(out, HasSubstr("--ready-file")) << out;
}

class BenchCommandTest : public UpCommandTest {
 protected:
  // Runs `tandem bench --url URL <flags> --json F --html H`; the JSON.
  nlohmann::json Bench(const std::string& url, const std::string& flags, std::string* output) {
    return RunBench(url, absl::StrCat(flags, " --html ", dir_, "/bench.html"), dir_ + "/bench.json", output);
  }
};

TEST_F(BenchCommandTest, SharedPrefixOnSimulatedWorkersReportsEverything) {
  const std::string url = Start({"--engine", "sim", "--aggregated", "2", "--policy", "kv_cache_aware",
                                 "--worker-arg=--sim-step-ms", "--worker-arg=1"});
  ASSERT_FALSE(url.empty());
  std::string out;
  const nlohmann::json j = Bench(url,
                                 "--dataset shared-prefix --num-prompts 40 --num-groups 2 "
                                 "--prefix-len 256 --suffix-len 16 --output-len 8 "
                                 "--request-rate 200 --seed 1 --goodput ttft:60000 tpot:60000 "
                                 "--save-detailed",
                                 &out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["completed"], 40);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_GT(j["duration_s"].get<double>(), 0);
  EXPECT_EQ(j["total_output_tokens"], 40 * 8) << "the simulator runs every request to max_tokens";
  EXPECT_EQ(j["total_input_tokens"], 40 * (256 + 16));
  EXPECT_GT(j["request_throughput"].get<double>(), 0);
  EXPECT_GT(j["output_throughput"].get<double>(), 0);
  EXPECT_NEAR(j["goodput"].get<double>(), j["request_throughput"].get<double>(), 1e-6);
  for (const char* m : {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}) {
    // Inter-token gaps need two chunks of one stream; under load a stream's
    // tokens may all come in one chunk, and a statistic with no sample is
    // null (n/a), never 0.
    if (std::string(m) == "itl_ms" && j[m]["count"] == 0) {
      EXPECT_TRUE(j[m]["median"].is_null()) << out;
      continue;
    }
    for (const char* k : {"mean", "std", "median", "p90", "p95", "p99"}) {
      ASSERT_TRUE(j[m].contains(k) && j[m][k].is_number()) << m << "." << k << ": " << out;
    }
    EXPECT_GT(j[m]["median"].get<double>(), 0) << m;
  }
  // Two groups of 16 blocks each: after each group's first request, the
  // KV-aware router finds its prefix.
  ASSERT_TRUE(j.contains("router_prefix_hit_rate")) << out;
  EXPECT_GT(j["router_prefix_hit_rate"].get<double>(), 0.8);
  EXPECT_THAT(out, HasSubstr("Serving Benchmark Result"));
  EXPECT_THAT(out, HasSubstr("Router prefix cache hit rate:"));
  // --save-detailed: every request, in send order, adding up to the totals.
  ASSERT_TRUE(j.contains("requests") && j["requests"].is_array()) << out;
  ASSERT_EQ(j["requests"].size(), 40u);
  int64_t cached = 0, gaps = 0, textless = 0;
  double last_sent = 0;
  for (const nlohmann::json& r : j["requests"]) {
    EXPECT_TRUE(r["ok"].get<bool>());
    EXPECT_EQ(r["prompt_tokens"], 256 + 16);
    EXPECT_EQ(r["output_tokens"], 8);
    EXPECT_GE(r["sent_s"].get<double>(), last_sent);
    last_sent = r["sent_s"].get<double>();
    cached += r["cached_tokens"].get<int64_t>();
    if (r["ttft_ms"].is_null()) {
      // The simulator's tokens are random ids; eight that decode to no text
      // (special or partial-byte tokens) give no token-bearing chunk, and a
      // TTFT measured on text is then undefined (null, never 0).
      EXPECT_TRUE(r["itl_ms"].empty()) << r;
      ++textless;
      continue;
    }
    EXPECT_GT(r["ttft_ms"].get<double>(), 0);
    EXPECT_GE(r["e2e_ms"].get<double>(), r["ttft_ms"].get<double>());
    EXPECT_LE(r["itl_ms"].size(), 7u);  // chunks may carry several tokens
    gaps += static_cast<int64_t>(r["itl_ms"].size());
  }
  EXPECT_LE(textless, 4);
  EXPECT_EQ(gaps, j["itl_ms"]["count"].get<int64_t>());
  EXPECT_EQ(cached, j["total_cached_tokens"].get<int64_t>());
  EXPECT_GT(cached, 0);
  std::ifstream html(dir_ + "/bench.html");
  const std::string page((std::istreambuf_iterator<char>(html)), {});
  EXPECT_THAT(page, HasSubstr("<svg"));

  // Requests the server refuses are failures with the server's reason.
  const nlohmann::json refused =
      Bench(url, "--dataset random --num-prompts 2 --random-input-len 5000 --max-failure-rate 1", &out);
  ASSERT_TRUE(refused.is_object()) << out;
  EXPECT_EQ(refused["completed"], 0);
  EXPECT_EQ(refused["failed"], 2);
  EXPECT_THAT(out, HasSubstr("HTTP 400: the prompt has 5000 tokens"));
}

TEST_F(BenchCommandTest, MultiTurnChatSessionsReuseTheirHistory) {
  const std::string url = Start({"--engine", "sim", "--aggregated", "2", "--policy", "sticky_session",
                                 "--worker-arg=--sim-step-ms", "--worker-arg=1"});
  ASSERT_FALSE(url.empty());
  std::string out;
  const nlohmann::json j = Bench(url,
                                 "--endpoint chat --dataset multi-turn --num-prompts 12 --turns 4 "
                                 "--system-len 64 --user-len 32 --output-len 8 --max-concurrency 2 "
                                 "--save-detailed",
                                 &out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["completed"], 12);
  EXPECT_EQ(j["failed"], 0);
  // Later turns resend the history their session's worker holds.
  EXPECT_GT(j["router_prefix_hit_rate"].get<double>(), 0.3) << out;
  // --save-detailed names each request's session, turn and worker: 3
  // sessions of 4 turns, each turn's prompt longer than the one before, and
  // (sticky sessions) every later turn on its session's worker, finding the
  // history cached.
  ASSERT_EQ(j["requests"].size(), 12u) << out;
  std::map<int64_t, std::vector<nlohmann::json>> sessions;
  for (const nlohmann::json& r : j["requests"]) sessions[r["session"].get<int64_t>()].push_back(r);
  ASSERT_EQ(sessions.size(), 3u);
  std::set<std::string> workers;
  for (const nlohmann::json& r : j["requests"]) workers.insert(r.value("worker", ""));
  EXPECT_EQ(workers.size(), 2u) << "3 sessions on 2 workers";
  EXPECT_EQ(workers.count(""), 0u);
  for (auto& [id, turns] : sessions) {
    ASSERT_EQ(turns.size(), 4u) << "session " << id;
    for (int t = 0; t < 4; ++t) {
      EXPECT_EQ(turns[t]["turn"], t) << "session " << id;
      if (t == 0) continue;
      EXPECT_GT(turns[t]["prompt_tokens"].get<int64_t>(), turns[t - 1]["prompt_tokens"].get<int64_t>());
      EXPECT_GT(turns[t]["sent_s"].get<double>(), turns[t - 1]["sent_s"].get<double>());
      EXPECT_GT(turns[t]["cached_tokens"].get<int64_t>(), 0) << "session " << id << " turn " << t;
      EXPECT_EQ(turns[t]["worker"], turns[0]["worker"]) << "session " << id << " turn " << t;
    }
  }
}

// --common-prefix-len: every session's system prompt starts with the same
// tokens, so on one worker a new session's first turn finds them cached.
TEST_F(BenchCommandTest, MultiTurnCommonPrefixIsCachedAcrossSessions) {
  const std::string url =
      Start({"--engine", "sim", "--aggregated", "1", "--worker-arg=--sim-step-ms", "--worker-arg=1"});
  ASSERT_FALSE(url.empty());
  std::string out;
  const nlohmann::json j = Bench(url,
                                 "--endpoint chat --dataset multi-turn --num-prompts 6 --turns 2 "
                                 "--common-prefix-len 128 --system-len 16 --user-len 16 "
                                 "--output-len 4 --max-concurrency 1 --save-detailed",
                                 &out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["completed"], 6);
  ASSERT_EQ(j["requests"].size(), 6u) << out;
  int first_turns = 0;
  for (const nlohmann::json& r : j["requests"]) {
    if (r["turn"] != 0) continue;
    const int64_t cached = r["cached_tokens"].get<int64_t>();
    if (first_turns++ == 0) {
      EXPECT_EQ(cached, 0) << "the first session is cold";
    } else {
      // 128 drawn tokens re-encode to ~240 as chat text: at least 4 blocks.
      EXPECT_GE(cached, 64) << "session " << r["session"] << out;
    }
  }
  EXPECT_EQ(first_turns, 3);
}

TEST_F(BenchCommandTest, KeepAliveReusesConnectionsAcrossRequests) {
  const std::string url =
      Start({"--engine", "sim", "--aggregated", "1", "--worker-arg=--sim-step-ms", "--worker-arg=1"});
  ASSERT_FALSE(url.empty());
  const std::string series = "tandem_router_http_connections_total";
  auto accepted = [&] { return ScrapeMetric(url, series).value_or(-1); };
  std::string out;
  // 30 requests, at most 2 at a time: 2 request connections (+ the client's
  // GET /v1/models and two /metrics reads, + this test's scrape).
  const double before = accepted();
  ASSERT_GE(before, 0) << "no " << series;
  nlohmann::json j = Bench(url,
                           "--num-prompts 30 --random-input-len 32 --random-output-len 4 "
                           "--max-concurrency 2",
                           &out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["completed"], 30);
  EXPECT_LE(accepted() - before, 2 + 3 + 1) << out;

  // --no-keep-alive: a connection per request.
  const double mid = accepted();
  j = Bench(url,
            "--num-prompts 30 --random-input-len 32 --random-output-len 4 "
            "--max-concurrency 2 --no-keep-alive",
            &out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["completed"], 30);
  EXPECT_GE(accepted() - mid, 30 + 1);
}

// Saturation on instant workers: 32 streams at once, tokens as fast as the
// worker makes them, so that every stage of the router (its HTTP threads, its
// gRPC poller, a connection's next request behind the previous response)
// races every other. Every request completes and the router stays up.
TEST_F(BenchCommandTest, SaturationOnInstantWorkersLosesNothing) {
  const std::string url = Start({"--engine", "sim", "--aggregated", "1", "--worker-arg=--sim-step-ms=0",
                                 "--worker-arg=--sim-prefill-us-per-token=0", "--worker-arg=--sim-decode-us-per-seq=0",
                                 "--worker-arg=--sim-context-ns-per-token=0"});
  ASSERT_FALSE(url.empty());
  for (int round = 0; round < 3; ++round) {
    std::string out;
    const nlohmann::json j = Bench(url,
                                   absl::StrCat("--num-prompts 1000 --random-input-len 128 --random-output-len 16 "
                                                "--prompt-as-text --request-rate inf --max-concurrency 32 --seed ",
                                                round),
                                   &out);
    ASSERT_TRUE(j.is_object()) << "round " << round << ": " << out;
    EXPECT_EQ(j["completed"], 1000) << "round " << round << ": " << out;
    EXPECT_EQ(j["failed"], 0) << "round " << round << ": " << out;
  }
}

TEST_F(BenchCommandTest, UnreachableServerAndBadFlagsAreClearErrors) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok());
  std::string out;
  EXPECT_NE(RunCommand(*bin + " bench --url http://127.0.0.1:1 --num-prompts 2", &out), 0);
  EXPECT_THAT(out, HasSubstr("/v1/models"));
  EXPECT_NE(RunCommand(*bin + " bench --url https://example.com:443", &out), 0);
  EXPECT_THAT(out, HasSubstr("https is not supported"));
  EXPECT_NE(RunCommand(*bin + " bench --url http://127.0.0.1:1 --request-rate fast", &out), 0);
  EXPECT_THAT(out, HasSubstr("--request-rate"));
  EXPECT_NE(RunCommand(*bin + " bench --url http://127.0.0.1:1 --goodput ttft=5", &out), 0);
  EXPECT_THAT(out, HasSubstr("--goodput"));
  EXPECT_NE(RunCommand(*bin + " bench --url http://127.0.0.1:1 --save-detailed", &out), 0);
  EXPECT_THAT(out, HasSubstr("--json"));
  EXPECT_NE(RunCommand(*bin + " bench", &out), 0);
  EXPECT_THAT(out, HasSubstr("give --url"));
}

}  // namespace
}  // namespace tandem::testing
