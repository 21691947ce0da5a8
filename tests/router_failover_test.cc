// The router keeps serving through worker faults, end to end: real worker
// processes behind a real `tandem router`, driven over HTTP.
//  - A frozen (SIGSTOPped) worker: requests placed on it move to the healthy
//    one within the attempt deadline (retries.attempt_first_token_s /
//    attempt_idle_s), far before the request's own timeouts.
//  - A decode worker killed mid-stream: every stream continues on another
//    decode worker with exactly the tokens (and logprobs) of an undisturbed
//    run with the same seed, greedy and seeded, aggregated and split.
//  - The fault run: steady streaming load on a 2P2D cluster while each
//    worker is killed and restarted, each is restarted as a rolling update
//    does (SIGTERM, while the router still routes to it; it drains and
//    exits, and comes back on its port), and each is frozen for a while
//    ($TANDEM_FAULT_PAUSE_S seconds, 5 by default; the full run is
//    30): no request fails or overruns, and afterwards no worker holds a
//    KV block.
//  - No healthy worker at all (retries.wait_for_worker_s): a request waits
//    and is served by the first worker to become routable, streamed or not;
//    a wait that runs out is a 503 naming the setting; a split request whose
//    decode worker restarts mid-prefill runs split again on the same prefill
//    worker.
// Checked through HTTP responses, /metrics and the workers' GetLoad.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tests/testing/router_test.h"
#include "tests/testing/worker_client.h"

namespace tandem::testing {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One streamed completion as the client saw it.
struct StreamResult {
  int status = 0;
  bool done = false;   // [DONE] came
  bool error = false;  // an error event came
  std::vector<int32_t> ids;
  std::vector<double> logprobs;
  std::string finish;
  int64_t completion_tokens = -1;  // from the usage chunk
  std::string decode_worker;       // x-tandem-decode-worker (the first placement)
  double seconds = 0;
  std::string body;  // for failure messages
};

// A streamed completion of `prompt` (token ids) with logprobs of the sampled
// tokens (as ids) and usage; greedy unless `seed` > 0 (then sampled).
json StreamBody(const std::vector<int32_t>& prompt, int max_tokens, int seed) {
  json body = {{"model", "tiny"},
               {"prompt", prompt},
               {"max_tokens", max_tokens},
               {"ignore_eos", true},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"logprobs", 1},
               {"return_tokens_as_token_ids", true}};
  if (seed > 0) {
    body["seed"] = seed;
    body["temperature"] = 0.8;
    body["top_p"] = 0.95;
  } else {
    body["temperature"] = 0;
  }
  return body;
}

StreamResult RunStream(const std::string& url, const json& body) {
  StreamResult r;
  const Clock::time_point start = Clock::now();
  const HttpResponse http = HttpCall(url, "POST", "/v1/completions", body.dump(), {}, std::chrono::seconds(120));
  r.seconds = SecondsSince(start);
  r.status = http.status;
  r.body = http.body.substr(0, 2000);
  r.decode_worker = http.Header("x-tandem-decode-worker");
  for (const std::string& data : SseData(http.body)) {
    if (data == "[DONE]") {
      r.done = true;
      continue;
    }
    const json e = json::parse(data, nullptr, false);
    if (e.is_discarded()) {
      r.error = true;
      continue;
    }
    if (e.contains("error")) r.error = true;
    if (e.contains("usage") && e["usage"].is_object()) {
      r.completion_tokens = e["usage"]["completion_tokens"].get<int64_t>();
    }
    if (!e.contains("choices") || e["choices"].empty()) continue;
    const json& c = e["choices"][0];
    if (c.contains("finish_reason") && c["finish_reason"].is_string()) {
      r.finish = c["finish_reason"].get<std::string>();
    }
    if (!c.contains("logprobs") || !c["logprobs"].is_object()) continue;
    const json& lp = c["logprobs"];
    for (const json& t : lp["tokens"]) {
      const std::string s = t.get<std::string>();  // "token_id:N"
      r.ids.push_back(std::atoi(s.substr(s.find(':') + 1).c_str()));
    }
    for (const json& l : lp["token_logprobs"]) r.logprobs.push_back(l.get<double>());
  }
  return r;
}

