// The router end to end: real worker processes behind a real `tandem router`,
// driven over HTTP as OpenAI clients drive it. Outputs are checked against
// the workers' own gRPC answers, aggregated against disaggregated, streamed
// against whole; every bad input gets its status; a killed worker, a client
// that hangs up, overload and config reloads are survived.
#include <signal.h>

#include <atomic>
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
#include "nlohmann/json.hpp"
#include "tests/testing/router_test.h"
#include "tests/testing/worker_client.h"

namespace tandem::testing {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

json Chat(const std::string& content, int max_tokens, json extra = json::object()) {
  json body = {{"model", "tiny"},
               {"messages", json::array({{{"role", "user"}, {"content", content}}})},
               {"max_tokens", max_tokens}};
  body.update(extra);
  return body;
}

json Completion(json prompt, int max_tokens, json extra = json::object()) {
  json body = {{"model", "tiny"}, {"prompt", std::move(prompt)}, {"max_tokens", max_tokens}};
  body.update(extra);
  return body;
}

// The concatenated delta contents (chat) or texts (completions) of a stream,
// and its parsed events ([DONE] excluded).
struct Stream {
  std::string text;
  std::vector<json> events;
  bool done = false;
};
Stream ParseStream(const std::string& body, bool chat) {
  Stream s;
  for (const std::string& data : SseData(body)) {
    if (data == "[DONE]") {
      s.done = true;
      continue;
    }
    json e = json::parse(data, nullptr, false);
    if (e.is_discarded()) {
      ADD_FAILURE() << "bad SSE event: " << data;
      continue;
    }
    if (e.contains("choices") && !e["choices"].empty()) {
      const json& c = e["choices"][0];
      if (chat && c["delta"].contains("content")) s.text += c["delta"]["content"].get<std::string>();
      if (!chat) s.text += c["text"].get<std::string>();
    }
    s.events.push_back(std::move(e));
  }
  return s;
}

class RouterE2eTest : public RouterTest {};

TEST_F(RouterE2eTest, ChatMatchesTheWorkersOwnGreedyOutput) {
  WorkerProcess* w = StartBoth();
  ASSERT_NE(w, nullptr);
  ASSERT_NE(StartRouter({.decode = {w->address()}}), nullptr);

  Reply r = Post("/v1/chat/completions", Chat("Tell me a story.", 24, {{"temperature", 0}}));
  ASSERT_EQ(r.http.status, 200) << r.http.body;
  EXPECT_EQ(r.json["object"], "chat.completion");
  EXPECT_EQ(r.json["model"], "tiny");
  EXPECT_THAT(r.json["id"].get<std::string>(), ::testing::StartsWith("chatcmpl-"));
  const json& choice = r.json["choices"][0];
  EXPECT_EQ(choice["message"]["role"], "assistant");
  EXPECT_EQ(r.http.Header("x-tandem-prefill-worker"), w->address());
  EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), w->address());
  EXPECT_FALSE(r.http.Header("x-request-id").empty());

  // The same prompt ids straight to the worker give the same tokens.
  Reply tok = Post("/tokenize", {{"messages", json::array({{{"role", "user"}, {"content", "Tell me a story."}}})}});
  ASSERT_EQ(tok.http.status, 200) << tok.http.body;
  EXPECT_EQ(r.json["usage"]["prompt_tokens"], tok.json["count"]);
  v1::GenerateRequest req;
  for (int id : tok.json["tokens"]) req.add_prompt_token_ids(id);
  req.mutable_sampling()->set_temperature(0);
  req.mutable_sampling()->set_max_tokens(24);
  Output direct = Generate(w->stub(), req);
  ASSERT_TRUE(direct.status.ok()) << direct.status.error_message();
  Reply text = Post("/detokenize", {{"tokens", direct.tokens}});
  ASSERT_EQ(text.http.status, 200);
  // Another model's name is refused as everywhere else, not ignored.
  Reply other = Post("/detokenize", {{"model", "not-served"}, {"tokens", direct.tokens}});
  EXPECT_EQ(other.http.status, 404) << other.http.body;
  EXPECT_EQ(other.json["error"]["code"], "model_not_found") << other.http.body;
  Reply fractional = Post("/detokenize", {{"tokens", {1, 2.5}}});
  EXPECT_EQ(fractional.http.status, 400) << fractional.http.body;
  EXPECT_EQ(fractional.json["error"]["param"], "tokens[1]") << fractional.http.body;
  // The chat text skips special tokens (an EOS at the end).
  std::vector<int> plain;
  for (int t : direct.tokens)
    if (t < 256) plain.push_back(t);
  Reply plain_text = Post("/detokenize", {{"tokens", plain}});
  EXPECT_EQ(choice["message"]["content"], plain_text.json["prompt"]);
  EXPECT_EQ(r.json["usage"]["completion_tokens"], static_cast<int>(direct.tokens.size()));
  EXPECT_EQ(choice["finish_reason"], direct.tokens.size() == 24 ? "length" : "stop");
}

