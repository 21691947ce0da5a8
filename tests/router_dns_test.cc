// DNS discovery end to end: a router whose decode pool is
//   discovery: {dns: workers.tandem.test, port: P, interval_s: 1}
// follows the name's A records as they are added and removed, as behind a
// Kubernetes headless Service: a new record's worker starts receiving
// requests, a removed record's worker (still running) stops.
//
// Everything but the test runs in one network namespace: dnsmasq serving the
// name from a hosts file on 127.0.0.1 (the namespace's /etc/resolv.conf,
// which `ip netns exec` bind-mounts from /etc/netns/<ns>/resolv.conf; the
// host's resolver is untouched), three workers on the same port at their own
// addresses, and the router. A veth pair joins the namespace to the test,
// which talks to the router over HTTP and to the workers over gRPC.
//
//   test (root ns) 10.N.3.1 --veth-- [ns: router .10, workers .11 .12 .13,
//                                          dnsmasq on 127.0.0.1]
//
// Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`) and dnsmasq
// (Debian's dnsmasq-base); skipped with the reason otherwise.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tests/testing/http_client.h"
#include "tests/testing/worker_process.h"

namespace tandem {
namespace {

using namespace ::tandem::testing;  // NOLINT: the helpers of every test here
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr const char* kIp = "/usr/sbin/ip";
constexpr const char* kDnsmasq = "/usr/sbin/dnsmasq";
constexpr const char* kName = "workers.tandem.test";
constexpr int kWorkerPort = 50051;  // every worker's: the namespace is fresh
constexpr int kRouterHost = 10;     // the router's address is <prefix>10
constexpr int kWorkerHosts[] = {11, 12, 13};
// Discovery resolves every second and a new worker is admitted at its first
// health check (every 0.5 s); this leaves room for a loaded machine.
constexpr seconds kFollowTimeout(10);
// Each check may send requests: poll gently.
constexpr milliseconds kPoll(100);

// A network namespace with a veth to the root namespace and dnsmasq inside
// answering for kName from a hosts file the test rewrites. Names and the
// subnet carry the pid, so concurrent runs (other build trees) do not
// collide. Torn down in the destructor.
class DnsNamespace {
 public:
  static std::unique_ptr<DnsNamespace> Create(std::string* why) {
    auto n = std::unique_ptr<DnsNamespace>(new DnsNamespace());
    const int pid = static_cast<int>(getpid());
    const std::string tag = absl::StrCat(pid % 100000);
    n->ns_ = "tnddns" + tag;
    n->root_if_ = "dnsr" + tag;
    const std::string ns_if = "dnsn" + tag;
    n->prefix_ = absl::StrCat("10.", 16 + pid % 200, ".3.");  // netns_disagg_test uses .0-.2
    n->etc_dir_ = "/etc/netns/" + n->ns_;
    std::vector<std::string> cmds = {
        absl::StrCat(kIp, " netns add ", n->ns_),
        absl::StrCat(kIp, " -n ", n->ns_, " link set lo up"),
        absl::StrCat(kIp, " link add ", n->root_if_, " type veth peer name ", ns_if),
        absl::StrCat(kIp, " link set ", ns_if, " netns ", n->ns_),
        absl::StrCat(kIp, " addr add ", n->prefix_, "1/24 dev ", n->root_if_),
        absl::StrCat(kIp, " link set ", n->root_if_, " up"),
        absl::StrCat(kIp, " -n ", n->ns_, " link set ", ns_if, " up"),
    };
    for (int host : {kRouterHost, kWorkerHosts[0], kWorkerHosts[1], kWorkerHosts[2]}) {
      cmds.push_back(absl::StrCat(kIp, " -n ", n->ns_, " addr add ", n->Address(host), "/24 dev ", ns_if));
    }
    if (!RunCommands(cmds, why)) return nullptr;
    // The namespace's resolver asks the dnsmasq below, and only it.
    std::error_code ec;
    std::filesystem::create_directories(n->etc_dir_, ec);
    if (ec) {
      *why = absl::StrCat("cannot create ", n->etc_dir_, ": ", ec.message());
      return nullptr;
    }
    if (!(std::ofstream(n->etc_dir_ + "/resolv.conf") << "nameserver 127.0.0.1\n")) {
      *why = absl::StrCat("cannot write ", n->etc_dir_, "/resolv.conf");
      return nullptr;
    }
    char dir[] = "/tmp/tandem_dns_XXXXXX";
    if (mkdtemp(dir) == nullptr) {
      *why = "mkdtemp failed";
      return nullptr;
    }
    n->tmp_dir_ = dir;
    n->hosts_file_ = n->tmp_dir_ + "/hosts";
    return n;
  }