// A complete, error-free stream of `max_tokens` tokens.
void ExpectComplete(const StreamResult& r, int max_tokens, const std::string& what) {
  EXPECT_EQ(r.status, 200) << what << ": " << r.body;
  EXPECT_TRUE(r.done) << what << ": " << r.body;
  EXPECT_FALSE(r.error) << what << ": " << r.body;
  EXPECT_EQ(r.finish, "length") << what;
  EXPECT_EQ(r.completion_tokens, max_tokens) << what;
  EXPECT_EQ(r.ids.size(), static_cast<size_t>(max_tokens)) << what;
}

// Same tokens, logprobs within the project's tolerance.
void ExpectSameTokens(const StreamResult& got, const StreamResult& want, const std::string& what) {
  ASSERT_EQ(got.ids.size(), want.ids.size()) << what;
  for (size_t i = 0; i < want.ids.size(); ++i) {
    ASSERT_EQ(got.ids[i], want.ids[i]) << what << ": token " << i;
  }
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < want.logprobs.size(); ++i) {
    ASSERT_NEAR(got.logprobs[i], want.logprobs[i], BatchingLogprobTolerance()) << what << ": token " << i;
  }
}

// Runs every body at once, one thread each.
// Every body streamed at once, each on its own thread, from construction.
// Join() waits for them all; so does the destructor, so a test that fails
// early still joins. REQUIRES: `bodies` outlives the object.
class StreamsInFlight {
 public:
  StreamsInFlight(const std::string& url, const std::vector<json>& bodies) : results_(bodies.size()) {
    for (size_t i = 0; i < bodies.size(); ++i) {
      threads_.emplace_back([this, url, &bodies, i] { results_[i] = RunStream(url, bodies[i]); });
    }
  }
  ~StreamsInFlight() { Join(); }
  const std::vector<StreamResult>& Join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
    return results_;
  }

 private:
  std::vector<StreamResult> results_;
  std::vector<std::thread> threads_;
};

std::vector<StreamResult> RunStreams(const std::string& url, const std::vector<json>& bodies) {
  StreamsInFlight streams(url, bodies);
  return streams.Join();
}

// True once `worker` runs at least `n` sequences, false after `timeout`.
bool RunsAtLeast(WorkerProcess& worker, int n, std::chrono::seconds timeout) {
  bool ok = false;
  WaitForLoad(
      worker.stub(), [n](const v1::LoadReport& l) { return l.running_sequences() >= n; }, &ok, timeout);
  return ok;
}

class RouterFailoverTest : public RouterTest {
 protected:
  void ExpectDrainPushedBeforeTheNextCheck(const std::string& policy);
  std::string Healthy(const std::string& pool, const std::string& address) {
    return absl::StrCat("tandem_router_worker_healthy{pool=\"", pool, "\",worker=\"", address, "\"}");
  }
  double Failovers() {
    return Metric("tandem_router_failovers_total{reason=\"error\"}").value_or(0) +
           Metric("tandem_router_failovers_total{reason=\"stall\"}").value_or(0);
  }
};

const std::vector<std::string> kSimFlags = {"--engine", "sim", "--sim-step-ms", "2"};

// ---------------------------------------------------------------------------
// (a) A frozen worker.