TEST_F(RouterE2eTest, CompletionsTextIdsEchoAndLogprobs) {
  WorkerProcess* w = StartBoth();
  ASSERT_NE(w, nullptr);
  ASSERT_NE(StartRouter({.decode = {w->address()}}), nullptr);

  Reply a = Post("/v1/completions", Completion("Hello", 8, {{"temperature", 0}}));
  ASSERT_EQ(a.http.status, 200) << a.http.body;
  EXPECT_EQ(a.json["object"], "text_completion");
  EXPECT_EQ(a.json["usage"]["prompt_tokens"], 5);  // the built-in tokenizer: one id per byte
  // Token ids give the same output as the text they encode.
  Reply b = Post("/v1/completions", Completion(json::array({72, 101, 108, 108, 111}), 8, {{"temperature", 0}}));
  ASSERT_EQ(b.http.status, 200) << b.http.body;
  EXPECT_EQ(a.json["choices"][0]["text"], b.json["choices"][0]["text"]);
  // echo prepends the prompt.
  Reply e = Post("/v1/completions", Completion("Hello", 8, {{"temperature", 0}, {"echo", true}}));
  ASSERT_EQ(e.http.status, 200);
  EXPECT_EQ(e.json["choices"][0]["text"].get<std::string>(), "Hello" + a.json["choices"][0]["text"].get<std::string>());
  // logprobs: one entry per token, top alternatives, token_id:N when asked.
  Reply l = Post("/v1/completions",
                 Completion("Hello", 6, {{"temperature", 0}, {"logprobs", 3}, {"return_tokens_as_token_ids", true}}));
  ASSERT_EQ(l.http.status, 200) << l.http.body;
  const json& lp = l.json["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 6u);
  EXPECT_THAT(lp["tokens"][0].get<std::string>(), ::testing::StartsWith("token_id:"));
  EXPECT_EQ(lp["top_logprobs"][0].size(), 3u);
  EXPECT_LE(lp["token_logprobs"][0].get<double>(), 0.0);
}

TEST_F(RouterE2eTest, StreamingEqualsWholeResponses) {
  WorkerProcess* w = StartBoth();
  ASSERT_NE(w, nullptr);
  ASSERT_NE(StartRouter({.decode = {w->address()}}), nullptr);
  const json opts = {{"seed", 7}, {"temperature", 0.9}};
  Reply whole = Post("/v1/chat/completions", Chat("Stream me", 30, opts));
  ASSERT_EQ(whole.http.status, 200) << whole.http.body;
  json stream_opts = opts;
  stream_opts["stream"] = true;
  stream_opts["stream_options"] = {{"include_usage", true}};
  Reply streamed = Post("/v1/chat/completions", Chat("Stream me", 30, stream_opts));
  ASSERT_EQ(streamed.http.status, 200);
  EXPECT_THAT(streamed.http.Header("content-type"), HasSubstr("text/event-stream"));
  Stream s = ParseStream(streamed.http.body, /*chat=*/true);
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.text, whole.json["choices"][0]["message"]["content"]);
  ASSERT_GE(s.events.size(), 2u);
  EXPECT_EQ(s.events.front()["choices"][0]["delta"]["role"], "assistant");
  const json& usage = s.events.back();
  EXPECT_TRUE(usage["choices"].empty());
  // (The second request may find the prompt cached: cached_tokens differ.)
  EXPECT_EQ(usage["usage"]["prompt_tokens"], whole.json["usage"]["prompt_tokens"]);
  EXPECT_EQ(usage["usage"]["completion_tokens"], whole.json["usage"]["completion_tokens"]);
  EXPECT_EQ(s.events[s.events.size() - 2]["choices"][0]["finish_reason"], whole.json["choices"][0]["finish_reason"]);

  // Completions stream the same way; n = 2 streams two choices.
  Reply c = Post("/v1/completions", Completion("abc", 10, {{"stream", true}, {"n", 2}, {"seed", 3}}));
  ASSERT_EQ(c.http.status, 200);
  std::set<int> indexes;
  for (const json& e : ParseStream(c.http.body, false).events) indexes.insert(e["choices"][0]["index"].get<int>());
  EXPECT_EQ(indexes, (std::set<int>{0, 1}));
}

TEST_F(RouterE2eTest, DisaggregatedMatchesAggregated) {
  WorkerProcess* both = StartBoth();
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(both && prefill && decode);
  auto aggregated = RouterProcess::Start(RouterYaml{.decode = {both->address()}}.Text());
  ASSERT_TRUE(aggregated.ok()) << aggregated.status();
  ASSERT_TRUE(WaitHealthy((*aggregated)->url(), std::chrono::seconds(30)));
  ASSERT_NE(StartRouter({.prefill = {prefill->address()}, .decode = {decode->address()}, .mode = "always"}), nullptr);
  const std::vector<std::string> prompts = {"The quick brown fox", std::string(300, 'x') + " long one", "Short"};
  for (const std::string& p : prompts) {
    for (const json& opts : {json{{"temperature", 0}}, json{{"temperature", 0.8}, {"seed", 11}}}) {
      const json body = Chat(p, 20, opts);
      HttpResponse a = HttpPost((*aggregated)->url(), "/v1/chat/completions", body.dump());
      Reply d = Post("/v1/chat/completions", body);
      ASSERT_EQ(a.status, 200) << a.body;
      ASSERT_EQ(d.http.status, 200) << d.http.body;
      const json aj = json::parse(a.body);
      EXPECT_EQ(d.json["choices"][0]["message"]["content"], aj["choices"][0]["message"]["content"])
          << p.substr(0, 30) << " " << opts.dump();
      EXPECT_EQ(d.json["usage"]["completion_tokens"], aj["usage"]["completion_tokens"]);
      EXPECT_EQ(d.http.Header("x-tandem-prefill-worker"), prefill->address());
      EXPECT_EQ(d.http.Header("x-tandem-decode-worker"), decode->address());
    }
  }
  // Streaming through the split path gives the same text.
  Reply whole = Post("/v1/chat/completions", Chat("split stream", 25, {{"seed", 5}}));
  Reply streamed = Post("/v1/chat/completions", Chat("split stream", 25, {{"seed", 5}, {"stream", true}}));
  EXPECT_EQ(ParseStream(streamed.http.body, true).text, whole.json["choices"][0]["message"]["content"]);
  // The decode worker pulled KV for the split requests.
  bool ok = false;
  v1::LoadReport load = WaitForLoad(
      decode->stub(), [](const v1::LoadReport& l) { return l.kv_pulls() > 0; }, &ok);
  EXPECT_TRUE(ok) << load.DebugString();
  Reply metrics = Get("/metrics");
  EXPECT_THAT(metrics.http.body, HasSubstr("tandem_router_time_to_first_token_seconds_bucket{mode=\"disaggregated\""));
  (*aggregated)->Stop();
}

