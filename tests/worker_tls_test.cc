// Trust between components, through the real gRPC interface of `tandem
// worker` processes (docs/architecture.md, "Security"): mutual TLS under a
// cluster CA with roles in the certificates, the decode_address a prefill
// worker may dial (SSRF), and the bounds a decode worker puts on
// reservations (random ids and tokens, capped lifetimes, per-caller blocks).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/certificates.h"
#include "common/tls.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/router_test.h"
#include "tests/testing/worker_client.h"

namespace tandem::testing {
namespace {

using ::testing::HasSubstr;
namespace v1 = tandem::v1;

// A plain TCP listener on 127.0.0.1 that records what connects to it and
// every byte it receives, closing each connection after its first read (as
// a non-gRPC service would).
class TcpSink {
 public:
  TcpSink() {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    listen(fd_, 16);
    socklen_t len = sizeof addr;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Run(); });
  }
  ~TcpSink() {
    stop_ = true;
    thread_.join();
    close(fd_);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int connections() const { return connections_.load(); }
  std::string received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }

 private:
  void Run() {
    while (!stop_) {
      pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
      if (poll(&p, 1, 50) <= 0) continue;
      const int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      ++connections_;
      pollfd q{.fd = c, .events = POLLIN, .revents = 0};
      if (poll(&q, 1, 2000) > 0) {
        char buf[4096];
        const ssize_t n = read(c, buf, sizeof buf);
        if (n > 0) {
          std::lock_guard<std::mutex> lock(mu_);
          received_.append(buf, static_cast<size_t>(n));
        }
      }
      close(c);
    }
  }
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::mutex mu_;
  std::string received_;
  std::thread thread_;
};

class WorkerTlsTest : public RouterTest {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tandem_worker_tls.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    std::filesystem::create_directories(dir_ + "/cluster");
    std::filesystem::create_directories(dir_ + "/other");
    absl::StatusOr<tls::ClusterFiles> cluster = tls::WriteClusterCertificates(dir_ + "/cluster", 1);
    absl::StatusOr<tls::ClusterFiles> other = tls::WriteClusterCertificates(dir_ + "/other", 1);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    ASSERT_TRUE(other.ok()) << other.status();
    cluster_ = *cluster;
    other_ = *other;
  }
  void TearDown() override {
    RouterTest::TearDown();
    std::filesystem::remove_all(dir_);
  }

  // Flags of a TLS worker with the cluster's worker certificate.
  std::vector<std::string> TlsFlags(std::vector<std::string> extra = {}) const {
    std::vector<std::string> f = {"--tls-ca",           cluster_.worker.ca, "--tls-cert",
                                  cluster_.worker.cert, "--tls-key",        cluster_.worker.key};
    f.insert(f.end(), extra.begin(), extra.end());
    return f;
  }
  // A TLS worker whose helper stub() speaks as the router.
  WorkerProcess* StartTlsWorker(std::vector<std::string> extra) {
    std::vector<std::string> flags = TlsFlags({"--kv-cache-memory", "8MiB"});
    flags.insert(flags.end(), extra.begin(), extra.end());
    return StartWorker(flags, LaunchOptions{.client_tls = cluster_.router});
  }
  // A stub to `w` as the holder of `files` would reach it (nullopt: insecure).
  std::unique_ptr<v1::Worker::Stub> StubAs(WorkerProcess* w, const std::optional<tls::TlsFiles>& files) {
    if (!files.has_value()) {
      return v1::Worker::NewStub(tls::ChannelFactory::Insecure()->Create(w->address()));
    }
    absl::StatusOr<tls::TlsMaterial> m = tls::LoadTlsMaterial(*files, {.ca = "ca", .cert = "cert", .key = "key"});
    EXPECT_TRUE(m.ok()) << m.status();
    return v1::Worker::NewStub(tls::ChannelFactory::Mutual(*m)->Create(w->address()));
  }

  std::string dir_;
  tls::ClusterFiles cluster_;
  tls::ClusterFiles other_;
};

std::chrono::system_clock::time_point Soon() { return std::chrono::system_clock::now() + std::chrono::seconds(10); }