TEST_F(RouterFailoverTest, FrozenWorkersRequestsMoveToTheHealthyOneWithinTheAttemptDeadline) {
  WorkerProcess* a = StartBoth(kSimFlags);
  WorkerProcess* b = StartBoth(kSimFlags);
  ASSERT_TRUE(a && b);
  // Health checks 30 s apart: only the attempt deadlines can notice the
  // frozen worker in time. First token: auto (5 x the p99 seen, at least
  // 1 s); mid-stream: a fixed 3 s, so that requests sent just after the
  // freeze meet `a` still admitted and time out there first.
  ASSERT_NE(StartRouter({.decode = {a->address(), b->address()},
                         .extra = "timeouts:\n  first_token_s: 30\n  idle_stream_s: 30\n"
                                  "retries:\n  auto_floor_s: 1\n  attempt_idle_s: 3\n",
                         .health_interval_s = 30}),
            nullptr);
  // Warm-up (auto deadlines need 20 samples) and the reference outputs:
  // the simulated engine's tokens follow from the seed alone.
  constexpr int kLong = 1500;  // ~3 s of tokens at 2 ms a step
  std::vector<json> bodies;
  for (int i = 0; i < 6; ++i) bodies.push_back(StreamBody(MakePrompt(50 + i, 40), kLong, 100 + i));
  for (int i = 0; i < 24; ++i) {
    ExpectComplete(RunStream(router()->url(), StreamBody(MakePrompt(i, 20), 4, 1 + i)), 4, "warm-up");
  }
  const std::vector<StreamResult> reference = RunStreams(router()->url(), bodies);
  for (const StreamResult& r : reference) ExpectComplete(r, kLong, "reference");

  // Streams in flight on both workers; then `a` freezes.
  StreamsInFlight streams(router()->url(), bodies);
  if (!RunsAtLeast(*a, 3, seconds(10))) FAIL() << "the streams did not start on " << a->address();
  std::this_thread::sleep_for(milliseconds(300));
  std::vector<StreamResult> fresh;
  {
    PausedWorker paused(a);
    // New requests: round robin still sends every other one to `a`, which
    // the router still believes healthy.
    for (int i = 0; i < 4; ++i) {
      fresh.push_back(RunStream(router()->url(), StreamBody(MakePrompt(70 + i, 30), 8, 7 + i)));
    }
    streams.Join();
    EXPECT_EQ(Metric(Healthy("decode", a->address())), 0) << "the suspect was not ejected";
  }
  const std::vector<StreamResult>& streamed = streams.Join();
  for (size_t i = 0; i < streamed.size(); ++i) {
    const std::string what = absl::StrCat("stream ", i, " (first on ", streamed[i].decode_worker, ")");
    ExpectComplete(streamed[i], kLong, what);
    ExpectSameTokens(streamed[i], reference[i], what);
    EXPECT_LT(streamed[i].seconds, 15) << what;
  }
  for (const StreamResult& r : fresh) {
    ExpectComplete(r, 8, "request sent after the freeze");
    EXPECT_LT(r.seconds, 5) << "far before timeouts.first_token_s (30 s)";
  }
  // Both paths ran: a fresh request timed out on `a` before its first token
  // and was retried; the streams on `a` stalled and failed over.
  EXPECT_GE(Metric("tandem_router_attempt_timeouts_total{phase=\"first_token\"}").value_or(0), 1);
  EXPECT_GE(Metric("tandem_router_attempt_timeouts_total{phase=\"idle\"}").value_or(0), 1);
  EXPECT_GE(Failovers(), 1);
  EXPECT_EQ(Metric("tandem_router_requests_total{endpoint=\"completions\",code=\"504\"}").value_or(0), 0);
  // Thawed, `a` learns of the cancellations and frees everything.
  ExpectIdle(a->stub(), "the frozen worker, thawed", seconds(15));
  ExpectIdle(b->stub(), "the healthy worker", seconds(15));
}

