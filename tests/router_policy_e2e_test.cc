// Each routing policy's observable behaviour through the router's HTTP API,
// with real workers: where requests land (the x-tandem-decode-worker and
// x-tandem-prefill-worker headers), what the router's /metrics count, and
// what the workers' prefix caches report in usage.
//
// Load is made real by pausing a worker (SIGSTOP; its connections stay
// open): requests the router sends it stay in flight until it resumes, so
// load-aware policies must steer around it. No test depends on timing: a
// request is known to hang when the router's in-flight gauge for the paused
// worker counts it.
#include <signal.h>

#include <future>
#include <map>
#include <set>
#include <string>
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
using std::chrono::seconds;

json Completion(json prompt, int max_tokens = 2) {
  return {{"model", "tiny"}, {"prompt", std::move(prompt)}, {"max_tokens", max_tokens}};
}

// Token ids: a shared prefix of `prefix_len` for `group` and a suffix unique
// to `member`.
json PromptIds(uint32_t group, int prefix_len, uint32_t member, int suffix_len = 8) {
  std::vector<int32_t> ids = MakePrompt(group, prefix_len);
  const std::vector<int32_t> suffix = MakePrompt(100000 + group * 1000 + member, suffix_len);
  ids.insert(ids.end(), suffix.begin(), suffix.end());
  return ids;
}

std::string DecodeWorker(const HttpResponse& r) { return r.Header("x-tandem-decode-worker"); }

std::string InFlight(const WorkerProcess* w) {
  return absl::StrCat("tandem_router_worker_in_flight{pool=\"decode\",worker=\"", w->address(), "\"}");
}
std::string Routed(const std::string& policy, const WorkerProcess* w) {
  return absl::StrCat("tandem_router_routed_total{pool=\"decode\",policy=\"", policy, "\",worker=\"", w->address(),
                      "\"}");
}
std::string PolicyEvent(const std::string& policy, const std::string& event) {
  return absl::StrCat("tandem_router_policy_events_total{pool=\"decode\",policy=\"", policy, "\",event=\"", event,
                      "\"}");
}

class RouterPolicyTest : public RouterTest {
 protected:
  // `n` aggregated workers behind a router with `policy` on the decode pool.
  // Health checks are rare (30 s) so a paused worker stays routable.
  std::vector<WorkerProcess*> StartCluster(int n, const std::string& policy, const std::string& params = "",
                                           const std::string& extra = "",
                                           const std::vector<std::string>& worker_args = {}) {
    std::vector<WorkerProcess*> workers;
    RouterYaml& y = yaml_;
    y = RouterYaml{.policy = policy, .policy_params = params, .extra = extra, .health_interval_s = 30};
    for (int i = 0; i < n; ++i) {
      workers.push_back(StartBoth(worker_args));
      if (workers.back() == nullptr) return {};
      y.decode.push_back(workers.back()->address());
    }
    if (StartRouter(y) == nullptr) return {};
    for (WorkerProcess* w : workers) {
      // /health needs one healthy worker; every one must be before routing.
      const std::string healthy =
          absl::StrCat("tandem_router_worker_healthy{pool=\"decode\",worker=\"", w->address(), "\"}");
      if (!WaitForMetric(healthy, [](double v) { return v == 1; })) {
        ADD_FAILURE() << w->address() << " never became healthy";
        return {};
      }
    }
    return workers;
  }