  ~DnsNamespace() {
    if (dnsmasq_.has_value()) dnsmasq_->Stop(seconds(5));
    // The root end first: a namespace a process still holds outlives `netns
    // del`, and with it its veth's peer.
    RunCommand(absl::StrCat(kIp, " link del ", root_if_));
    RunCommand(absl::StrCat(kIp, " netns del ", ns_));
    std::error_code ignored;
    std::filesystem::remove_all(etc_dir_, ignored);
    if (!tmp_dir_.empty()) std::filesystem::remove_all(tmp_dir_, ignored);
  }

  // Runs a process inside the namespace.
  LaunchOptions Launch() const { return LaunchOptions{.wrapper = {kIp, "netns", "exec", ns_}}; }
  std::string Address(int host) const { return absl::StrCat(prefix_, host); }
  std::string WorkerAddress(int host) const { return absl::StrCat(prefix_, host, ":", kWorkerPort); }

  // Starts dnsmasq with kName resolving to `hosts`; returns once it answers.
  ::testing::AssertionResult StartDns(const std::vector<int>& hosts) {
    if (!WriteHosts(hosts)) return ::testing::AssertionFailure() << "cannot write " << hosts_file_;
    // In the foreground, authoritative for tandem.test (so an AAAA query gets
    // NODATA, not REFUSED for want of an upstream), nothing cached: hosts
    // entries have TTL 0 and SIGHUP re-reads the file.
    absl::StatusOr<ChildProcess> dnsmasq =
        ChildProcess::Spawn({kIp, "netns", "exec", ns_, kDnsmasq, "--keep-in-foreground", "--conf-file=/dev/null",
                             "--no-resolv", "--no-hosts", "--addn-hosts=" + hosts_file_, "--local=/tandem.test/",
                             "--listen-address=127.0.0.1", "--bind-interfaces", "--port=53", "--user=root",
                             "--local-ttl=0", "--pid-file=" + tmp_dir_ + "/dnsmasq.pid", "--log-facility=-"});
    if (!dnsmasq.ok()) return ::testing::AssertionFailure() << dnsmasq.status();
    dnsmasq_.emplace(*std::move(dnsmasq));
    return WaitForRecords(hosts);
  }

  // Makes kName resolve to exactly `hosts`: rewrites the hosts file and sends
  // dnsmasq SIGHUP (safe: it has answered, so its handlers are installed).
  // REQUIRES: StartDns succeeded.
  ::testing::AssertionResult SetRecords(const std::vector<int>& hosts) {
    if (!WriteHosts(hosts)) return ::testing::AssertionFailure() << "cannot write " << hosts_file_;
    dnsmasq_->Signal(SIGHUP);
    return WaitForRecords(hosts);
  }

 private:
  DnsNamespace() = default;

  // Waits until getaddrinfo in the namespace (the router's path) resolves
  // kName to exactly `hosts`.
  ::testing::AssertionResult WaitForRecords(const std::vector<int>& hosts) {
    std::set<std::string> want;
    for (int h : hosts) want.insert(Address(h));
    std::set<std::string> got;
    const auto deadline = std::chrono::steady_clock::now() + seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      if (!dnsmasq_->Running()) return ::testing::AssertionFailure() << "dnsmasq exited";
      got = Resolve();
      if (got == want) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(milliseconds(50));
    }
    return ::testing::AssertionFailure() << kName << " resolves to {" << absl::StrJoin(got, ", ") << "}, not {"
                                         << absl::StrJoin(want, ", ") << "}";
  }

  bool WriteHosts(const std::vector<int>& hosts) const {
    const std::string tmp = hosts_file_ + ".tmp";
    {
      std::ofstream out(tmp);
      for (int h : hosts) out << Address(h) << " " << kName << "\n";
      if (!out) return false;
    }
    std::error_code ec;
    std::filesystem::rename(tmp, hosts_file_, ec);
    return !ec;
  }

  // kName's addresses as getaddrinfo in the namespace sees them.
  std::set<std::string> Resolve() const {
    std::string out;
    std::set<std::string> addresses;
    if (RunCommand(absl::StrCat(kIp, " netns exec ", ns_, " getent ahosts ", kName), &out) != 0) {
      return addresses;
    }
    std::istringstream lines(out);
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream fields(line);
      std::string address;
      if (fields >> address) addresses.insert(address);
    }
    return addresses;
  }