TEST_F(RouterFailoverTest, KeepaliveEjectsAFrozenWorkerWithoutHealthChecksOrDeadlines) {
  // Attempt deadlines off, health checks 30 s apart: only the channel's
  // keepalive pings (4 s, 3 s to answer) notice that `a` froze; its calls
  // fail with UNAVAILABLE, which ejects it and fails its streams over.
  const std::vector<std::string> flags = {"--engine", "sim", "--sim-step-ms", "7"};
  WorkerProcess* a = StartBoth(flags);
  WorkerProcess* b = StartBoth(flags);
  ASSERT_TRUE(a && b);
  ASSERT_NE(StartRouter({.decode = {a->address(), b->address()},
                         .extra = "timeouts:\n  first_token_s: 60\n  idle_stream_s: 60\n"
                                  "retries:\n  attempt_first_token_s: 0\n  attempt_idle_s: 0\n",
                         .health_interval_s = 30}),
            nullptr);
  constexpr int kTokens = 1800;  // ~13 s at 7 ms a step
  std::vector<json> bodies;
  for (int i = 0; i < 4; ++i) bodies.push_back(StreamBody(MakePrompt(300 + i, 24), kTokens, 40 + i));
  StreamsInFlight streams(router()->url(), bodies);
  if (!RunsAtLeast(*a, 2, seconds(10))) {
    FAIL() << "the streams did not start on " << a->address() << ": " << streams.Join()[0].body;
  }
  double ejected_after = 0;
  {
    PausedWorker paused(a);
    const Clock::time_point frozen = Clock::now();
    EXPECT_TRUE(WaitForMetric(
        Healthy("decode", a->address()), [](double v) { return v == 0; }, seconds(20)));
    ejected_after = SecondsSince(frozen);
    streams.Join();
  }
  EXPECT_LT(ejected_after, 12) << "keepalive: 4 s between pings, 3 s to answer";
  const std::vector<StreamResult>& streamed = streams.Join();
  for (size_t i = 0; i < streamed.size(); ++i) {
    ExpectComplete(streamed[i], kTokens, absl::StrCat("stream ", i));
  }
  EXPECT_GE(Metric("tandem_router_failovers_total{reason=\"error\"}").value_or(0), 1);
  EXPECT_EQ(Metric("tandem_router_attempt_timeouts_total{phase=\"idle\"}").value_or(0), 0);
  ExpectIdle(a->stub(), "the frozen worker, thawed", seconds(15));
}

// ---------------------------------------------------------------------------
// (b) A decode worker killed mid-stream, on the real engine.

class KilledMidStreamTest : public RouterFailoverTest, public ::testing::WithParamInterface<bool> {};

TEST_P(KilledMidStreamTest, StreamsContinueOnTheOtherWorkerWithTheSameTokens) {
  const bool split = GetParam();
  WorkerProcess* prefill = split ? StartPrefill() : nullptr;
  WorkerProcess* a = split ? StartDecode() : StartBoth();
  WorkerProcess* b = split ? StartDecode() : StartBoth();
  ASSERT_TRUE(a && b && (!split || prefill));
  RouterYaml yaml{.decode = {a->address(), b->address()}};
  if (split) {
    yaml.prefill = {prefill->address()};
    yaml.mode = "always";
  }
  ASSERT_NE(StartRouter(yaml), nullptr);
  // Three greedy and three seeded streams, long enough to be cut.
  constexpr int kTokens = 1200;
  std::vector<json> bodies;
  for (int i = 0; i < 6; ++i) {
    bodies.push_back(StreamBody(MakePrompt(200 + i, 48), kTokens, i % 2 == 0 ? 0 : 1000 + i));
  }
  const std::vector<StreamResult> reference = RunStreams(router()->url(), bodies);
  for (const StreamResult& r : reference) ExpectComplete(r, kTokens, "reference");

  StreamsInFlight streams(router()->url(), bodies);
  if (!RunsAtLeast(*a, 2, seconds(20))) FAIL() << "the streams did not start on " << a->address();
  std::this_thread::sleep_for(milliseconds(100));
  Kill(a);
  const std::vector<StreamResult>& streamed = streams.Join();
  int on_a = 0;
  for (size_t i = 0; i < streamed.size(); ++i) {
    const std::string what =
        absl::StrCat(split ? "split" : "aggregated", " stream ", i, i % 2 == 0 ? " (greedy)" : " (seeded)",
                     ", first on ", streamed[i].decode_worker);
    ExpectComplete(streamed[i], kTokens, what);
    ExpectSameTokens(streamed[i], reference[i], what);
    if (streamed[i].decode_worker == a->address()) ++on_a;
  }
  EXPECT_GE(on_a, 1);
  EXPECT_GE(Metric("tandem_router_failovers_total{reason=\"error\"}").value_or(0), 1);
  // The survivors hold nothing.
  ExpectIdle(b->stub(), "the surviving decode worker", seconds(15));
  if (split) ExpectIdle(prefill->stub(), "the prefill worker", seconds(15));
}

INSTANTIATE_TEST_SUITE_P(AggregatedAndSplit, KilledMidStreamTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? std::string("Split") : std::string("Aggregated");
                         });

// ---------------------------------------------------------------------------
// (d) The fault run.