  // Sends `body` and waits until it either completes (returns the worker that
  // served it) or is counted in flight on `paused` beyond `hung_before`
  // requests (returns "" and leaves the future in `hung`).
  std::string SendUnlessHung(const json& body, WorkerProcess* paused, int hung_before,
                             std::vector<std::future<Reply>>& hung) {
    std::future<Reply> f = PostAsync("/v1/completions", body);
    const auto deadline = std::chrono::steady_clock::now() + seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      if (f.wait_for(std::chrono::milliseconds(10)) == std::future_status::ready) {
        Reply r = f.get();
        EXPECT_EQ(r.http.status, 200) << r.http.body;
        return DecodeWorker(r.http);
      }
      if (Metric(InFlight(paused)).value_or(0) > hung_before) {
        hung.push_back(std::move(f));
        return "";
      }
    }
    ADD_FAILURE() << "a request neither completed nor reached the paused worker";
    hung.push_back(std::move(f));
    return "";
  }

  void ExpectABackloggedHolderLosesToAnIdleWorker(const std::string& params,
                                                  const std::vector<std::string>& worker_args);

  // The two workers of `w` after a 128-token document of `group` was read
  // once: the one that holds it (in the router's KV index) and the other.
  // Both null on failure (reported).
  struct Holder {
    WorkerProcess* holder = nullptr;
    WorkerProcess* other = nullptr;
  };
  Holder CacheDocument(const std::vector<WorkerProcess*>& w, uint32_t group) {
    Reply first = Post("/v1/completions", Completion(PromptIds(group, 128, 0)));
    if (first.http.status != 200) {
      ADD_FAILURE() << first.http.body;
      return {};
    }
    WorkerProcess* holder = DecodeWorker(first.http) == w[0]->address() ? w[0] : w[1];
    if (!WaitForMetric("tandem_router_kv_index_blocks{pool=\"decode\"}", [](double v) { return v >= 8; })) {
      ADD_FAILURE() << "the document's 8 blocks never reached the router's index";
      return {};
    }
    return {holder, holder == w[0] ? w[1] : w[0]};
  }

  // A prefill and a decode worker behind a router in auto disaggregation
  // (threshold 64 tokens, kv_cache_aware, `extra` router config). Both
  // null on failure (reported).
  struct AutoPair {
    WorkerProcess* prefill = nullptr;
    WorkerProcess* decode = nullptr;
  };
  AutoPair StartAutoDisaggregation(const std::string& extra = "") {
    WorkerProcess* prefill = StartPrefill();
    WorkerProcess* decode = StartDecode();
    if (prefill == nullptr || decode == nullptr) {
      ADD_FAILURE() << "a worker did not start";
      return {};
    }
    if (StartRouter({.prefill = {prefill->address()},
                     .decode = {decode->address()},
                     .mode = "auto",
                     .auto_threshold_tokens = 64,
                     .policy = "kv_cache_aware",
                     .extra = extra}) == nullptr) {
      ADD_FAILURE() << "the router did not start";
      return {};
    }
    return {prefill, decode};
  }

  RouterYaml yaml_;  // StartCluster's
};

TEST_F(RouterPolicyTest, RoundRobinSpreadsEvenly) {
  std::vector<WorkerProcess*> w = StartCluster(3, "round_robin");
  ASSERT_EQ(w.size(), 3u);
  std::map<std::string, int> served;
  for (int i = 0; i < 12; ++i) {
    Reply r = Post("/v1/completions", Completion("spread me"));
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    ++served[DecodeWorker(r.http)];
  }
  for (WorkerProcess* x : w) {
    EXPECT_EQ(served[x->address()], 4) << x->address();
    EXPECT_EQ(Metric(Routed("round_robin", x)), 4) << x->address();
  }
}