// Both workers --kv-delivery push: the router forwards the reservation
// (with the decode worker's pool) untouched, and the prefill worker writes
// the KV into it; the text equals aggregated serving's.
TEST_F(RouterE2eTest, PushedKvThroughTheRouterMatchesAggregated) {
  WorkerProcess* both = StartBoth();
  WorkerProcess* prefill = StartPrefill({"--kv-delivery", "push"});
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  ASSERT_TRUE(both && prefill && decode);
  auto aggregated = RouterProcess::Start(RouterYaml{.decode = {both->address()}}.Text());
  ASSERT_TRUE(aggregated.ok()) << aggregated.status();
  ASSERT_TRUE(WaitHealthy((*aggregated)->url(), std::chrono::seconds(30)));
  ASSERT_NE(StartRouter({.prefill = {prefill->address()}, .decode = {decode->address()}, .mode = "always"}), nullptr);
  for (const std::string& p : {std::string("Pushed fox"), std::string(200, 'y') + " pushed long one"}) {
    const json body = Chat(p, 16, {{"temperature", 0.7}, {"seed", 4}});
    HttpResponse a = HttpPost((*aggregated)->url(), "/v1/chat/completions", body.dump());
    Reply d = Post("/v1/chat/completions", body);
    ASSERT_EQ(a.status, 200) << a.body;
    ASSERT_EQ(d.http.status, 200) << d.http.body;
    EXPECT_EQ(d.json["choices"][0]["message"]["content"], json::parse(a.body)["choices"][0]["message"]["content"])
        << p.substr(0, 30);
    EXPECT_EQ(d.http.Header("x-tandem-prefill-worker"), prefill->address());
  }
  bool ok = false;
  v1::LoadReport load = WaitForLoad(
      decode->stub(), [](const v1::LoadReport& l) { return l.kv_pushes_received() == 2; }, &ok);
  EXPECT_TRUE(ok) << load.DebugString();
  EXPECT_EQ(load.kv_pulls(), 0);
  // The prefill worker counts a push once PUSHED is answered, which may
  // come after the client's response.
  load = WaitForLoad(
      prefill->stub(), [](const v1::LoadReport& l) { return l.kv_pushes() == 2; }, &ok);
  EXPECT_TRUE(ok) << load.DebugString();
  (*aggregated)->Stop();
}

TEST_F(RouterE2eTest, StopStringsCutTheTextAndStopTheWorker) {
  WorkerProcess* w = StartBoth();
  ASSERT_NE(w, nullptr);
  ASSERT_NE(StartRouter({.decode = {w->address()}}), nullptr);
  // The built-in model has random weights: take a stop string from its own
  // greedy output (a run of ASCII characters after the start).
  Reply full = Post("/v1/completions", Completion("Once upon a time", 64, {{"temperature", 0}, {"ignore_eos", true}}));
  ASSERT_EQ(full.http.status, 200) << full.http.body;
  const std::string text = full.json["choices"][0]["text"];
  size_t at = std::string::npos;
  for (size_t i = 8; i + 2 < text.size(); ++i) {
    bool ascii = true;
    for (size_t k = 0; k < 2; ++k)
      ascii = ascii && static_cast<unsigned char>(text[i + k]) < 0x80 && text[i + k] >= 0x20;
    if (ascii && text.find(text.substr(i, 2)) == i) {
      at = i;
      break;
    }
  }
  if (at == std::string::npos) GTEST_SKIP() << "no usable stop string in: " << text;
  const std::string stop = text.substr(at, 2);
  for (bool stream : {false, true}) {
    Reply r = Post("/v1/completions", Completion("Once upon a time", 64,
                                                 {{"temperature", 0},
                                                  {"ignore_eos", true},
                                                  {"stop", json::array({"@@never@@", stop})},
                                                  {"stream", stream}}));
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    if (!stream) {
      EXPECT_EQ(r.json["choices"][0]["text"], text.substr(0, at));
      EXPECT_EQ(r.json["choices"][0]["finish_reason"], "stop");
      EXPECT_LT(r.json["usage"]["completion_tokens"].get<int>(), 64);
    } else {
      Stream s = ParseStream(r.http.body, false);
      EXPECT_EQ(s.text, text.substr(0, at));
      EXPECT_EQ(s.events.back()["choices"][0]["finish_reason"], "stop");
    }
  }
  // The worker stopped generating (nothing left running).
  ExpectIdle(w->stub(), "after the stop strings matched");
}