TEST_F(RouterFailoverTest, FaultRunUnderSteadyStreamingLoadLosesNothing) {
  const char* pause_env = std::getenv("TANDEM_FAULT_PAUSE_S");
  const double pause_s = pause_env != nullptr ? std::atof(pause_env) : 5.0;
  std::vector<WorkerProcess*> prefill = {StartPrefill(kSimFlags), StartPrefill(kSimFlags)};
  std::vector<WorkerProcess*> decode = {StartDecode(kSimFlags), StartDecode(kSimFlags)};
  for (WorkerProcess* w : prefill) ASSERT_NE(w, nullptr);
  for (WorkerProcess* w : decode) ASSERT_NE(w, nullptr);
  constexpr double kRequestS = 60;
  ASSERT_NE(StartRouter({.prefill = {prefill[0]->address(), prefill[1]->address()},
                         .decode = {decode[0]->address(), decode[1]->address()},
                         .mode = "always",
                         .policy = "least_request",
                         .extra = absl::StrCat("timeouts:\n  first_token_s: 30\n  idle_stream_s: 30\n"
                                               "  request_s: ",
                                               kRequestS,
                                               "\n"
                                               "retries:\n  auto_floor_s: 1\n  max_failovers: 5\n"
                                               "  max_attempts: 5\n")}),
            nullptr);

  // Steady load: client threads streaming one request after another.
  constexpr int kClients = 6;
  constexpr int kTokens = 120;
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<std::pair<json, StreamResult>> results;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; !stop.load(); ++i) {
        const json body = StreamBody(MakePrompt(1000 * c + i, 40 + i % 50), kTokens, 1 + 97 * c + i);
        StreamResult r = RunStream(router()->url(), body);
        std::lock_guard<std::mutex> lock(mu);
        results.emplace_back(body, std::move(r));
      }
    });
  }
  auto wait_healthy = [&](const std::string& pool, WorkerProcess* w) {
    EXPECT_TRUE(WaitForMetric(
        Healthy(pool, w->address()), [](double v) { return v == 1; }, seconds(30)))
        << pool << " worker " << w->address() << " was not readmitted";
  };
  std::this_thread::sleep_for(seconds(2));
  // Stop each worker (killed, or SIGTERMed and drained) and restart it on its
  // port.
  for (const bool drain : {false, true}) {
    for (auto* pool : {&prefill, &decode}) {
      const bool is_prefill = pool == &prefill;
      for (WorkerProcess*& w : *pool) {
        const int port = w->port();
        if (drain) {
          ASSERT_EQ(::kill(w->pid(), SIGTERM), 0);
          const absl::StatusOr<int> exited = w->Wait(seconds(30));
          ASSERT_TRUE(exited.ok()) << w->address() << " did not drain and exit: " << exited.status();
          EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << *exited;
        } else {
          Kill(w);
          std::this_thread::sleep_for(seconds(1));
        }
        std::vector<std::string> flags = kSimFlags;
        flags.insert(flags.end(), {"--port", std::to_string(port)});
        w = is_prefill ? StartPrefill(flags) : StartDecode(flags);
        ASSERT_NE(w, nullptr);
        wait_healthy(is_prefill ? "prefill" : "decode", w);
        std::this_thread::sleep_for(seconds(1));
      }
    }
  }
  // Freeze each worker for a while.
  for (auto* pool : {&prefill, &decode}) {
    for (WorkerProcess* w : *pool) {
      {
        PausedWorker paused(w);
        std::this_thread::sleep_for(std::chrono::duration<double>(pause_s));
      }
      wait_healthy(pool == &prefill ? "prefill" : "decode", w);
      std::this_thread::sleep_for(seconds(1));
    }
  }
  stop = true;
  for (std::thread& t : clients) t.join();

  ASSERT_GT(results.size(), 50u);
  int failed = 0;
  for (const auto& [body, r] : results) {
    const bool good = r.status == 200 && r.done && !r.error && r.completion_tokens == kTokens &&
                      r.ids.size() == static_cast<size_t>(kTokens);
    if (!good && ++failed <= 5) ADD_FAILURE() << "failed request: " << r.status << " " << r.body;
    EXPECT_LT(r.seconds, kRequestS);
  }
  EXPECT_EQ(failed, 0) << "of " << results.size();
  const double retries = Metric("tandem_router_retries_total").value_or(0);
  std::printf("fault run: %zu requests, %d failed, %g failovers, %g retries (pauses of %g s)\n", results.size(), failed,
              Failovers(), retries, pause_s);
  EXPECT_GE(Failovers() + retries, 1);
  // The simulated tokens follow from the seed: every stream, moved or not,
  // carries exactly those of an undisturbed run.
  for (size_t i = 0; i < results.size(); i += std::max<size_t>(1, results.size() / 12)) {
    const StreamResult again = RunStream(router()->url(), results[i].first);
    ExpectSameTokens(results[i].second, again, absl::StrCat("request ", i));
  }
  // Nothing used, reserved, held or quarantined anywhere.
  for (auto* pool : {&prefill, &decode}) {
    for (WorkerProcess* w : *pool) ExpectIdle(w->stub(), w->address(), seconds(20));
  }
}