TEST_F(RouterPolicyTest, RandomIsSeededAndCoversEveryWorker) {
  std::vector<WorkerProcess*> w = StartCluster(3, "random", "        seed: 7\n");
  ASSERT_EQ(w.size(), 3u);
  auto sequence = [&] {
    std::vector<std::string> seq;
    for (int i = 0; i < 24; ++i) {
      Reply r = Post("/v1/completions", Completion("anywhere"));
      EXPECT_EQ(r.http.status, 200) << r.http.body;
      seq.push_back(DecodeWorker(r.http));
    }
    return seq;
  };
  const std::vector<std::string> first = sequence();
  std::map<std::string, int> served;
  for (const std::string& s : first) ++served[s];
  for (WorkerProcess* x : w) EXPECT_GE(served[x->address()], 2) << x->address();
  EXPECT_EQ(served.size(), 3u);
  // A new router with the same seed routes the same sequence.
  RouterYaml y{.policy = "random", .policy_params = "        seed: 7\n", .health_interval_s = 30};
  for (WorkerProcess* x : w) y.decode.push_back(x->address());
  ASSERT_NE(StartRouter(y), nullptr);
  for (WorkerProcess* x : w) {
    ASSERT_TRUE(
        WaitForMetric(absl::StrCat("tandem_router_worker_healthy{pool=\"decode\",worker=\"", x->address(), "\"}"),
                      [](double v) { return v == 1; }));
  }
  EXPECT_EQ(sequence(), first);
}