TEST_F(RouterE2eTest, BadInputsGetOpenAiErrors) {
  WorkerProcess* w = StartBoth();
  ASSERT_NE(w, nullptr);
  ASSERT_NE(StartRouter({.decode = {w->address()}, .extra = "limits:\n  max_body_bytes: 65536\n"}), nullptr);
  auto expect = [&](const std::string& target, const std::string& body, int status, const std::string& param) {
    HttpResponse r = HttpPost(router()->url(), target, body);
    EXPECT_EQ(r.status, status) << body.substr(0, 80) << " -> " << r.body;
    json e = json::parse(r.body, nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << r.body;
    ASSERT_TRUE(e.contains("error")) << r.body;
    EXPECT_FALSE(e["error"]["message"].get<std::string>().empty());
    if (!param.empty()) {
      EXPECT_EQ(e["error"]["param"], param) << r.body;
    }
  };
  expect("/v1/chat/completions", "{not json", 400, "");
  expect("/v1/chat/completions", R"({"model": "tiny"})", 400, "messages");
  expect("/v1/chat/completions", Chat("x", 5, {{"temperature", "hot"}}).dump(), 400, "temperature");
  expect("/v1/chat/completions", Chat("x", 5, {{"n", 0}}).dump(), 400, "n");
  expect("/v1/chat/completions", Chat("x", 5, {{"model", "gpt-9"}}).dump(), 404, "model");
  expect("/v1/chat/completions", Chat("x", 1 << 30).dump(), 400, "max_tokens");
  expect("/v1/completions", Completion(json::array({1, 2, 999999}), 5).dump(), 400, "prompt");
  expect("/v1/completions", Completion("", 5).dump(), 400, "prompt");
  expect("/v1/completions", Completion(std::string(70000, 'a'), 5).dump(), 413, "");
  expect("/tokenize", R"({"prompt": 5})", 400, "prompt");
  expect("/detokenize", R"({"tokens": [-1]})", 400, "tokens[0]");
  EXPECT_EQ(HttpGet(router()->url(), "/v1/chat/completions").status, 405);
  EXPECT_EQ(HttpGet(router()->url(), "/v2/nothing").status, 404);
  // The router is fine afterwards.
  EXPECT_EQ(Post("/v1/chat/completions", Chat("still here", 4)).http.status, 200);
}

TEST_F(RouterE2eTest, NoHealthyWorkerIs503) {
  // Nothing listens on the worker's port.
  ASSERT_NE(StartRouter({.decode = {"127.0.0.1:1"}}, /*wait_healthy=*/false), nullptr);
  Reply h = Get("/health");
  EXPECT_EQ(h.http.status, 503);
  Reply r = Post("/v1/chat/completions", Chat("anyone?", 4));
  EXPECT_EQ(r.http.status, 503) << r.http.body;
  EXPECT_EQ(r.http.Header("retry-after"), "1");
  EXPECT_EQ(r.json["error"]["type"], "server_error");
}

TEST_F(RouterE2eTest, OverloadIs429WithRetryAfter) {
  WorkerProcess* w = StartBoth();
  ASSERT_NE(w, nullptr);
  ASSERT_NE(StartRouter({.decode = {w->address()}, .extra = "limits:\n  max_in_flight: 1\n  max_queue: 0\n"}), nullptr);
  std::thread long_one([&] {
    HttpPost(router()->url(), "/v1/completions",
             Completion("long", 400, {{"ignore_eos", true}, {"stream", true}}).dump());
  });
  bool ok = false;
  WaitForLoad(
      w->stub(), [](const v1::LoadReport& l) { return l.running_sequences() == 1; }, &ok);
  ASSERT_TRUE(ok);
  Reply r = Post("/v1/completions", Completion("second", 4));
  EXPECT_EQ(r.http.status, 429) << r.http.body;
  EXPECT_EQ(r.http.Header("retry-after"), "1");
  EXPECT_EQ(r.json["error"]["type"], "rate_limit_error");
  long_one.join();
  EXPECT_EQ(Post("/v1/completions", Completion("third", 4)).http.status, 200);
}

TEST_F(RouterE2eTest, ClientThatHangsUpCancelsItsWork) {
  // builtin:small is slow enough on one thread that 1500 tokens take many
  // seconds: the worker idles soon after a hang-up only if it was cancelled.
  // A second worker idles too: the cancelled call (CANCELLED) is not retried
  // there, though a worker's own CANCELLED is.
  WorkerProcess* w = StartBoth({"--model", "builtin:small"});
  WorkerProcess* spare = StartBoth({"--model", "builtin:small"});
  ASSERT_TRUE(w && spare);
  ASSERT_NE(StartRouter({.decode = {w->address(), spare->address()}}), nullptr);
  for (bool stream : {true, false}) {
    // Streaming: hang up after the first bytes; whole: while it runs.
    std::thread client([&] {
      PostAndHangUp(router()->url(), "/v1/completions",
                    Completion("forever", 1500, {{"ignore_eos", true}, {"stream", stream}}).dump(), stream ? 200 : 0,
                    std::chrono::milliseconds(stream ? 0 : 300));
    });
    if (!stream) {
      // (A streaming client that read its first bytes saw the request run.)
      EXPECT_TRUE(WaitUntil(
          [&] { return GetLoad(w->stub()).running_sequences() + GetLoad(spare->stub()).running_sequences() == 1; },
          std::chrono::seconds(10)))
          << "the request never ran";
    }
    client.join();
    for (WorkerProcess* x : {w, spare}) {
      ExpectIdle(x->stub(), stream ? "after a streaming client hung up" : "after a client hung up",
                 std::chrono::seconds(3));
    }
  }
  EXPECT_EQ(Metric("tandem_router_retries_total"), 0);
  Reply metrics = Get("/metrics");
  int cancelled = 0;
  for (WorkerProcess* x : {w, spare}) {
    for (int n : {1, 2}) {
      if (metrics.http.body.find(absl::StrCat("tandem_router_worker_outcomes_total{worker=\"", x->address(),
                                              "\",outcome=\"cancelled\"} ", n)) != std::string::npos) {
        cancelled += n;
      }
    }
  }
  EXPECT_EQ(cancelled, 2) << metrics.http.body;
}

TEST_F(RouterE2eTest, WithoutFailoverAKilledWorkerFailsItsStreamsCleanlyAndServiceContinues) {
  WorkerProcess* a = StartBoth();
  WorkerProcess* b = StartBoth();
  ASSERT_TRUE(a && b);
  // (With failovers, the default, its streams continue on b:
  // router_failover_test.)
  ASSERT_NE(StartRouter({.decode = {a->address(), b->address()}, .extra = "retries:\n  max_failovers: 0\n"}), nullptr);
  std::vector<std::thread> threads;
  std::vector<Reply> replies(4);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      replies[i] = Post("/v1/completions", Completion("victim", 2000, {{"ignore_eos", true}, {"stream", true}}));
    });
  }
  bool ok = false;
  WaitForLoad(
      a->stub(), [](const v1::LoadReport& l) { return l.running_sequences() >= 1; }, &ok);
  ASSERT_TRUE(ok);
  Kill(a);
  for (auto& t : threads) t.join();
  int failed = 0, completed = 0;
  for (const Reply& r : replies) {
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    const std::vector<std::string> data = SseData(r.http.body);
    ASSERT_FALSE(data.empty());
    EXPECT_EQ(data.back(), "[DONE]");
    if (r.http.body.find("\"error\"") != std::string::npos) {
      ++failed;
      EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), a->address());
    } else {
      ++completed;
      EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), b->address());
    }
  }
  EXPECT_GE(failed, 1);
  EXPECT_EQ(failed + completed, 4);
  // Every later request succeeds, on b.
  for (int i = 0; i < 6; ++i) {
    Reply r = Post("/v1/completions", Completion("after", 4));
    EXPECT_EQ(r.http.status, 200) << r.http.body;
    EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), b->address());
  }
  EXPECT_EQ(Get("/health").http.status, 200);
}

