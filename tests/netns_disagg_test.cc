// Disaggregated serving between two network namespaces: the prefill and
// decode workers each run in their own namespace with their own address,
// joined by a veth pair; the KV moves over UCX's tcp transport on that pair
// and the prefill worker calls KvReady across it, as between two hosts.
// The test reaches each worker over a second veth into its namespace.
//
//   test (root ns) --ctl veth-- [prefill ns] tp ==pair== td [decode ns] --ctl veth-- test
//
// Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`); skipped with
// the reason where namespaces cannot be created.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/testing/worker_client.h"
#include "tests/testing/worker_process.h"

namespace tandem {
namespace {

using namespace ::tandem::testing;  // NOLINT: the helpers of every test here
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr const char* kIp = "/usr/sbin/ip";

// Two namespaces joined by a veth pair, each with a control veth to the root
// namespace. Names and subnets carry the pid, so concurrent runs (other
// build trees) do not collide. Torn down in the destructor.
class Topology {
 public:
  static std::unique_ptr<Topology> Create(std::string* why) {
    auto t = std::unique_ptr<Topology>(new Topology());
    const int pid = static_cast<int>(getpid());
    const std::string tag = absl::StrCat(pid % 100000);
    t->prefill_ns_ = "tndp" + tag;
    t->decode_ns_ = "tndd" + tag;
    t->prefill_if_ = "tp" + tag;
    t->decode_if_ = "td" + tag;
    const int net = 16 + pid % 200;  // 10.<net>.{0,1,2}.0/24
    t->pair_prefix_ = absl::StrCat("10.", net, ".0.");
    const std::string ctl_p = absl::StrCat("10.", net, ".1.");
    const std::string ctl_d = absl::StrCat("10.", net, ".2.");
    t->ctl_root_p_ = "cr" + tag + "p";
    t->ctl_root_d_ = "cr" + tag + "d";
    t->prefill_ctl_ = ctl_p + "2";
    t->decode_ctl_ = ctl_d + "2";
    const std::string ip = kIp;
    const std::vector<std::string> cmds = {
        ip + " netns add " + t->prefill_ns_,
        ip + " netns add " + t->decode_ns_,
        // The pair the workers talk over.
        ip + " link add " + t->prefill_if_ + " type veth peer name " + t->decode_if_,
        ip + " link set " + t->prefill_if_ + " netns " + t->prefill_ns_,
        ip + " link set " + t->decode_if_ + " netns " + t->decode_ns_,
        ip + " -n " + t->prefill_ns_ + " addr add " + t->pair_prefix_ + "1/24 dev " + t->prefill_if_,
        ip + " -n " + t->decode_ns_ + " addr add " + t->pair_prefix_ + "2/24 dev " + t->decode_if_,
        ip + " -n " + t->prefill_ns_ + " link set " + t->prefill_if_ + " up",
        ip + " -n " + t->decode_ns_ + " link set " + t->decode_if_ + " up",
        ip + " -n " + t->prefill_ns_ + " link set lo up",
        ip + " -n " + t->decode_ns_ + " link set lo up",
        // Control links from the root namespace (the test's gRPC only).
        ip + " link add cp" + tag + " type veth peer name cr" + tag + "p",
        ip + " link set cp" + tag + " netns " + t->prefill_ns_,
        ip + " addr add " + ctl_p + "1/24 dev cr" + tag + "p",
        ip + " link set cr" + tag + "p up",
        ip + " -n " + t->prefill_ns_ + " addr add " + ctl_p + "2/24 dev cp" + tag,
        ip + " -n " + t->prefill_ns_ + " link set cp" + tag + " up",
        ip + " link add cd" + tag + " type veth peer name cr" + tag + "d",
        ip + " link set cd" + tag + " netns " + t->decode_ns_,
        ip + " addr add " + ctl_d + "1/24 dev cr" + tag + "d",
        ip + " link set cr" + tag + "d up",
        ip + " -n " + t->decode_ns_ + " addr add " + ctl_d + "2/24 dev cd" + tag,
        ip + " -n " + t->decode_ns_ + " link set cd" + tag + " up",
    };
    if (!RunCommands(cmds, why)) return nullptr;
    return t;
  }

  ~Topology() {
    // The root ends first: a namespace a process still holds outlives `netns
    // del`, and with it its veths' peers.
    RunCommand(absl::StrCat(kIp, " link del ", ctl_root_p_));
    RunCommand(absl::StrCat(kIp, " link del ", ctl_root_d_));
    RunCommand(absl::StrCat(kIp, " netns del ", prefill_ns_));
    RunCommand(absl::StrCat(kIp, " netns del ", decode_ns_));
  }