// least_request and power_of_two (with two workers both candidates are
// always compared) steer around a hung worker once it holds one request.
class LoadAwarePolicyTest : public RouterPolicyTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(LoadAwarePolicyTest, AvoidsTheWorkerWithRequestsInFlight) {
  std::vector<WorkerProcess*> w = StartCluster(2, GetParam());
  ASSERT_EQ(w.size(), 2u);
  std::vector<std::future<Reply>> hung;
  {
    PausedWorker paused(w[0]);
    // Until w0 holds a request, ties may send one there.
    for (int i = 0; i < 40 && hung.empty(); ++i) {
      const std::string served = SendUnlessHung(Completion("load"), w[0], 0, hung);
      if (!served.empty()) {
        EXPECT_EQ(served, w[1]->address());
      }
    }
    ASSERT_EQ(hung.size(), 1u) << "no request ever reached the paused worker";
    // Now every request goes to the idle worker.
    for (int i = 0; i < 10; ++i) {
      EXPECT_EQ(SendUnlessHung(Completion("load"), w[0], 1, hung), w[1]->address()) << i;
    }
    EXPECT_EQ(hung.size(), 1u);
  }
  // Resumed, the hung request completes where it was sent.
  for (auto& f : hung) {
    Reply r = f.get();
    EXPECT_EQ(r.http.status, 200) << r.http.body;
    EXPECT_EQ(DecodeWorker(r.http), w[0]->address());
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, LoadAwarePolicyTest, ::testing::Values("least_request", "power_of_two"));

TEST_F(RouterPolicyTest, StickySessionPinsSessionsAndRepinsWhenTheirWorkerDies) {
  // The session header is configurable.
  std::vector<WorkerProcess*> w = StartCluster(3, "sticky_session", "", "sessions:\n  header: X-Conversation\n");
  ASSERT_EQ(w.size(), 3u);
  std::map<std::string, std::set<std::string>> by_session;
  for (int round = 0; round < 3; ++round) {
    for (int s = 0; s < 6; ++s) {
      Reply r = Post("/v1/completions", Completion("turn"), {{"X-Conversation", absl::StrCat("s", s)}});
      ASSERT_EQ(r.http.status, 200) << r.http.body;
      by_session[absl::StrCat("s", s)].insert(DecodeWorker(r.http));
    }
  }
  std::map<std::string, int> sessions_per_worker;
  for (const auto& [session, workers] : by_session) {
    ASSERT_EQ(workers.size(), 1u) << session << " moved between workers";
    ++sessions_per_worker[*workers.begin()];
  }
  // New sessions are placed in turn: two per worker.
  for (WorkerProcess* x : w) EXPECT_EQ(sessions_per_worker[x->address()], 2) << x->address();
  // Without the header (the default name is not this router's): spread.
  std::set<std::string> anonymous;
  for (int i = 0; i < 6; ++i) {
    Reply r = Post("/v1/completions", Completion("no session"), {{"X-Session-ID", "s0"}});
    ASSERT_EQ(r.http.status, 200);
    anonymous.insert(DecodeWorker(r.http));
  }
  EXPECT_EQ(anonymous.size(), 3u);

  // s0's worker dies: s0 moves once, to one worker, and stays there; the
  // other sessions do not move unless they were on the dead worker too.
  const std::string dead = *by_session["s0"].begin();
  for (WorkerProcess* x : w) {
    if (x->address() == dead) Kill(x);
  }
  std::map<std::string, std::set<std::string>> after;
  for (int round = 0; round < 3; ++round) {
    for (int s = 0; s < 6; ++s) {
      Reply r = Post("/v1/completions", Completion("turn"), {{"X-Conversation", absl::StrCat("s", s)}});
      ASSERT_EQ(r.http.status, 200) << r.http.body;
      after[absl::StrCat("s", s)].insert(DecodeWorker(r.http));
    }
  }
  int moved = 0;
  for (const auto& [session, workers] : after) {
    ASSERT_EQ(workers.size(), 1u) << session << " moved more than once";
    EXPECT_NE(*workers.begin(), dead);
    if (*by_session[session].begin() == dead) {
      ++moved;
    } else {
      EXPECT_EQ(workers, by_session[session]) << session << " moved though its worker lives";
    }
  }
  EXPECT_EQ(moved, 2);
  EXPECT_EQ(Metric(PolicyEvent("sticky_session", "repins")), 2);

  // A reload that leaves the policy as it was keeps the pins (and counts).
  RouterYaml changed = yaml_;
  changed.extra += "timeouts:\n  first_token_s: 30\n";
  router()->Rewrite(changed.Text());
  router()->Signal(SIGHUP);
  ASSERT_TRUE(WaitForMetric("tandem_router_config_reloads_total{result=\"ok\"}", [](double v) { return v == 1; }));
  for (int s = 0; s < 6; ++s) {
    Reply r = Post("/v1/completions", Completion("turn"), {{"X-Conversation", absl::StrCat("s", s)}});
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    EXPECT_EQ(std::set<std::string>{DecodeWorker(r.http)}, after[absl::StrCat("s", s)]);
  }
  EXPECT_EQ(Metric(PolicyEvent("sticky_session", "repins")), 2);
}

TEST_F(RouterPolicyTest, PrefixAwareGroupsSharedPrefixesAndSpillsOverWhenLoaded) {
  std::vector<WorkerProcess*> w =
      StartCluster(2, "prefix_aware", "        prefix_tokens: 32\n        load_factor: 1.25\n");
  ASSERT_EQ(w.size(), 2u);
  // Sixteen groups sharing 48-token prefixes (the key is the first 32):
  // each group on one worker, the groups over both. (The ring depends on the
  // workers' ports: all groups land on one worker with probability 2^-15;
  // with eight groups it was 1 in 128, and it happened.)
  std::map<int, std::set<std::string>> by_group;
  for (int round = 0; round < 3; ++round) {
    for (int g = 0; g < 16; ++g) {
      Reply r = Post("/v1/completions", Completion(PromptIds(g, 48, round)));
      ASSERT_EQ(r.http.status, 200) << r.http.body;
      by_group[g].insert(DecodeWorker(r.http));
    }
  }
  std::set<std::string> owners;
  for (const auto& [g, workers] : by_group) {
    ASSERT_EQ(workers.size(), 1u) << "group " << g << " was split";
    owners.insert(*workers.begin());
  }
  EXPECT_EQ(owners.size(), 2u) << "sixteen groups all hashed to one worker";
  EXPECT_EQ(Metric(PolicyEvent("prefix_aware", "spillovers")), 0);

  // Group 0's owner hangs: it keeps taking the group while within
  // load_factor x the average (in flight 0 <= 0.625, then 1 <= 1.25), then
  // the group spills to the other worker (2 > 1.875).
  WorkerProcess* owner = w[0]->address() == *by_group[0].begin() ? w[0] : w[1];
  WorkerProcess* other = owner == w[0] ? w[1] : w[0];
  std::vector<std::future<Reply>> hung;
  {
    PausedWorker paused(owner);
    EXPECT_EQ(SendUnlessHung(Completion(PromptIds(0, 48, 10)), owner, 0, hung), "");
    EXPECT_EQ(SendUnlessHung(Completion(PromptIds(0, 48, 11)), owner, 1, hung), "");
    EXPECT_EQ(SendUnlessHung(Completion(PromptIds(0, 48, 12)), owner, 2, hung), other->address());
    EXPECT_EQ(Metric(PolicyEvent("prefix_aware", "spillovers")), 1);
  }
  for (auto& f : hung) {
    Reply r = f.get();
    EXPECT_EQ(r.http.status, 200) << r.http.body;
    EXPECT_EQ(DecodeWorker(r.http), owner->address());
  }
  // Idle again, the group is back on its owner.
  Reply r = Post("/v1/completions", Completion(PromptIds(0, 48, 13)));
  EXPECT_EQ(DecodeWorker(r.http), owner->address());
}

// With the workers' KV event streams (exact index) and without them (an
// approximate index of the router's own decisions).
class KvCacheAwareTest : public RouterPolicyTest, public ::testing::WithParamInterface<bool> {};

TEST_P(KvCacheAwareTest, SendsASharedPrefixToTheWorkerHoldingIt) {
  const bool events = GetParam();
  std::vector<WorkerProcess*> w =
      StartCluster(3, "kv_cache_aware", "", absl::StrCat("kv_events:\n  enabled: ", events ? "true" : "false", "\n"));
  ASSERT_EQ(w.size(), 3u);
  ASSERT_TRUE(WaitForMetric(
      absl::StrCat("tandem_router_kv_index_workers{pool=\"decode\",mode=\"", events ? "exact" : "approximate", "\"}"),
      [](double v) { return v == 3; }));

  // A 256-token document (16 blocks) is read once...
  Reply first = Post("/v1/completions", Completion(PromptIds(1, 256, 0)));
  ASSERT_EQ(first.http.status, 200) << first.http.body;
  const std::string holder = DecodeWorker(first.http);
  ASSERT_TRUE(WaitForMetric("tandem_router_kv_index_blocks{pool=\"decode\"}", [](double v) { return v >= 16; }));
  // ...then every question about it goes to the worker that holds it, and
  // is served from its prefix cache.
  for (int q = 1; q <= 6; ++q) {
    Reply r = Post("/v1/completions", Completion(PromptIds(1, 256, q)));
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    EXPECT_EQ(DecodeWorker(r.http), holder) << "question " << q;
    EXPECT_GE(r.json["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 256) << r.http.body;
  }
  // Unrelated prompts (no cached blocks anywhere) still spread over all.
  std::set<std::string> cold;
  for (int g = 2; g < 8; ++g) {
    Reply r = Post("/v1/completions", Completion(PromptIds(g, 40, 0)));
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    cold.insert(DecodeWorker(r.http));
  }
  EXPECT_GE(cold.size(), 2u);
  EXPECT_GE(Metric(PolicyEvent("kv_cache_aware", "matched_blocks")), 6 * 16);
  EXPECT_GE(Metric("tandem_router_cached_prompt_tokens_total"), 6 * 256);
}

INSTANTIATE_TEST_SUITE_P(KvEvents, KvCacheAwareTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "Exact" : "Approximate"; });

// With the overlap weighted low, a holder with a prefill backlog of 64 tokens
// (the load's scale: the router's prefill_tokens_scale, or else each worker's
// step budget) loses the request to an idle worker.
void RouterPolicyTest::ExpectABackloggedHolderLosesToAnIdleWorker(const std::string& params,
                                                                  const std::vector<std::string>& worker_args) {
  std::vector<WorkerProcess*> w =
      StartCluster(2, "kv_cache_aware", absl::StrCat("        overlap_weight: 0.1\n", params), "", worker_args);
  ASSERT_EQ(w.size(), 2u);
  const auto [holder, other] = CacheDocument(w, 3);
  ASSERT_NE(holder, nullptr);
  // Without load, the holder wins the document's questions.
  Reply warm = Post("/v1/completions", Completion(PromptIds(3, 128, 1)));
  EXPECT_EQ(DecodeWorker(warm.http), holder->address());
  std::vector<std::future<Reply>> hung;
  {
    PausedWorker paused(holder);
    // Cold prompts go in turn until one hangs on the holder: its 136 prompt
    // tokens wait there, over the 64-token scale (load 0.5 x 1 > 0.1 x 1).
    for (int i = 0; i < 10 && hung.empty(); ++i) {
      const std::string served = SendUnlessHung(Completion(PromptIds(20 + i, 128, 0)), holder, 0, hung);
      if (!served.empty()) {
        EXPECT_EQ(served, other->address());
      }
    }
    ASSERT_EQ(hung.size(), 1u);
    EXPECT_EQ(SendUnlessHung(Completion(PromptIds(3, 128, 2)), holder, 1, hung), other->address());
  }
  for (auto& f : hung) EXPECT_EQ(f.get().http.status, 200);
}

TEST_F(RouterPolicyTest, KvCacheAwareWeighsTheCachedPrefixAgainstLoad) {
  ExpectABackloggedHolderLosesToAnIdleWorker("        prefill_tokens_scale: 64\n", {});
}

TEST_F(RouterPolicyTest, KvCacheAwareScalesLoadByEachWorkersStepBudget) {
  ExpectABackloggedHolderLosesToAnIdleWorker("", {"--max-batched-tokens", "64"});
}

// kv_cache_aware's load bound (load_factor 1.25 by default): a holder with
// two requests in flight while the other worker has none is passed over for
// a prompt sharing only a short prefix with it (2 blocks, under the workers'
// 64-token step), and keeps one whose cached prefix is a step or longer.
TEST_F(RouterPolicyTest, KvCacheAwareBoundsLoadUnlessThePrefixIsLongerThanAStep) {
  std::vector<WorkerProcess*> w = StartCluster(2, "kv_cache_aware", "", "", {"--max-batched-tokens", "64"});
  ASSERT_EQ(w.size(), 2u);
  // A 128-token document (8 blocks); its first 32 tokens start other prompts.
  const auto [holder, other] = CacheDocument(w, 6);
  ASSERT_NE(holder, nullptr);
  std::vector<std::future<Reply>> hung;
  {
    PausedWorker paused(holder);
    // Two questions about the document hang on the holder: 0 <= 1.25 x 1 / 2,
    // then 1 <= 1.25 x 2 / 2.
    EXPECT_EQ(SendUnlessHung(Completion(PromptIds(6, 128, 1)), holder, 0, hung), "");
    EXPECT_EQ(SendUnlessHung(Completion(PromptIds(6, 128, 2)), holder, 1, hung), "");
    ASSERT_EQ(hung.size(), 2u);
    // 2 > 1.25 x 3 / 2: a prompt sharing 32 tokens with the holder spills...
    EXPECT_EQ(SendUnlessHung(Completion(PromptIds(6, 32, 3)), holder, 2, hung), other->address());
    EXPECT_EQ(Metric(PolicyEvent("kv_cache_aware", "spillovers")), 1);
    // ...one that finds the whole document there (128 tokens >= a step) stays.
    EXPECT_EQ(SendUnlessHung(Completion(PromptIds(6, 128, 4)), holder, 2, hung), "");
    EXPECT_EQ(hung.size(), 3u);
  }
  for (auto& f : hung) {
    Reply r = f.get();
    EXPECT_EQ(r.http.status, 200) << r.http.body;
    EXPECT_EQ(DecodeWorker(r.http), holder->address());
  }
  EXPECT_EQ(Metric(PolicyEvent("kv_cache_aware", "spillovers")), 1);
}

TEST_F(RouterPolicyTest, AutoDisaggregationPrefillsLocallyWhatIsShortOrCached) {
  const auto [prefill, decode] = StartAutoDisaggregation();
  ASSERT_TRUE(prefill && decode);
  ASSERT_TRUE(
      WaitForMetric("tandem_router_kv_index_workers{pool=\"decode\",mode=\"exact\"}", [](double v) { return v == 1; }));
  // Short: prefilled on the decode worker.
  Reply r = Post("/v1/completions", Completion(PromptIds(5, 24, 0)));
  ASSERT_EQ(r.http.status, 200) << r.http.body;
  EXPECT_EQ(r.http.Header("x-tandem-prefill-worker"), decode->address());
  // Long and new: prefilled on the prefill worker, its KV moved.
  r = Post("/v1/completions", Completion(PromptIds(6, 200, 0)));
  ASSERT_EQ(r.http.status, 200) << r.http.body;
  EXPECT_EQ(r.http.Header("x-tandem-prefill-worker"), prefill->address());
  EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), decode->address());
  // The decode worker now holds those blocks (pulled): the same document
  // with a new question is mostly cached there, so it stays local.
  ASSERT_TRUE(WaitForMetric("tandem_router_kv_index_blocks{pool=\"decode\"}", [](double v) { return v >= 2 + 13; }));
  // The index's bookkeeping is on /metrics: events applied, nothing dropped, and
  // per worker its entries and how long ago its last events came.
  EXPECT_GE(Metric("tandem_router_kv_events_total{pool=\"decode\",outcome=\"applied\"}").value_or(0), 2);
  EXPECT_EQ(Metric("tandem_router_kv_event_batches_dropped_total{pool=\"decode\",reason=\"seq_gap\"}"), 0);
  EXPECT_EQ(Metric("tandem_router_kv_index_entries_dropped_total{pool=\"decode\",reason=\"evicted\"}"), 0);
  EXPECT_GE(Metric(absl::StrCat("tandem_router_kv_index_worker_blocks{pool=\"decode\",worker=\"", decode->address(),
                                "\",mode=\"exact\"}"))
                .value_or(0),
            2 + 13);
  const std::optional<double> age = Metric(
      absl::StrCat("tandem_router_kv_index_worker_age_seconds{pool=\"decode\",worker=\"", decode->address(), "\"}"));
  ASSERT_TRUE(age.has_value());
  EXPECT_GE(*age, 0);
  EXPECT_LT(*age, 60);
  r = Post("/v1/completions", Completion(PromptIds(6, 200, 1)));
  ASSERT_EQ(r.http.status, 200) << r.http.body;
  EXPECT_EQ(r.http.Header("x-tandem-prefill-worker"), decode->address());
  EXPECT_GE(r.json["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 192);
}

// Without KV events the decode pool's index learns from routing alone: what
// auto weighs is the prefix the policy expected the worker to hold before
// this request, not the request it has just recorded there.
TEST_F(RouterPolicyTest, AutoDisaggregationWithoutKvEventsWeighsWhatWasRoutedBefore) {
  const auto [prefill, decode] = StartAutoDisaggregation("kv_events:\n  enabled: false\n");
  ASSERT_TRUE(prefill && decode);
  // Long and new: prefilled on the prefill worker.
  Reply r = Post("/v1/completions", Completion(PromptIds(7, 200, 0)));
  ASSERT_EQ(r.http.status, 200) << r.http.body;
  EXPECT_EQ(r.http.Header("x-tandem-prefill-worker"), prefill->address());
  EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), decode->address());
  // The same document again: routed there before, so expected cached: local.
  r = Post("/v1/completions", Completion(PromptIds(7, 200, 1)));
  ASSERT_EQ(r.http.status, 200) << r.http.body;
  EXPECT_EQ(r.http.Header("x-tandem-prefill-worker"), decode->address());
}