TEST_F(RouterE2eTest, FirstTokenTimeoutIs504AndCancelsTheWork) {
  WorkerProcess* w = StartBoth();
  ASSERT_NE(w, nullptr);
  // Rare health checks: the hung worker stays routable.
  ASSERT_NE(
      StartRouter({.decode = {w->address()}, .extra = "timeouts:\n  first_token_s: 0.5\n", .health_interval_s = 30}),
      nullptr);
  {
    PausedWorker paused(w);
    for (bool stream : {false, true}) {
      const auto start = std::chrono::steady_clock::now();
      Reply r = Post("/v1/chat/completions", Chat("Anyone there?", 8, {{"stream", stream}}));
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      // Nothing was streamed yet, so even a stream gets the status.
      EXPECT_EQ(r.http.status, 504) << r.http.body;
      EXPECT_THAT(r.json["error"]["message"].get<std::string>(), HasSubstr("first_token_s"));
      EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), w->address());
      EXPECT_LT(took, 5.0);
    }
  }
  // Resumed, the worker learns of the cancellations and frees everything;
  // the next request is served.
  ExpectIdle(w->stub(), "after the timeouts");
  EXPECT_EQ(Post("/v1/chat/completions", Chat("Now?", 4)).http.status, 200);
  EXPECT_EQ(
      Metric(absl::StrCat("tandem_router_worker_outcomes_total{worker=\"", w->address(), "\",outcome=\"timeout\"}")),
      2);
}

TEST_F(RouterE2eTest, IdleStreamTimeoutEndsTheStreamWithAnError) {
  // The decode worker's KV pull is held back 3 s: the first token (from the
  // prefill worker) is out, then the stream goes quiet.
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode({"--kv-fault", "delay_ms=3000"});
  ASSERT_TRUE(prefill && decode);
  ASSERT_NE(StartRouter({.prefill = {prefill->address()},
                         .decode = {decode->address()},
                         .mode = "always",
                         .extra = "timeouts:\n  idle_stream_s: 0.5\n"}),
            nullptr);
  const auto start = std::chrono::steady_clock::now();
  Reply r = Post("/v1/completions",
                 Completion(json(MakePrompt(7, 64)), 16, {{"stream", true}, {"ignore_eos", true}, {"temperature", 0}}));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.http.status, 200) << r.http.body;
  const Stream s = ParseStream(r.http.body, /*chat=*/false);
  EXPECT_TRUE(s.done);
  ASSERT_FALSE(s.events.empty());
  EXPECT_FALSE(s.text.empty()) << "the first token was streamed";
  ASSERT_TRUE(s.events.back().contains("error")) << r.http.body;
  EXPECT_THAT(s.events.back()["error"]["message"].get<std::string>(), HasSubstr("idle_stream_s"));
  EXPECT_LT(took, 2.5) << "the stream waited for the delayed pull";
  ExpectIdle(decode->stub(), "decode after the idle timeout", std::chrono::seconds(15));
  ExpectIdle(prefill->stub(), "prefill after the idle timeout", std::chrono::seconds(15));
}