  // Launch options for a worker in the prefill or decode namespace: UCX uses
  // the pair's interface only.
  LaunchOptions Launch(bool prefill) const {
    return LaunchOptions{.wrapper = {kIp, "netns", "exec", prefill ? prefill_ns_ : decode_ns_, "/usr/bin/env",
                                     "UCX_NET_DEVICES=" + (prefill ? prefill_if_ : decode_if_)},
                         .connect_host = prefill ? prefill_ctl_ : decode_ctl_};
  }
  // The decode worker's address on the pair, as the prefill worker reaches it.
  std::string DecodeOnPair(int port) const { return absl::StrCat(pair_prefix_, "2:", port); }
  // Bytes the decode worker's end of the pair has received.
  int64_t DecodePairRxBytes() const {
    std::string out;
    RunCommand(
        absl::StrCat(kIp, " netns exec ", decode_ns_, " cat /sys/class/net/", decode_if_, "/statistics/rx_bytes"),
        &out);
    return std::atoll(out.c_str());
  }

 private:
  Topology() = default;
  std::string prefill_ns_, decode_ns_, prefill_if_, decode_if_, pair_prefix_, prefill_ctl_, decode_ctl_, ctl_root_p_,
      ctl_root_d_;
};

// The two namespaces, and workers in them over one KV transport.
class NetnsDisaggTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root; this test runs as uid " << geteuid();
    std::string why;
    topo_ = Topology::Create(&why);
    if (topo_ == nullptr) GTEST_SKIP() << "cannot build the two-namespace topology: " << why;
  }

  // A worker of the tiny model in the prefill (or the decode) namespace,
  // listening on every address, with `transport_` and `extra`.
  absl::StatusOr<std::unique_ptr<WorkerProcess>> StartIn(bool prefill_ns, const std::vector<std::string>& extra) {
    std::vector<std::string> flags = {"--model", "builtin:tiny", "--kv-cache-memory", "8MiB", "--host", "0.0.0.0"};
    flags.insert(flags.end(), transport_.begin(), transport_.end());
    flags.insert(flags.end(), extra.begin(), extra.end());
    return WorkerProcess::Start(flags, seconds(30), topo_->Launch(prefill_ns));
  }
  // Insecure: the decode worker's address is in another namespace, off
  // loopback, so the prefill worker must be allowed to dial it.
  absl::StatusOr<std::unique_ptr<WorkerProcess>> StartPrefill(std::vector<std::string> extra = {},
                                                              const std::string& hold_timeout_ms = "3000") {
    std::vector<std::string> flags = {"--role",        "prefill",         "--kv-hold-timeout-ms",
                                      hold_timeout_ms, "--kv-peer-allow", "any"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return StartIn(true, flags);
  }
  absl::StatusOr<std::unique_ptr<WorkerProcess>> StartDecode(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--role", "decode", "--kv-quarantine-ms", "300"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return StartIn(false, flags);
  }

  // Six concurrent requests of mixed lengths (prompts MakePrompt(seed + i),
  // odd ones sampled with seed sample_seed + i) split between `prefill` and
  // `decode` across the pair: each matches `aggregated`'s output.
  void RunMixedRequests(WorkerProcess& prefill, WorkerProcess& decode, WorkerProcess& aggregated, uint32_t seed,
                        uint32_t sample_seed) {
    const int lengths[] = {5, 16, 70, 130, 257, 33};
    std::vector<v1::GenerateRequest> reqs;
    for (int i = 0; i < 6; ++i) {
      std::vector<int32_t> prompt = MakePrompt(seed + i, lengths[i]);
      reqs.push_back(i % 2 ? SampledRequest(prompt, 12, sample_seed + i) : GreedyRequest(prompt, 12));
      reqs.back().mutable_sampling()->set_ignore_eos(true);
    }
    const std::vector<Split> got =
        RunDisaggregatedConcurrently(prefill.stub(), decode.stub(), topo_->DecodeOnPair(decode.port()), reqs);
    for (size_t i = 0; i < reqs.size(); ++i) {
      const std::string what = absl::StrCat("request ", i);
      EXPECT_EQ(got[i].prefill.kv_transfer_error, "") << what;
      ExpectSameOutput(got[i].combined, Generate(aggregated.stub(), reqs[i]), what);
    }
  }

  std::unique_ptr<Topology> topo_;
  std::vector<std::string> transport_;
};

TEST_F(NetnsDisaggTest, WorkersInSeparateNamespacesOverUcxTcp) {
  transport_ = {"--kv-transport", "ucx", "--kv-transport-tls", "tcp"};
  absl::StatusOr<std::unique_ptr<WorkerProcess>> prefill = StartPrefill();
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  absl::StatusOr<std::unique_ptr<WorkerProcess>> decode = StartDecode();
  ASSERT_TRUE(decode.ok()) << decode.status();
  absl::StatusOr<std::unique_ptr<WorkerProcess>> aggregated =
      WorkerProcess::Start({"--model", "builtin:tiny", "--kv-cache-memory", "8MiB"});
  ASSERT_TRUE(aggregated.ok()) << aggregated.status();

  // Concurrent requests of mixed lengths match one worker's outputs.
  const int64_t rx_before = topo_->DecodePairRxBytes();
  RunMixedRequests(**prefill, **decode, **aggregated, 500, 40);
  const v1::LoadReport d = ExpectIdle((*decode)->stub(), "decode");
  EXPECT_EQ(d.kv_pulls(), 6);
  EXPECT_EQ(d.local_prefill_fallbacks(), 0);
  ExpectIdle((*prefill)->stub(), "prefill");
  // The KV crossed the pair (the decode end received at least its bytes).
  EXPECT_GE(topo_->DecodePairRxBytes() - rx_before, d.kv_bytes_pulled());

  // The prefill worker dies while the decode worker's pull is held back (a
  // delay fault): over tcp the pull fails, the decode worker prefills locally
  // and frees everything.
  absl::StatusOr<std::unique_ptr<WorkerProcess>> slow_decode = StartDecode({"--kv-fault", "delay_ms=1000"});
  ASSERT_TRUE(slow_decode.ok()) << slow_decode.status();
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(600, 90), 8);
  ReceiveStream receive((*slow_decode)->stub(), req, /*timeout_ms=*/10000);
  ASSERT_TRUE(receive.reserved());
  std::jthread send([&] {
    Generate((*prefill)->stub(), SendRequest(req, topo_->DecodeOnPair((*slow_decode)->port()), receive.reservation()),
             seconds(20));
  });
  // The pull is under way (held by the delay): kill the prefill worker.
  ASSERT_TRUE(WaitForPullInFlight((*slow_decode)->stub()));
  ::kill((*prefill)->pid(), SIGKILL);
  send.join();
  Output out = receive.Finish();
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  const Output reference = Generate((*aggregated)->stub(), req);
  EXPECT_EQ(out.tokens.size() + (out.includes_first_token ? 0 : 1), reference.tokens.size());
  const v1::LoadReport s = ExpectIdle((*slow_decode)->stub(), "decode after the kill", seconds(15));
  EXPECT_EQ(s.local_prefill_fallbacks(), 1);
}