// ---------------------------------------------------------------------------
// (e) No healthy worker: waiting for one.

// The only decode "worker" is an address nothing listens on; requests wait
// (one streamed, one not) until a reload names a real worker, which serves
// them once it passed its health check.
TEST_F(RouterFailoverTest, RequestsWithNoHealthyWorkerWaitAndAreServedByTheFirstOneUp) {
  WorkerProcess* w = StartBoth(kSimFlags);
  ASSERT_NE(w, nullptr);
  const std::string waits = "retries:\n  wait_for_worker_s: 60\n";
  ASSERT_NE(StartRouter({.decode = {"127.0.0.1:1"}, .extra = waits}, /*wait_healthy=*/false), nullptr);
  const json body = StreamBody({5, 6, 7}, 6, 0);
  json unstreamed = body;
  unstreamed["stream"] = false;
  unstreamed.erase("stream_options");
  std::future<StreamResult> streamed =
      std::async(std::launch::async, [&, url = router()->url()] { return RunStream(url, body); });
  std::future<Reply> plain = PostAsync("/v1/completions", unstreamed);
  // Both wait: no answer while no worker is healthy.
  ASSERT_TRUE(WaitForMetric("tandem_router_waiting_for_worker", [](double v) { return v == 2; }));
  EXPECT_EQ(streamed.wait_for(milliseconds(0)), std::future_status::timeout);
  EXPECT_EQ(plain.wait_for(milliseconds(0)), std::future_status::timeout);
  EXPECT_EQ(Get("/health").http.status, 503);

  router()->Rewrite(RouterYaml{.decode = {w->address()}, .extra = waits}.Text());
  router()->Signal(SIGHUP);
  const StreamResult s = streamed.get();
  ExpectComplete(s, 6, "the streamed request");
  EXPECT_EQ(s.decode_worker, w->address());
  const Reply p = plain.get();
  ASSERT_EQ(p.http.status, 200) << p.http.body;
  EXPECT_EQ(p.json["usage"]["completion_tokens"], 6);
  EXPECT_EQ(p.http.Header("x-tandem-decode-worker"), w->address());
  EXPECT_EQ(Metric("tandem_router_worker_waits_total{outcome=\"placed\"}"), 2);
  EXPECT_EQ(Metric("tandem_router_worker_waits_total{outcome=\"expired\"}").value_or(0), 0);
  EXPECT_EQ(Metric("tandem_router_retries_total"), 0);
  EXPECT_EQ(Metric("tandem_router_waiting_for_worker"), 0);
  ExpectIdle(w->stub(), w->address(), seconds(20));
}