TEST_F(RouterE2eTest, RequestsToADeadWorkerAreRetriedOnAnother) {
  WorkerProcess* a = StartBoth();
  WorkerProcess* b = StartBoth();
  ASSERT_TRUE(a && b);
  // The router has not noticed the death (health checks are 30 s apart):
  // the request sent there fails before its first token and is retried.
  ASSERT_NE(StartRouter({.decode = {a->address(), b->address()}, .health_interval_s = 30}), nullptr);
  Kill(a);
  for (int i = 0; i < 6; ++i) {
    Reply r = Post("/v1/chat/completions", Chat("Still there?", 4, {{"stream", i % 2 == 1}}));
    EXPECT_EQ(r.http.status, 200) << r.http.body;
    EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), b->address());
  }
  // One retry: the failure ejected the worker at once.
  EXPECT_EQ(Metric("tandem_router_retries_total"), 1);
  EXPECT_EQ(Metric(absl::StrCat("tandem_router_worker_healthy{pool=\"decode\",worker=\"", a->address(), "\"}")), 0);
}

TEST_F(RouterE2eTest, WithoutRetriesTheDeadWorkersRequestFails) {
  WorkerProcess* a = StartBoth();
  WorkerProcess* b = StartBoth();
  ASSERT_TRUE(a && b);
  ASSERT_NE(
      StartRouter(
          {.decode = {a->address(), b->address()}, .extra = "retries:\n  max_attempts: 1\n", .health_interval_s = 30}),
      nullptr);
  Kill(a);
  std::map<int, int> statuses;
  for (int i = 0; i < 6; ++i) {
    Reply r = Post("/v1/chat/completions", Chat("Still there?", 4));
    ++statuses[r.http.status];
    if (r.http.status != 200) {
      EXPECT_EQ(r.http.status, 503) << r.http.body;
      EXPECT_EQ(r.http.Header("x-tandem-decode-worker"), a->address());
    }
  }
  EXPECT_EQ(statuses[503], 1);
  EXPECT_EQ(statuses[200], 5);
  EXPECT_EQ(Metric("tandem_router_retries_total"), 0);
}

TEST_F(RouterE2eTest, HungWorkerIsEjectedByHealthChecksAndReadmitted) {
  WorkerProcess* a = StartBoth();
  WorkerProcess* b = StartBoth();
  ASSERT_TRUE(a && b);
  ASSERT_NE(StartRouter({.decode = {a->address(), b->address()}, .health_interval_s = 0.2}), nullptr);
  const std::string a_healthy =
      absl::StrCat("tandem_router_worker_healthy{pool=\"decode\",worker=\"", a->address(), "\"}");
  ASSERT_TRUE(WaitForMetric(a_healthy, [](double v) { return v == 1; }));
  auto served = [&](int n) {
    std::set<std::string> used;
    for (int i = 0; i < n; ++i) {
      Reply r = Post("/v1/completions", Completion("who", 2));
      EXPECT_EQ(r.http.status, 200) << r.http.body;
      used.insert(r.http.Header("x-tandem-decode-worker"));
    }
    return used;
  };
  {
    // Three failed checks in a row eject it; requests go to b only.
    PausedWorker paused(a);
    ASSERT_TRUE(WaitForMetric(a_healthy, [](double v) { return v == 0; }));
    EXPECT_EQ(served(4), std::set<std::string>{b->address()});
    EXPECT_EQ(Metric("tandem_router_worker_ejections_total{kind=\"ejected\"}"), 1);
  }
  // Two passed checks readmit it.
  ASSERT_TRUE(WaitForMetric(a_healthy, [](double v) { return v == 1; }));
  EXPECT_EQ(Metric("tandem_router_worker_ejections_total{kind=\"readmitted\"}"), 1);
  EXPECT_EQ(served(4), (std::set<std::string>{a->address(), b->address()}));
}