// Workers whose KV transports reach only part of the cluster (--kv-domain:
// two racks, and a decode worker no prefill worker reaches): every request
// is prefilled in its decode worker's domain, or by the decode worker itself
// where no prefill worker shares it; the skips are counted and explained.
TEST_F(RouterPolicyTest, PrefillWorkersArePairedWithinTheDecodeWorkersKvDomain) {
  WorkerProcess* prefill_a = StartPrefill({"--kv-domain", "rack-a"});
  WorkerProcess* prefill_b = StartPrefill({"--kv-domain", "rack-b"});
  WorkerProcess* decode_a = StartDecode({"--kv-domain", "rack-a"});
  WorkerProcess* decode_b = StartDecode({"--kv-domain", "rack-b"});
  WorkerProcess* decode_c = StartDecode({"--kv-domain", "rack-c"});
  ASSERT_TRUE(prefill_a && prefill_b && decode_a && decode_b && decode_c);
  ASSERT_NE(StartRouter({.prefill = {prefill_a->address(), prefill_b->address()},
                         .decode = {decode_a->address(), decode_b->address(), decode_c->address()},
                         .mode = "always",
                         .policy = "round_robin"}),
            nullptr);
  const std::map<std::string, std::string> partner = {{decode_a->address(), prefill_a->address()},
                                                      {decode_b->address(), prefill_b->address()},
                                                      {decode_c->address(), decode_c->address()}};
  std::map<std::string, int> served;
  for (int i = 0; i < 12; ++i) {
    Reply r = Post("/v1/completions", Completion(PromptIds(i, 40, 0)));
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    const std::string decode = DecodeWorker(r.http);
    ++served[decode];
    ASSERT_EQ(partner.count(decode), 1u) << decode;
    EXPECT_EQ(r.http.Header("x-tandem-prefill-worker"), partner.at(decode)) << "request " << i;
  }
  EXPECT_EQ(served.size(), 3u);
  EXPECT_EQ(Metric("tandem_router_kv_domain_skips_total").value_or(0), 16);  // 1 a request to a and b, 2 to c
  // Explained: the prefill workers passed over, and why.
  for (int i = 0; i < 3; ++i) {
    Reply r = Post("/v1/completions", Completion(PromptIds(100 + i, 40, 0)), {{"x-tandem-explain", "1"}});
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    const json route = json::parse(r.http.Header("x-tandem-route"), nullptr, false);
    ASSERT_TRUE(route.is_array()) << r.http.Header("x-tandem-route");
    const bool lone = DecodeWorker(r.http) == decode_c->address();
    bool explained = false;
    int candidates_skipped = 0;
    for (const json& d : route) {
      if (d.contains("skipped")) {
        explained = true;
        const std::string why = d["why"].get<std::string>();
        EXPECT_THAT(why, ::testing::HasSubstr("kv_domain: the decode worker's is rack-")) << d;
        EXPECT_EQ(why.find("none left: the decode worker prefills") != std::string::npos, lone) << d;
      }
      // Each prefill candidate passed over says why: its domain, not a
      // full KV cache.
      if (d.value("pool", "") == "prefill" && d.contains("candidates")) {
        for (const json& c : d["candidates"]) {
          if (!c.contains("skipped")) continue;
          ++candidates_skipped;
          EXPECT_THAT(c["skipped"].get<std::string>(), ::testing::HasSubstr("kv_domain rack-")) << c;
          EXPECT_THAT(c["skipped"].get<std::string>(), ::testing::HasSubstr("cannot reach the decode worker's")) << c;
        }
      }
    }
    EXPECT_TRUE(explained) << route;
    EXPECT_EQ(candidates_skipped, lone ? 2 : 1) << route;
  }
}

}  // namespace
}  // namespace tandem::testing