// A worker told to stop (SIGTERM) drains: with no event streams
// (kv_events.enabled false) its first health check after that answers
// NOT_SERVING and ejects it at once (not after unhealthy_after = 3 failed
// checks), while the stream it runs finishes there.
TEST_F(RouterFailoverTest, ADrainingWorkerIsEjectedByItsFirstNotServingCheck) {
  std::vector<std::string> slow = {"--engine", "sim", "--sim-step-ms", "40"};
  WorkerProcess* a = StartBoth(slow);
  WorkerProcess* b = StartBoth(slow);
  ASSERT_TRUE(a && b);
  ASSERT_NE(
      StartRouter(
          {.decode = {a->address(), b->address()}, .extra = "kv_events:\n  enabled: false\n", .health_interval_s = 2}),
      nullptr);
  const std::string failed_checks = "tandem_router_health_checks_total{result=\"failed\"}";
  const double failed_before = Metric(failed_checks).value_or(0);
  // Two long streams, one on each worker (round robin): ~8 s each.
  const std::vector<json> bodies = {StreamBody(MakePrompt(400, 16), 200, 0), StreamBody(MakePrompt(401, 16), 200, 0)};
  StreamsInFlight streams(router()->url(), bodies);
  ASSERT_TRUE(RunsAtLeast(*a, 1, seconds(20)));
  ASSERT_EQ(::kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(WaitForMetric(
      Healthy("decode", a->address()), [](double v) { return v == 0; }, seconds(20)));
  // Read within a tick of the ejection; the next round is 2 s away.
  EXPECT_EQ(Metric(failed_checks).value_or(0) - failed_before, 1) << "checks it failed before it was ejected";
  for (const StreamResult& r : streams.Join()) ExpectComplete(r, 200, "a stream through the drain");
  EXPECT_EQ(Metric(Healthy("decode", b->address())), 1);
  const absl::StatusOr<int> exited = a->Wait(seconds(30));
  ASSERT_TRUE(exited.ok()) << "the drained worker did not exit: " << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << *exited;
}

// The drain reaches the router over the worker's KV event stream, long
// before its next health check (30 s away): the worker is ejected within
// seconds of its SIGTERM without a failed check, the requests sent then all
// go to the other worker without a retry, and the streams in flight on the
// draining one complete. Under a KV-aware policy (the stream carries
// events) and round robin (a status-only stream).
void RouterFailoverTest::ExpectDrainPushedBeforeTheNextCheck(const std::string& policy) {
  std::vector<std::string> slow = {"--engine", "sim", "--sim-step-ms", "40"};
  WorkerProcess* a = StartBoth(slow);
  WorkerProcess* b = StartBoth(slow);
  ASSERT_TRUE(a && b);
  ASSERT_NE(StartRouter({.decode = {a->address(), b->address()}, .policy = policy, .health_interval_s = 30}), nullptr);
  const std::string failed_checks = "tandem_router_health_checks_total{result=\"failed\"}";
  const double failed_before = Metric(failed_checks).value_or(0);
  // Two long streams (~4 s each), one on each worker.
  const std::vector<json> bodies = {StreamBody(MakePrompt(600, 16), 100, 0), StreamBody(MakePrompt(601, 16), 100, 0)};
  StreamsInFlight streams(router()->url(), bodies);
  ASSERT_TRUE(RunsAtLeast(*a, 1, seconds(20)));
  const auto sigterm_at = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(a->pid(), SIGTERM), 0);
  ASSERT_TRUE(WaitForMetric(
      Healthy("decode", a->address()), [](double v) { return v == 0; }, seconds(20)));
  EXPECT_LT(std::chrono::steady_clock::now() - sigterm_at, seconds(10)) << "ejected by a health check, not the stream";
  EXPECT_EQ(Metric(failed_checks).value_or(0), failed_before) << "a health check failed before the ejection";
  const double retries_before = Metric("tandem_router_retries_total").value_or(0);
  for (int i = 0; i < 4; ++i) {
    const StreamResult r = RunStream(router()->url(), StreamBody(MakePrompt(700 + i, 16), 4, 1 + i));
    ExpectComplete(r, 4, "a request sent during the drain");
    EXPECT_EQ(r.decode_worker, b->address());
  }
  EXPECT_EQ(Metric("tandem_router_retries_total").value_or(0), retries_before) << "requests met the draining worker";
  for (const StreamResult& r : streams.Join()) ExpectComplete(r, 100, "a stream through the drain");
  const absl::StatusOr<int> exited = a->Wait(seconds(30));
  ASSERT_TRUE(exited.ok()) << "the drained worker did not exit: " << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << *exited;
}

TEST_F(RouterFailoverTest, ADrainingWorkerIsEjectedByItsKvEventStreamUnderAKvAwarePolicy) {
  ExpectDrainPushedBeforeTheNextCheck("kv_cache_aware");
}