TEST_F(RouterE2eTest, SighupReloadsAGoodConfigAndKeepsTheOldOnABadOne) {
  WorkerProcess* a = StartBoth();
  WorkerProcess* b = StartBoth();
  ASSERT_TRUE(a && b);
  ASSERT_NE(StartRouter({.decode = {a->address()}}), nullptr);
  auto workers_used = [&](int n) {
    std::set<std::string> used;
    for (int i = 0; i < n; ++i) {
      Reply r = Post("/v1/completions", Completion("which", 2));
      EXPECT_EQ(r.http.status, 200) << r.http.body;
      used.insert(r.http.Header("x-tandem-decode-worker"));
    }
    return used;
  };
  EXPECT_EQ(workers_used(4), (std::set<std::string>{a->address()}));
  router()->Rewrite(RouterYaml{.decode = {a->address(), b->address()}}.Text());
  router()->Signal(SIGHUP);
  // b serves once the reload ran and b passed a health check.
  std::set<std::string> used;
  for (int i = 0; i < 100 && used.size() < 2; ++i) {
    used = workers_used(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(used, (std::set<std::string>{a->address(), b->address()}));
  // A broken file: the router keeps the last good config.
  router()->Rewrite("pools:\n  decode:\n    workers: [\"nonsense\n");
  router()->Signal(SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(workers_used(4), (std::set<std::string>{a->address(), b->address()}));
}

TEST_F(RouterE2eTest, ModelsHealthTokenizeAndMetrics) {
  WorkerProcess* w = StartBoth();
  ASSERT_NE(w, nullptr);
  ASSERT_NE(StartRouter({.decode = {w->address()}}), nullptr);
  Reply m = Get("/v1/models");
  ASSERT_EQ(m.http.status, 200);
  EXPECT_EQ(m.json["object"], "list");
  EXPECT_EQ(m.json["data"][0]["id"], "tiny");
  EXPECT_GT(m.json["data"][0]["max_model_len"].get<int>(), 0);
  // One model by id (the OpenAI clients' models.retrieve); another is 404 model_not_found.
  Reply one = Get("/v1/models/tiny");
  ASSERT_EQ(one.http.status, 200) << one.http.body;
  EXPECT_EQ(one.json, m.json["data"][0]);
  Reply none = Get("/v1/models/org%2Fother");
  EXPECT_EQ(none.http.status, 404);
  EXPECT_EQ(none.json["error"]["code"], "model_not_found");
  EXPECT_EQ(none.json["error"]["message"], "The model 'org/other' does not exist");
  EXPECT_EQ(Get("/v1/models/").http.status, 404);
  Reply h = Get("/health");
  EXPECT_EQ(h.http.status, 200);
  EXPECT_EQ(h.json["status"], "ok");

  Reply t = Post("/tokenize", {{"prompt", "héllo"}, {"return_token_strs", true}});
  ASSERT_EQ(t.http.status, 200) << t.http.body;
  EXPECT_EQ(t.json["count"], 6);  // one id per byte
  Reply d = Post("/detokenize", {{"tokens", t.json["tokens"]}});
  EXPECT_EQ(d.json["prompt"], "héllo");
  Reply chat = Post("/tokenize", {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}});
  ASSERT_EQ(chat.http.status, 200) << chat.http.body;
  Reply rendered = Post("/detokenize", {{"tokens", chat.json["tokens"]}});
  EXPECT_EQ(rendered.json["prompt"],
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");

  ASSERT_EQ(Post("/v1/chat/completions", Chat("count me", 3)).http.status, 200);
  Reply metrics = Get("/metrics");  // the request is accounted before its response ends
  ASSERT_EQ(metrics.http.status, 200);
  EXPECT_THAT(metrics.http.Header("content-type"), HasSubstr("text/plain"));
  for (const char* name :
       {"tandem_router_requests_total{endpoint=\"chat\",code=\"200\"} 1",
        "tandem_router_time_to_first_token_seconds_count{mode=\"aggregated\"} 1",
        "tandem_router_inter_token_latency_seconds_bucket", "tandem_router_e2e_request_latency_seconds",
        "tandem_router_queue_time_seconds", "tandem_router_routing_decision_seconds",
        "tandem_router_routing_decision_cpu_seconds_count{pool=\"decode\"} 1",
        "tandem_router_routed_total{pool=\"decode\",policy=\"round_robin\"",
        "tandem_router_worker_healthy{pool=\"decode\"", "tandem_router_worker_in_flight"}) {
    EXPECT_THAT(metrics.http.body, HasSubstr(name));
  }
}

}  // namespace
}  // namespace tandem::testing

namespace tandem::testing {
namespace {

// Router and workers must agree on what routing and KV hand-offs depend on.
// A worker that does not fit (here: another block size, which would make
// the KV-aware index's block hashes useless against it) is refused loudly:
// never routed to, named in /health with the reason, counted by a metric;
// the workers that agree serve. When none serves yet, the model most
// workers share is the cluster's.
TEST_F(RouterE2eTest, AWorkerThatDoesNotFitTheClusterIsRefusedLoudly) {
  WorkerProcess* a = StartBoth();
  WorkerProcess* b = StartBoth();
  WorkerProcess* odd = StartBoth({"--block-size", "32"});
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(odd, nullptr);
  ASSERT_NE(StartRouter({.decode = {a->address(), odd->address(), b->address()}}), nullptr);

  Reply health = Get("/health");
  ASSERT_EQ(health.http.status, 200) << health.http.body;
  const json& decode = health.json["pools"]["decode"];
  EXPECT_EQ(decode["healthy"], 2) << decode;
  ASSERT_EQ(decode["incompatible"].size(), 1u) << decode;
  EXPECT_EQ(decode["incompatible"][0]["worker"], odd->address());
  EXPECT_EQ(decode["incompatible"][0]["why"], "block_size 32, the cluster's 16");
  EXPECT_EQ(Metric(absl::StrCat("tandem_router_worker_incompatible{pool=\"decode\",worker=\"", odd->address(), "\"}")),
            1);
  EXPECT_EQ(Metric(absl::StrCat("tandem_router_worker_incompatible{pool=\"decode\",worker=\"", a->address(), "\"}")),
            0);
  std::set<std::string> served;
  for (int i = 0; i < 6; ++i) {
    Reply r = Post("/v1/chat/completions", Chat(absl::StrCat("question ", i), 4));
    ASSERT_EQ(r.http.status, 200) << r.http.body;
    served.insert(r.http.Header("x-tandem-decode-worker"));
  }
  EXPECT_EQ(served, (std::set<std::string>{a->address(), b->address()}));
}

// The newcomer's mistake: a router on the built-in tokenizer in front of a
// checkpoint with its own tokenizer.json. Requests are refused with the
// reason and the fix (not answered with text from the wrong vocabulary);
// pointing model.tokenizer at the checkpoint serves.
TEST_F(RouterE2eTest, ARouterTokenizerThatIsNotTheCheckpointsIsRefusedWithTheFix) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  char tmpl[] = "/tmp/tandem-tokenizer-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = std::string(tmpl) + "/tiny";
  ASSERT_EQ(RunCommand(absl::StrCat(*bin, " export-model --preset tiny ", dir)), 0);
  {
    // The same vocabulary written differently: another file, so another tokenizer as far as
    // anyone can tell without comparing every entry.
    std::ofstream(dir + "/tokenizer.json", std::ios::app) << "\n";
  }
  WorkerProcess* w = StartBoth({"--model", dir});
  ASSERT_NE(w, nullptr);

  // (A request does not wait for a worker that is refused: none is coming.)
  ASSERT_NE(StartRouter({.decode = {w->address()}, .extra = "retries:\n  wait_for_worker_s: 60\n"},
                        /*wait_healthy=*/false),
            nullptr);
  Reply r;
  ASSERT_TRUE(WaitUntil(
      [&] {
        r = Post("/v1/chat/completions", Chat("hello", 4));
        return r.http.status == 503 && r.http.body.find("incompatible") != std::string::npos;
      },
      std::chrono::seconds(10), std::chrono::milliseconds(100)))
      << r.http.status << " " << r.http.body;
  EXPECT_THAT(r.json["error"]["message"].get<std::string>(), ::testing::Not(HasSubstr("waited")));
  EXPECT_THAT(r.json["error"]["message"].get<std::string>(),
              ::testing::AllOf(HasSubstr("1 refused as incompatible: its model's tokenizer.json"),
                               HasSubstr("is not the router's (builtin"), HasSubstr("model.tokenizer")));
  EXPECT_EQ(Get("/health").http.status, 503);

  RouterYaml fixed{.decode = {w->address()}, .tokenizer = dir + "/tokenizer.json"};
  ASSERT_NE(StartRouter(fixed), nullptr);
  r = Post("/v1/chat/completions", Chat("hello", 4));
  EXPECT_EQ(r.http.status, 200) << r.http.body;
  std::filesystem::remove_all(tmpl);
}

// Routing you can see into: a request that sends x-tandem-explain gets
// x-tandem-route, the decision as JSON (the policy, its rule, the winner,
// and every worker with its load and, for kv_cache_aware, its matched prefix
// blocks and score); the router logs the same line. Opt-in, and only for
// callers who may see worker addresses.
TEST_F(RouterE2eTest, XTandemExplainSaysWhyTheRequestWentWhereItDid) {
  WorkerProcess* a = StartBoth();
  WorkerProcess* b = StartBoth();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(StartRouter({.decode = {a->address(), b->address()}, .policy = "kv_cache_aware"}), nullptr);
  const std::string prompt(400, 'x');  // 25 blocks of the built-in tokenizer's one id per byte
  const Headers explain = {{"x-tandem-explain", "1"}};
  Reply first = Post("/v1/completions", Completion(prompt, 2), explain);
  ASSERT_EQ(first.http.status, 200) << first.http.body;
  const std::string winner = first.http.Header("x-tandem-decode-worker");
  // The second time, the winner holds the prompt's blocks: the index says so.
  Reply second;
  json route;
  ASSERT_TRUE(WaitUntil(
      [&] {
        second = Post("/v1/completions", Completion(prompt, 2), explain);
        route = json::parse(second.http.Header("x-tandem-route"), nullptr, false);
        return second.http.status == 200 && route.is_array() && !route.empty() && route[0]["chosen"] == winner;
      },
      std::chrono::seconds(10), std::chrono::milliseconds(100)))
      << second.http.body << " " << second.http.Header("x-tandem-route");
  const json& d = route[0];
  EXPECT_EQ(d["pool"], "decode");
  EXPECT_EQ(d["policy"], "kv_cache_aware");
  EXPECT_THAT(d["why"].get<std::string>(), HasSubstr("score"));
  ASSERT_EQ(d["candidates"].size(), 2u) << d;
  for (const json& c : d["candidates"]) {
    for (const char* key : {"worker", "healthy", "in_flight", "kv_used_blocks", "kv_total_blocks",
                            "prefill_tokens_queued", "eligible", "matched_blocks", "score"}) {
      EXPECT_TRUE(c.contains(key)) << key << " in " << c;
    }
    if (c["worker"] == winner) {
      EXPECT_GE(c["matched_blocks"].get<int>(), 24) << c;
    } else {
      EXPECT_EQ(c["matched_blocks"], 0) << c;
    }
  }
  EXPECT_GT(Metric("tandem_router_expected_cached_prompt_tokens_total").value_or(0), 0);

  // Not asked: not answered.
  Reply plain = Post("/v1/completions", Completion(prompt, 2));
  EXPECT_TRUE(plain.http.Header("x-tandem-route").empty());
  // A value that is not 1 or true is a 400 naming the header.
  Reply bad = Post("/v1/completions", Completion(prompt, 2), {{"x-tandem-explain", "maybe"}});
  EXPECT_EQ(bad.http.status, 400);
  EXPECT_THAT(bad.json["error"]["message"].get<std::string>(), HasSubstr("x-tandem-explain must be 1 or true"));

  // Without debug.worker_details (and no admin key), worker addresses are not for clients: 403.
  ASSERT_NE(StartRouter({.decode = {a->address(), b->address()}, .worker_details = false}), nullptr);
  Reply denied = Post("/v1/completions", Completion(prompt, 2), explain);
  EXPECT_EQ(denied.http.status, 403) << denied.http.body;
  EXPECT_EQ(denied.json["error"]["type"], "permission_error");
}

}  // namespace
}  // namespace tandem::testing