  std::string ns_, root_if_, prefix_, etc_dir_, tmp_dir_, hosts_file_;
  std::optional<ChildProcess> dnsmasq_;
};

nlohmann::json Chat(int i) {
  return {{"model", "tiny"},
          {"messages", nlohmann::json::array({{{"role", "user"}, {"content", absl::StrCat("Hello number ", i)}}})},
          {"max_tokens", 4}};
}

// Sends `n` chat requests one after another; the decode worker of each (its
// x-tandem-decode-worker header). A request that fails is a test failure.
std::vector<std::string> Round(const std::string& url, int n) {
  static int counter = 0;
  std::vector<std::string> workers;
  for (int i = 0; i < n; ++i) {
    HttpResponse r = HttpPost(url, "/v1/chat/completions", Chat(counter++).dump());
    EXPECT_EQ(r.status, 200) << r.error << r.body;
    workers.push_back(r.Header("x-tandem-decode-worker"));
  }
  return workers;
}

std::set<std::string> AsSet(const std::vector<std::string>& v) { return {v.begin(), v.end()}; }

// The decode pool's workers listed on /metrics, with their
// tandem_router_worker_healthy value.
std::map<std::string, double> DecodeWorkersOnMetrics(const std::string& url) {
  const std::string prefix = "tandem_router_worker_healthy{pool=\"decode\",worker=\"";
  std::map<std::string, double> workers;
  HttpResponse r = HttpGet(url, "/metrics");
  EXPECT_EQ(r.status, 200) << r.error;
  std::istringstream lines(r.body);
  std::string line;
  while (std::getline(lines, line)) {
    if (!absl::StartsWith(line, prefix)) continue;
    const size_t end = line.find("\"}", prefix.size());
    if (end == std::string::npos) continue;
    workers[line.substr(prefix.size(), end - prefix.size())] = std::stod(line.substr(end + 3));
  }
  return workers;
}