// Every method a caller tries on a worker it may not use; the status of each.
struct Attempts {
  grpc::Status clear, events, info, receive, generate;
};
Attempts TryRouterMethods(v1::Worker::Stub& stub) {
  Attempts a;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::ClearKvCacheResponse r;
    a.clear = stub.ClearKvCache(&ctx, v1::ClearKvCacheRequest(), &r);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::KvEventsRequest req;
    req.set_snapshot(true);
    auto reader = stub.StreamKvEvents(&ctx, req);
    v1::KvEventBatch batch;
    EXPECT_FALSE(reader->Read(&batch)) << "KV events reached an unauthorized caller";
    a.events = reader->Finish();
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::KvTransferInfo r;
    a.info = stub.GetKvTransferInfo(&ctx, v1::KvTransferInfoRequest(), &r);
    EXPECT_TRUE(r.address().empty()) << "the UCX address reached an unauthorized caller";
  }
  ReceiveStream receive(stub, GreedyRequest(MakePrompt(7, 64), 4), /*timeout_ms=*/60000);
  EXPECT_FALSE(receive.reserved()) << "an unauthorized caller holds a reservation";
  a.receive = receive.Finish().status;
  a.generate = Generate(stub, GreedyRequest(MakePrompt(8, 16), 2), std::chrono::seconds(10)).status;
  return a;
}

// 1. A TLS worker refuses callers without a certificate of its CA: no
//    handshake, so no method runs (its cache and blocks are untouched).
TEST_F(WorkerTlsTest, UnauthenticatedCallersReachNoMethod) {
  WorkerProcess* w = StartTlsWorker({"--role", "decode", "--kv-transport", "ucx", "--kv-transport-tls", "shm"});
  ASSERT_NE(w, nullptr);
  // The router (the helper's identity) fills the prefix cache.
  v1::GenerateRequest req = GreedyRequest(MakePrompt(1, 64), 4);
  ExpectWellFormed(Generate(w->stub(), req), "router's request");
  // (The finished request's blocks reach the load report with the engine's
  // next step, which may come a moment after the response under load.)
  bool cached = false;
  const v1::LoadReport before = WaitForLoad(
      w->stub(), [](const v1::LoadReport& l) { return l.cached_blocks() > 0; }, &cached, std::chrono::seconds(5));
  ASSERT_TRUE(cached) << "the prefix cache holds nothing after the router's request";

  for (const auto& [what, files] :
       {std::pair<std::string, std::optional<tls::TlsFiles>>{"insecure channel", std::nullopt},
        {"router certificate of another CA", other_.router}}) {
    SCOPED_TRACE(what);
    std::unique_ptr<v1::Worker::Stub> stranger = StubAs(w, files);
    const Attempts a = TryRouterMethods(*stranger);
    for (const grpc::Status& s : {a.clear, a.events, a.info, a.receive, a.generate}) {
      EXPECT_FALSE(s.ok());
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::HealthResponse health;
    EXPECT_FALSE(stranger->Health(&ctx, v1::HealthRequest(), &health).ok());
  }
  const v1::LoadReport after = GetLoad(w->stub());
  EXPECT_EQ(after.cached_blocks(), before.cached_blocks()) << "someone cleared the cache";
  EXPECT_EQ(after.reserved_requests(), 0);
  EXPECT_EQ(after.finished_requests(), before.finished_requests());
}

// 2. Roles: a worker certificate cannot call the router's methods, the
//    router's cannot call KvReady; each refusal is PERMISSION_DENIED, counted.
TEST_F(WorkerTlsTest, RolesLimitWhoCallsWhat) {
  WorkerProcess* w = StartTlsWorker({"--role", "decode", "--kv-transport", "ucx", "--kv-transport-tls", "shm"});
  ASSERT_NE(w, nullptr);
  std::unique_ptr<v1::Worker::Stub> as_worker = StubAs(w, cluster_.worker);
  const Attempts a = TryRouterMethods(*as_worker);
  for (const grpc::Status& s : {a.clear, a.events, a.info, a.receive, a.generate}) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("router role"));
  }
  // Health and load are for either role.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::HealthResponse health;
    EXPECT_TRUE(as_worker->Health(&ctx, v1::HealthRequest(), &health).ok());
  }
  // KvReady is a worker's call: the router's certificate is refused.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Soon());
    v1::KvReadyRequest req;
    req.set_reservation_id(1);
    v1::KvReadyResponse resp;
    const grpc::Status s = w->stub().KvReady(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("worker role"));
  }
  EXPECT_EQ(GetLoad(w->stub()).calls_denied(), 6);
  // The router itself is served.
  grpc::ClientContext ctx;
  ctx.set_deadline(Soon());
  v1::KvTransferInfo info;
  EXPECT_TRUE(w->stub().GetKvTransferInfo(&ctx, v1::KvTransferInfoRequest(), &info).ok());
}