TEST_F(RouterFailoverTest, ADrainingWorkerIsEjectedByItsStatusOnlyStreamUnderRoundRobin) {
  ExpectDrainPushedBeforeTheNextCheck("round_robin");
}

// Split requests whose only decode worker dies while the prefill worker is
// still prefilling them: they wait for it, and once it is back on its port
// they run split again on the same prefill worker (cancelling the abandoned
// attempt's prefill does not count as that worker failing).
TEST_F(RouterFailoverTest, SplitRequestsWaitForTheirDecodeWorkerRestartedMidPrefill) {
  std::vector<std::string> slow_prefill = kSimFlags;
  slow_prefill.insert(slow_prefill.end(), {"--sim-prefill-us-per-token", "2000"});
  WorkerProcess* p = StartPrefill(slow_prefill);
  WorkerProcess* d = StartDecode(kSimFlags);
  ASSERT_TRUE(p && d);
  const std::string waits = "retries:\n  wait_for_worker_s: 60\n";
  ASSERT_NE(StartRouter({.prefill = {p->address()}, .decode = {d->address()}, .mode = "always", .extra = waits}),
            nullptr);
  // A 1,000-token prompt: two seconds of prefill.
  std::vector<json> bodies;
  for (int i = 0; i < 2; ++i) bodies.push_back(StreamBody(MakePrompt(300 + i, 1000), 8, 0));
  StreamsInFlight streams(router()->url(), bodies);
  // Both prefilling (the router's calls on the prefill worker).
  ASSERT_TRUE(
      WaitForMetric(absl::StrCat("tandem_router_worker_in_flight{pool=\"prefill\",worker=\"", p->address(), "\"}"),
                    [](double v) { return v == 2; }));
  const int port = d->port();
  Kill(d);
  std::vector<std::string> flags = kSimFlags;
  flags.insert(flags.end(), {"--port", std::to_string(port)});
  d = StartDecode(flags);
  ASSERT_NE(d, nullptr);
  for (const StreamResult& r : streams.Join()) {
    ExpectComplete(r, 8, "a stream whose decode worker died");
    EXPECT_EQ(r.decode_worker, d->address());
  }
  // Each stream retried once, split again: nothing prefilled on the decode worker.
  EXPECT_EQ(Metric("tandem_router_retries_total"), 2);
  EXPECT_EQ(Metric("tandem_router_fallbacks_total{kind=\"local_prefill\"}").value_or(0), 0);
  EXPECT_EQ(Metric("tandem_router_worker_waits_total{outcome=\"placed\"}"), 2);
  ExpectIdle(p->stub(), "the prefill worker", seconds(15));
  ExpectIdle(d->stub(), "the restarted decode worker", seconds(15));
}

// A wait that runs out fails the request with 503 (Retry-After, the reason
// and the setting), no sooner than the wait.
TEST_F(RouterFailoverTest, AWaitForAWorkerThatRunsOutIs503NamingTheSetting) {
  ASSERT_NE(
      StartRouter({.decode = {"127.0.0.1:1"}, .extra = "retries:\n  wait_for_worker_s: 1.5\n"}, /*wait_healthy=*/false),
      nullptr);
  const Clock::time_point start = Clock::now();
  const Reply r = Post("/v1/chat/completions",
                       {{"model", "tiny"}, {"max_tokens", 2}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  EXPECT_GE(SecondsSince(start), 1.5);
  EXPECT_EQ(r.http.status, 503) << r.http.body;
  EXPECT_EQ(r.http.Header("retry-after"), "1");
  const std::string message = r.json["error"]["message"].get<std::string>();
  EXPECT_THAT(message, ::testing::AllOf(::testing::HasSubstr("no healthy worker"), ::testing::HasSubstr("; waited "),
                                        ::testing::HasSubstr(" s for one (retries.wait_for_worker_s)")));
  // The request is accounted just after its reply went out.
  EXPECT_TRUE(WaitForMetric(
      "tandem_router_worker_waits_total{outcome=\"expired\"}", [](double v) { return v == 1; }, seconds(5)));
  EXPECT_EQ(Metric("tandem_router_worker_waits_total{outcome=\"placed\"}").value_or(0), 0);
}

}  // namespace
}  // namespace tandem::testing