std::string Describe(const std::map<std::string, double>& workers) {
  std::vector<std::string> parts;
  for (const auto& [address, healthy] : workers) {
    parts.push_back(absl::StrCat(address, "=", healthy));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

int64_t FinishedRequests(WorkerProcess& w) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
  tandem::v1::LoadReport load;
  const grpc::Status s = w.stub().GetLoad(&ctx, tandem::v1::LoadRequest(), &load);
  EXPECT_TRUE(s.ok()) << w.address() << ": " << s.error_message();
  return load.finished_requests();
}

TEST(RouterDnsTest, DecodePoolFollowsTheNamesRecords) {
  if (geteuid() != 0) {
    GTEST_SKIP() << "network namespaces need root; this test runs as uid " << geteuid();
  }
  if (access(kDnsmasq, X_OK) != 0) {
    GTEST_SKIP() << kDnsmasq << " is missing (Debian: apt-get install dnsmasq-base)";
  }
  std::string why;
  std::unique_ptr<DnsNamespace> ns = DnsNamespace::Create(&why);
  if (ns == nullptr) GTEST_SKIP() << "cannot set up the network namespace: " << why;
  const std::string w11 = ns->WorkerAddress(11), w12 = ns->WorkerAddress(12), w13 = ns->WorkerAddress(13);
  ASSERT_TRUE(ns->StartDns({11, 12}));

  // Three workers on one port, each at its own address; the third has no
  // record yet.
  std::map<std::string, std::unique_ptr<WorkerProcess>> workers;
  for (int host : kWorkerHosts) {
    absl::StatusOr<std::unique_ptr<WorkerProcess>> w =
        WorkerProcess::Start({"--model", "builtin:tiny", "--kv-cache-memory", "8MiB", "--role", "both", "--host",
                              ns->Address(host), "--port", absl::StrCat(kWorkerPort)},
                             seconds(30), ns->Launch());
    ASSERT_TRUE(w.ok()) << w.status();
    workers[(*w)->address()] = *std::move(w);
  }
  ASSERT_EQ(workers.count(w11) + workers.count(w12) + workers.count(w13), 3u);

  const std::string yaml = absl::StrCat(
      "listener:\n  host: ", ns->Address(kRouterHost), "\n  port: 0\n",
      "model:\n  served_name: tiny\n  tokenizer: builtin\n", "pools:\n  decode:\n    discovery: {dns: ", kName,
      ", port: ", kWorkerPort, ", interval_s: 1}\n    policy:\n      name: round_robin\n",
      "disaggregation:\n  mode: never\n", "health:\n  interval_s: 0.5\n  timeout_s: 0.5\n", "tls:\n  mode: insecure\n",
      // The x-tandem-decode-worker header says where each request went.
      "debug:\n  worker_details: true\n");
  absl::StatusOr<std::unique_ptr<RouterProcess>> router = RouterProcess::Start(yaml, seconds(30), ns->Launch());
  ASSERT_TRUE(router.ok()) << router.status() << "\n" << yaml;
  const std::string url = (*router)->url();
  auto healthy_on_metrics = [&](const std::set<std::string>& want) {
    std::map<std::string, double> listed = DecodeWorkersOnMetrics(url);
    if (listed.size() != want.size()) return false;
    for (const std::string& w : want) {
      if (listed.count(w) == 0 || listed[w] != 1) return false;
    }
    return true;
  };

  // Two records: both their workers serve, the third gets nothing.
  ASSERT_TRUE(WaitUntil(
      [&] {
        return healthy_on_metrics({w11, w12});
      },
      seconds(30), kPoll))
      << "decode workers on /metrics: " << Describe(DecodeWorkersOnMetrics(url));
  EXPECT_EQ(AsSet(Round(url, 8)), std::set<std::string>({w11, w12}));
  EXPECT_EQ(FinishedRequests(*workers[w13]), 0);

  // A record is added: its worker joins within a few resolutions.
  ASSERT_TRUE(ns->SetRecords({11, 12, 13}));
  EXPECT_TRUE(WaitUntil([&] { return Round(url, 1)[0] == w13; }, kFollowTimeout, kPoll))
      << w13 << " got no request " << kFollowTimeout.count() << " s after its record was added";
  EXPECT_EQ(AsSet(Round(url, 9)), std::set<std::string>({w11, w12, w13}));
  EXPECT_TRUE(healthy_on_metrics({w11, w12, w13}))
      << "decode workers on /metrics: " << Describe(DecodeWorkersOnMetrics(url));
  EXPECT_GT(FinishedRequests(*workers[w13]), 0);

  // A record is removed: its worker (still running) gets no more requests.
  // Round robin over three healthy workers reaches each within 3 requests,
  // so a round of 4 without it means it has left the pool.
  ASSERT_TRUE(ns->SetRecords({12, 13}));
  EXPECT_TRUE(WaitUntil([&] { return AsSet(Round(url, 4)).count(w11) == 0; }, kFollowTimeout, kPoll))
      << w11 << " still gets requests " << kFollowTimeout.count() << " s after its record was removed";
  const int64_t w11_finished = FinishedRequests(*workers[w11]);
  EXPECT_EQ(AsSet(Round(url, 8)), std::set<std::string>({w12, w13}));
  EXPECT_EQ(FinishedRequests(*workers[w11]), w11_finished);
  EXPECT_FALSE(workers[w11]->Wait(milliseconds(0)).ok()) << w11 << " should still be running";
  EXPECT_TRUE(WaitUntil(
      [&] {
        return healthy_on_metrics({w12, w13});
      },
      kFollowTimeout, kPoll))
      << "decode workers on /metrics: " << Describe(DecodeWorkersOnMetrics(url));

  // Every record is removed (no ready pods): the name no longer exists, the
  // pool empties and the router says so, rather than keep routing to the
  // last members. A record back, it serves again.
  ASSERT_TRUE(ns->SetRecords({}));
  EXPECT_TRUE(WaitUntil([&] { return HttpGet(url, "/health").status == 503; }, kFollowTimeout, kPoll))
      << "/health still ready " << kFollowTimeout.count() << " s after the name lost every record";
  const HttpResponse none =
      HttpPost(url, "/v1/chat/completions",
               R"({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})");
  EXPECT_EQ(none.status, 503) << none.body;
  ASSERT_TRUE(ns->SetRecords({13}));
  EXPECT_TRUE(WaitUntil([&] { return HttpGet(url, "/health").status == 200; }, kFollowTimeout, kPoll));
  EXPECT_EQ(AsSet(Round(url, 3)), std::set<std::string>({w13}));
  // Lookups are counted; none failed (a missing name is an answer).
  const std::string metrics = HttpGet(url, "/metrics").body;
  EXPECT_NE(metrics.find("tandem_router_dns_lookups_total{result=\"failed\"} 0\n"), std::string::npos) << metrics;

  // The router stops first and cleanly, then the workers, then the namespace.
  const int status = (*router)->Stop();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the router did not exit cleanly (wait status " << status << "): see its log above";
}

}  // namespace
}  // namespace tandem