// 3. A disaggregated request end to end over mutual TLS: a router process
//    with the router certificate, prefill and decode workers that verify
//    each other (the prefill worker's KvReady to the decode worker).
TEST_F(WorkerTlsTest, DisaggregatedRequestOverMutualTls) {
  const std::vector<std::string> split = {"--kv-transport", "ucx", "--kv-transport-tls", "shm"};
  std::vector<std::string> pf = {"--role", "prefill"}, df = {"--role", "decode"};
  pf.insert(pf.end(), split.begin(), split.end());
  df.insert(df.end(), split.begin(), split.end());
  WorkerProcess* prefill = StartTlsWorker(pf);
  WorkerProcess* decode = StartTlsWorker(df);
  ASSERT_TRUE(prefill != nullptr && decode != nullptr);
  RouterYaml yaml{
      .prefill = {prefill->address()}, .decode = {decode->address()}, .mode = "always", .tls = cluster_.router};
  ASSERT_NE(StartRouter(yaml), nullptr);
  const std::vector<int> prompt_ids = MakePrompt(3, 80);
  Reply r = Post("/v1/completions", {{"model", "tiny"}, {"prompt", prompt_ids}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(r.http.status, 200) << r.http.body;
  EXPECT_GT(r.json["usage"]["completion_tokens"].get<int>(), 0);
  const v1::LoadReport d = GetLoad(decode->stub());
  EXPECT_EQ(d.kv_pulls(), 1) << "the KV did not move worker to worker";
  EXPECT_EQ(d.local_prefill_fallbacks(), 0);
  EXPECT_EQ(d.calls_denied(), 0);
  EXPECT_EQ(GetLoad(prefill->stub()).kv_handoffs(), 1);
}

// 4. SSRF: decode_address must be a plain host:port, and with TLS the
//    prefill worker sends nothing to a peer that is not a worker of its CA.
TEST_F(WorkerTlsTest, PrefillWorkerSendsNothingToANonWorker) {
  WorkerProcess* prefill = StartTlsWorker(
      {"--role", "prefill", "--kv-transport", "ucx", "--kv-transport-tls", "shm", "--kv-hold-timeout-ms", "3000"});
  ASSERT_NE(prefill, nullptr);
  TcpSink sink;
  v1::KvReservation fake;
  fake.set_reservation_id(12345);
  fake.set_instance_id("0123456789abcdef");
  fake.set_reservation_token(std::string(16, 'x'));
  const v1::GenerateRequest req = SampledRequest(MakePrompt(5, 64), 4, 9);

  for (const char* bad : {"unix:/tmp/tandem.sock", "dns:///127.0.0.1:80", "http://127.0.0.1:80/", "ipv4:127.0.0.1:80",
                          "127.0.0.1", "[::1]"}) {
    Output out = Generate(prefill->stub(), SendRequest(req, bad, fake));
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_THAT(out.status.error_message(), HasSubstr("decode_address")) << bad;
  }

  Output out = Generate(prefill->stub(), SendRequest(req, sink.address(), fake));
  ExpectWellFormed(out, "SEND to a plain TCP listener");
  EXPECT_FALSE(out.kv_transfer_error.empty()) << "the KV was 'delivered' to a non-worker";
  // The listener saw at most a TLS ClientHello (a handshake record, 0x16),
  // never HTTP/2 (a preface, a KvReady with the prompt's blocks).
  const std::string got = sink.received();
  EXPECT_FALSE(absl::StrContains(got, "PRI * HTTP/2.0")) << "a request reached a non-worker";
  if (!got.empty()) {
    EXPECT_EQ(static_cast<unsigned char>(got[0]), 0x16);
  }
  // The blocks are held until the KvReady deadline (3 s) passed.
  const v1::LoadReport load = ExpectIdle(prefill->stub(), "after the refused hand-off", std::chrono::seconds(15));
  EXPECT_GE(load.kv_peers_refused(), 6);  // the six malformed addresses
  EXPECT_EQ(load.kv_handoffs(), 0);
}

// 5. Without TLS a prefill worker dials only addresses its --kv-peer-allow
//    admits (loopback by default): others are refused before any connection.
TEST_F(WorkerTlsTest, InsecureWorkerDialsOnlyAllowedPeers) {
  WorkerProcess* loopback_only =
      StartWorker({"--insecure", "--role", "prefill", "--kv-transport", "ucx", "--kv-transport-tls", "shm"});
  WorkerProcess* listed = StartWorker({"--insecure", "--role", "prefill", "--kv-transport", "ucx", "--kv-transport-tls",
                                       "shm", "--kv-peer-allow", "10.99.0.0/16"});
  ASSERT_TRUE(loopback_only != nullptr && listed != nullptr);
  TcpSink sink;
  v1::KvReservation fake;
  fake.set_reservation_id(1);
  fake.set_instance_id("0123456789abcdef");
  const v1::GenerateRequest req = SampledRequest(MakePrompt(6, 40), 2, 3);

  Output metadata = Generate(loopback_only->stub(), SendRequest(req, "169.254.169.254:80", fake));
  EXPECT_EQ(metadata.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(metadata.status.error_message(), HasSubstr("--kv-peer-allow"));

  Output local = Generate(listed->stub(), SendRequest(req, sink.address(), fake));
  EXPECT_EQ(local.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // A name is resolved and checked when dialled: the hand-off fails unsent.
  Output named = Generate(listed->stub(), SendRequest(req, "localhost:" + sink.address().substr(10), fake));
  ExpectWellFormed(named, "SEND to a name outside the list");
  EXPECT_THAT(named.kv_transfer_error, HasSubstr("--kv-peer-allow"));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(sink.connections(), 0) << "the worker connected to a peer outside its allow list";
  EXPECT_EQ(GetLoad(loopback_only->stub()).kv_peers_refused(), 1);
  EXPECT_EQ(GetLoad(listed->stub()).kv_peers_refused(), 2);
}

// 6. Reservations are named by random ids and 128-bit tokens; KvReady with
//    the id but not the token finds nothing; a long timeout is capped.
TEST_F(WorkerTlsTest, ReservationsAreUnguessableAndTheirLifetimeCapped) {
  WorkerProcess* decode = StartTlsWorker({"--role", "decode", "--kv-transport", "ucx", "--kv-transport-tls", "shm",
                                          "--kv-receive-timeout-ms", "3000", "--kv-receive-timeout-max-ms", "5000"});
  ASSERT_NE(decode, nullptr);
  std::vector<std::unique_ptr<ReceiveStream>> streams;
  std::set<uint64_t> ids;
  std::set<std::string> tokens;
  for (int i = 0; i < 4; ++i) {
    streams.push_back(std::make_unique<ReceiveStream>(decode->stub(), GreedyRequest(MakePrompt(20 + i, 40), 2),
                                                      /*timeout_ms=*/i == 0 ? 3600000 : 4000));
    ASSERT_TRUE(streams.back()->reserved());
    ids.insert(streams.back()->reservation().reservation_id());
    tokens.insert(streams.back()->reservation().reservation_token());
    EXPECT_EQ(streams.back()->reservation().reservation_token().size(), 16u);
  }
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_EQ(tokens.size(), 4u);
  // Not a sequence: no two ids within a million of each other (random
  // 64-bit ids collide so closely with probability ~1e-12).
  for (auto a = ids.begin(), b = std::next(a); b != ids.end(); ++a, ++b) {
    EXPECT_GT(*b - *a, 1000000u) << "reservation ids " << *a << " and " << *b;
  }
  EXPECT_EQ(streams[0]->reservation().timeout_ms(), 5000u) << "an hour was not capped";
  EXPECT_EQ(streams[1]->reservation().timeout_ms(), 4000u);
  EXPECT_EQ(GetLoad(decode->stub()).reservation_timeouts_capped(), 1);

  // A worker that knows the id but not the token: NOT_FOUND, the
  // reservation keeps waiting.
  std::unique_ptr<v1::Worker::Stub> peer = StubAs(decode, cluster_.worker);
  grpc::ClientContext ctx;
  ctx.set_deadline(Soon());
  v1::KvReadyRequest ready;
  ready.set_reservation_id(streams[1]->reservation().reservation_id());
  ready.set_decode_instance_id(streams[1]->reservation().instance_id());
  ready.set_reservation_token(std::string(16, '\0'));
  v1::KvReadyResponse resp;
  const grpc::Status s = peer->KvReady(&ctx, ready, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(GetLoad(decode->stub()).reserved_requests(), 4);

  // The capped reservation ends by itself, at the cap (local prefill).
  const auto start = std::chrono::steady_clock::now();
  Output first = streams[0]->Finish();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_LT(waited, 30.0);
  for (size_t i = 1; i < streams.size(); ++i) {
    streams[i]->Cancel();
    streams[i]->Finish();
  }
  ExpectIdle(decode->stub(), "after the reservations");
}

// 7. One caller cannot hold more reserved blocks than its cap; another
//    caller (another certificate name) still can; a cancelled reservation
//    gives its blocks back.
TEST_F(WorkerTlsTest, OneCallerCannotHoldMoreThanItsCap) {
  WorkerProcess* decode = StartTlsWorker({"--role", "decode", "--kv-transport", "ucx", "--kv-transport-tls", "shm",
                                          "--kv-reserve-max-blocks-per-caller", "8"});
  ASSERT_NE(decode, nullptr);
  // 64-token prompts: 4 blocks each.
  ReceiveStream a(decode->stub(), GreedyRequest(MakePrompt(30, 64), 2), 30000);
  ReceiveStream b(decode->stub(), GreedyRequest(MakePrompt(31, 64), 2), 30000);
  ASSERT_TRUE(a.reserved() && b.reserved());
  EXPECT_EQ(GetLoad(decode->stub()).reserved_blocks(), 8);
  ReceiveStream c(decode->stub(), GreedyRequest(MakePrompt(32, 64), 2), 30000);
  EXPECT_FALSE(c.reserved());
  Output refused = c.Finish();
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("--kv-reserve-max-blocks-per-caller"));
  EXPECT_EQ(GetLoad(decode->stub()).reservations_over_caller_cap(), 1);

  // Another router (its own certificate name) has its own budget.
  absl::StatusOr<tls::TlsFiles> router_b = tls::IssueFromCaDir(dir_ + "/cluster", tls::kRouterIdentity, "router-b", 1);
  ASSERT_TRUE(router_b.ok()) << router_b.status();
  std::unique_ptr<v1::Worker::Stub> other = StubAs(decode, *router_b);
  ReceiveStream d(*other, GreedyRequest(MakePrompt(33, 64), 2), 30000);
  EXPECT_TRUE(d.reserved()) << d.Finish().status.error_message();

  // Cancelling gives the blocks back.
  a.Cancel();
  a.Finish();
  WaitUntil([&] { return GetLoad(decode->stub()).reserved_blocks() == 8; }, std::chrono::seconds(5));
  ReceiveStream e(decode->stub(), GreedyRequest(MakePrompt(34, 64), 2), 30000);
  EXPECT_TRUE(e.reserved()) << e.Finish().status.error_message();
  for (ReceiveStream* r : {&b, &d, &e}) {
    r->Cancel();
    r->Finish();
  }
  ExpectIdle(decode->stub(), "after the reservations");
  EXPECT_EQ(GetLoad(decode->stub()).reserved_blocks(), 0);
}

// 8. A worker started with neither TLS files nor --insecure does not start,
//    and says which flags it needs; so does a certificate of another CA.
TEST_F(WorkerTlsTest, WorkerNeedsTlsOrInsecureByName) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok());
  std::string out;
  const int rc = RunCommand(*bin + " worker --port 0", &out);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("--tls-ca, --tls-cert and --tls-key"));
  EXPECT_THAT(out, HasSubstr("--insecure"));
  const int foreign = RunCommand(absl::StrCat(*bin, " worker --port 0 --tls-ca ", other_.worker.ca, " --tls-cert ",
                                              cluster_.worker.cert, " --tls-key ", cluster_.worker.key),
                                 &out);
  EXPECT_NE(foreign, 0);
  EXPECT_THAT(out, HasSubstr("--tls-cert"));
  EXPECT_THAT(out, HasSubstr("was not issued by the CA"));
}

// 9. `tandem certs` gives operators a working set: a worker started with its
//    worker certificate serves a client holding its router certificate, and
//    --issue adds certificates from the same CA; an existing CA is kept.
TEST_F(WorkerTlsTest, CertsCommandMakesAWorkingSet) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok());
  const std::string out_dir = dir_ + "/ops";
  std::string out;
  ASSERT_EQ(RunCommand(absl::StrCat(*bin, " certs --out ", out_dir), &out), 0) << out;
  EXPECT_NE(RunCommand(absl::StrCat(*bin, " certs --out ", out_dir), &out), 0);
  EXPECT_THAT(out, HasSubstr("already holds a CA"));
  ASSERT_EQ(RunCommand(absl::StrCat(*bin, " certs --out ", out_dir, " --issue router:admin-1"), &out), 0) << out;
  EXPECT_NE(RunCommand(absl::StrCat(*bin, " certs --out ", out_dir, " --issue king:x"), &out), 0);
  EXPECT_THAT(out, HasSubstr("router:NAME or worker:NAME"));

  const tls::ClusterFiles ops = tls::ClusterFilesIn(out_dir);
  WorkerProcess* w = StartWorker(
      {"--tls-ca", ops.worker.ca, "--tls-cert", ops.worker.cert, "--tls-key", ops.worker.key},
      LaunchOptions{.client_tls = tls::TlsFiles{
                        .ca = ops.router.ca, .cert = out_dir + "/admin-1.crt", .key = out_dir + "/admin-1.key"}});
  ASSERT_NE(w, nullptr);
  ExpectWellFormed(Generate(w->stub(), GreedyRequest(MakePrompt(2, 20), 3)), "admin-1's request");
  // This cluster's CA does not vouch for the other one's router.
  EXPECT_FALSE(
      Generate(*StubAs(w, cluster_.router), GreedyRequest(MakePrompt(2, 20), 3), std::chrono::seconds(10)).status.ok());
}