// The same two namespaces over ucx_staged (send/receive through host
// staging, the path GPU pools take between hosts whose UCX has no CUDA
// transports): pushes across the veth pair match one worker's outputs, and
// a prefill worker killed after the JOIN makes the decode worker prefill
// locally at once.
TEST_F(NetnsDisaggTest, WorkersInSeparateNamespacesOverUcxStaged) {
  transport_ = {"--kv-transport", "ucx_staged", "--kv-delivery", "push", "--kv-transport-tls", "tcp"};
  absl::StatusOr<std::unique_ptr<WorkerProcess>> prefill = StartPrefill();
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  absl::StatusOr<std::unique_ptr<WorkerProcess>> decode = StartDecode();
  ASSERT_TRUE(decode.ok()) << decode.status();
  absl::StatusOr<std::unique_ptr<WorkerProcess>> aggregated =
      WorkerProcess::Start({"--model", "builtin:tiny", "--kv-cache-memory", "8MiB"});
  ASSERT_TRUE(aggregated.ok()) << aggregated.status();

  const int64_t rx_before = topo_->DecodePairRxBytes();
  RunMixedRequests(**prefill, **decode, **aggregated, 700, 60);
  const v1::LoadReport d = ExpectIdle((*decode)->stub(), "decode");
  EXPECT_EQ(d.kv_pushes_received(), 6);
  EXPECT_EQ(d.local_prefill_fallbacks(), 0);
  const v1::LoadReport p = ExpectIdle((*prefill)->stub(), "prefill");
  EXPECT_EQ(p.kv_pushes(), 6);
  EXPECT_GE(topo_->DecodePairRxBytes() - rx_before, p.kv_bytes_pushed());

  // The pusher killed while its push is held back (a delay fault).
  absl::StatusOr<std::unique_ptr<WorkerProcess>> slow_prefill =
      StartPrefill({"--kv-fault", "delay_ms=3000"}, /*hold_timeout_ms=*/"5000");
  ASSERT_TRUE(slow_prefill.ok()) << slow_prefill.status();
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(800, 90), 8);
  ReceiveStream receive((*decode)->stub(), req, /*timeout_ms=*/30000);
  ASSERT_TRUE(receive.reserved());
  std::jthread send([&] {
    Generate((*slow_prefill)->stub(), SendRequest(req, topo_->DecodeOnPair((*decode)->port()), receive.reservation()),
             seconds(20));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(800));  // joined, the push held back
  const auto killed = std::chrono::steady_clock::now();
  ::kill((*slow_prefill)->pid(), SIGKILL);
  send.join();
  Output out = receive.Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - killed, seconds(10)) << "the decode worker waited for its deadline";
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  const Output reference = Generate((*aggregated)->stub(), req);
  EXPECT_EQ(out.tokens.size() + (out.includes_first_token ? 0 : 1), reference.tokens.size());
  const v1::LoadReport s = ExpectIdle((*decode)->stub(), "decode after the kill", seconds(15));
  EXPECT_EQ(s.local_prefill_fallbacks(), 1);
}

}  // namespace
}  // namespace tandem