// 10. The router checks its tls section at start: a missing section, or a
//     certificate the CA did not issue, stops it with the file, key and why.
TEST_F(WorkerTlsTest, RouterRefusesAMissingOrForeignIdentityAtStart) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok());
  const std::string base =
      "listener: {host: 127.0.0.1, port: 0}\ndisaggregation: {mode: never}\n"
      "pools:\n  decode:\n    workers: [\"127.0.0.1:1\"]\n";
  const std::string none = dir_ + "/none.yaml", foreign = dir_ + "/foreign.yaml";
  {
    std::ofstream(none) << base;
    std::ofstream(foreign) << base << "tls:\n  ca: " << cluster_.router.ca << "\n  cert: " << other_.router.cert
                           << "\n  key: " << other_.router.key << "\n";
  }
  std::string out;
  EXPECT_NE(RunCommand(absl::StrCat(*bin, " router --config ", none), &out), 0);
  EXPECT_THAT(out, HasSubstr(none));
  EXPECT_THAT(out, HasSubstr("tls: required"));
  EXPECT_NE(RunCommand(absl::StrCat(*bin, " router --config ", foreign), &out), 0);
  EXPECT_THAT(out, HasSubstr(foreign));
  EXPECT_THAT(out, HasSubstr("tls.cert"));
  EXPECT_THAT(out, HasSubstr("was not issued by the CA"));
}

}  // namespace
}  // namespace tandem::testing
