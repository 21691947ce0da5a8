// `tandem bench mock-server` as the overhead benchmark uses it: `tandem
// bench` completes every request against it on both endpoints with the asked
// token counts, it answers in OpenAI's shapes (streamed and whole) and with
// OpenAI's errors, and SIGTERM stops it with status 0.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tests/testing/http_client.h"
#include "tests/testing/worker_process.h"

namespace tandem::testing {
namespace {

using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

class MockServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tandem-mock-test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    server_.reset();  // SIGKILL if still running
    std::filesystem::remove_all(dir_);
  }

  // Starts `tandem bench mock-server --port 0 --ready-file F <flags>`; its
  // URL once it listens.
  std::string Start(const std::vector<std::string>& flags = {}) {
    std::vector<std::string> args = {"bench", "mock-server", "--port", "0", "--ready-file", dir_ + "/url"};
    args.insert(args.end(), flags.begin(), flags.end());
    absl::StatusOr<std::string> url =
        StartTandem(args, dir_ + "/url", std::chrono::seconds(30), "mock-server", &server_);
    if (!url.ok()) {
      ADD_FAILURE() << url.status();
      return "";
    }
    return *url;
  }

  // Runs `tandem bench --url URL <flags> --json F`; the JSON.
  json Bench(const std::string& url, const std::string& flags, std::string* output) {
    return RunBench(url, flags, dir_ + "/bench.json", output);
  }

  std::string dir_;
  std::unique_ptr<ChildProcess> server_;
};

TEST_F(MockServerTest, BenchCompletesEveryRequestOnBothEndpoints) {
  const std::string url = Start();
  ASSERT_FALSE(url.empty());
  EXPECT_EQ(url.rfind("http://127.0.0.1:", 0), 0u) << url;
  for (const std::string endpoint : {"completions", "chat"}) {
    std::string out;
    const json j = Bench(url,
                         absl::StrCat("--endpoint ", endpoint,
                                      " --num-prompts 20 --random-input-len 64 "
                                      "--random-output-len 8 --request-rate inf --seed 3"),
                         &out);
    ASSERT_TRUE(j.is_object()) << out;
    EXPECT_EQ(j["completed"], 20) << endpoint << "\n" << out;
    EXPECT_EQ(j["failed"], 0) << endpoint;
    EXPECT_EQ(j["total_output_tokens"], 20 * 8) << endpoint;
    if (endpoint == "completions") {
      EXPECT_EQ(j["total_input_tokens"], 20 * 64) << "a token-id prompt's length";
    } else {
      EXPECT_GT(j["total_input_tokens"].get<int64_t>(), 0) << "the messages' words";
    }
    // Eight token-bearing events per stream: seven gaps each.
    EXPECT_EQ(j["itl_ms"]["count"], 20 * 7) << endpoint;
    EXPECT_GT(j["client_overhead_us_per_request"].get<double>(), 0);
  }
}

// The reports record what was run; requests that fail beyond
// --max-failure-rate (default 0) make the command fail, after its reports.
TEST_F(MockServerTest, BenchRecordsTheRunAndFailsOnFailedRequests) {
  const std::string url = Start();
  ASSERT_FALSE(url.empty());
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok());
  std::string out;
  const json ok = Bench(url,
                        absl::StrCat("--num-prompts 4 --random-input-len 8 --random-output-len 2 "
                                     "--seed 5 --html ",
                                     dir_, "/ok.html"),
                        &out);
  ASSERT_TRUE(ok.is_object()) << out;
  EXPECT_EQ(ok["run"]["model"], "mock") << "the server's model, resolved";
  EXPECT_EQ(ok["run"]["url"], url);
  EXPECT_EQ(ok["run"]["dataset"], "random");
  EXPECT_EQ(ok["run"]["dataset parameters"], "input-len 8, output-len 2, range-ratio 0");
  EXPECT_EQ(ok["run"]["requests"], "4 (seed 5)");
  EXPECT_EQ(ok["run"]["request rate"], "inf");
  EXPECT_THAT(ok["run"]["command"].get<std::string>(),
              AllOf(HasSubstr(" bench --url " + url), HasSubstr("--random-input-len 8")));
  EXPECT_THAT(ok["run"]["date"].get<std::string>(), HasSubstr(" UTC"));
  EXPECT_FALSE(ok.contains("goodput")) << "no --goodput, no goodput";
  std::ifstream html_file(dir_ + "/ok.html");
  const std::string html((std::istreambuf_iterator<char>(html_file)), {});
  EXPECT_THAT(html, AllOf(HasSubstr("<h2>Run</h2>"), HasSubstr("<td>model</td><td><code>mock</code>")));

  // Every request fails (an unknown model): the reports are written, the exit status is not 0.
  const std::string bad = absl::StrCat(*bin, " bench --url ", url,
                                       " --model nope --num-prompts 4 "
                                       "--random-input-len 8 --random-output-len 2 --json ",
                                       dir_, "/bad.json");
  EXPECT_NE(RunCommand(bad, &out), 0);
  EXPECT_THAT(out, HasSubstr("4 of 4 requests failed (100.0%), more than --max-failure-rate 0 allows"));
  std::ifstream bad_file(dir_ + "/bad.json");
  const json failed = json::parse(std::string((std::istreambuf_iterator<char>(bad_file)), {}), nullptr, false);
  EXPECT_EQ(failed["failed"], 4) << out;
  EXPECT_TRUE(failed["ttft_ms"]["mean"].is_null()) << "no sample: null, not 0";
  EXPECT_THAT(out, HasSubstr("Mean TTFT (ms):                          n/a"));
  EXPECT_EQ(RunCommand(bad + " --max-failure-rate 1", &out), 0) << out;
  EXPECT_NE(RunCommand(bad + " --max-failure-rate 2", &out), 0);
  EXPECT_THAT(out, HasSubstr("--max-failure-rate must be in [0, 1]"));
}

TEST_F(MockServerTest, AnswersInOpenAIShapes) {
  const std::string url = Start({"--model", "m1", "--threads", "1"});
  ASSERT_FALSE(url.empty());
  EXPECT_EQ(HttpGet(url, "/health").status, 200);
  const HttpResponse models = HttpGet(url, "/v1/models");
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(json::parse(models.body)["data"][0]["id"], "m1") << models.body;

  // Whole: the text, finish_reason and usage (a text prompt counts its words).
  const HttpResponse whole =
      HttpPost(url, "/v1/completions", R"({"model": "m1", "prompt": "one two  three", "max_tokens": 3})");
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json w = json::parse(whole.body);
  EXPECT_EQ(w["object"], "text_completion");
  EXPECT_EQ(w["choices"][0]["text"], " tok tok tok");
  EXPECT_EQ(w["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(w["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(w["usage"]["completion_tokens"], 3);
  const HttpResponse chat_whole =
      HttpPost(url, "/v1/chat/completions", R"({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})");
  ASSERT_EQ(chat_whole.status, 200) << chat_whole.body;
  EXPECT_EQ(json::parse(chat_whole.body)["usage"]["completion_tokens"], 16) << "the default";

  // Streamed chat: an event per token (the first with the role, the last
  // with finish_reason), then usage, then [DONE].
  const HttpResponse stream = HttpPost(url, "/v1/chat/completions",
                                       R"({"model": "m1", "messages": [{"role": "user", "content": "a b"}],
          "max_completion_tokens": 3, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_EQ(stream.status, 200) << stream.body;
  EXPECT_THAT(stream.Header("content-type"), HasSubstr("text/event-stream"));
  const std::vector<std::string> events = SseData(stream.body);
  ASSERT_EQ(events.size(), 5u) << stream.body;
  for (int t = 0; t < 3; ++t) {
    const json e = json::parse(events[t]);
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    EXPECT_EQ(e["choices"][0]["delta"]["content"], " tok");
    EXPECT_EQ(e["choices"][0]["delta"].contains("role"), t == 0) << events[t];
    EXPECT_EQ(e["choices"][0]["finish_reason"], t == 2 ? json("length") : json(nullptr));
  }
  const json usage = json::parse(events[3]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 2);
  EXPECT_EQ(usage["usage"]["completion_tokens"], 3);
  EXPECT_EQ(events[4], "[DONE]");

  // Streamed completions without usage: the text events and [DONE].
  const HttpResponse text_stream =
      HttpPost(url, "/v1/completions", R"({"model": "m1", "prompt": [1, 2], "max_tokens": 2, "stream": true})");
  const std::vector<std::string> text_events = SseData(text_stream.body);
  ASSERT_EQ(text_events.size(), 3u) << text_stream.body;
  EXPECT_EQ(json::parse(text_events[0])["choices"][0]["text"], " tok");
  EXPECT_EQ(json::parse(text_events[1])["choices"][0]["finish_reason"], "length");

  // Bad requests: OpenAI's error JSON.
  struct Case {
    std::string target, body;
    int status;
  };
  const std::vector<Case> bad = {
      {"/v1/completions", R"({"model": "m1", "prompt": )", 400},
      {"/v1/completions", R"({"model": "m1", "max_tokens": 2})", 400},
      {"/v1/chat/completions", R"({"model": "m1"})", 400},
      {"/v1/completions", R"({"model": "m2", "prompt": "x"})", 404},
      {"/v1/completions", R"({"model": "m1", "prompt": "x", "max_tokens": 100000})", 400},
  };
  for (const Case& c : bad) {
    const HttpResponse r = HttpPost(url, c.target, c.body);
    EXPECT_EQ(r.status, c.status) << c.body << ": " << r.body;
    const json e = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(e.is_object() && e.contains("error")) << r.body;
    EXPECT_TRUE(e["error"]["message"].is_string()) << r.body;
    EXPECT_EQ(e["error"]["type"], "invalid_request_error") << r.body;
  }
}

TEST_F(MockServerTest, StopsWithStatusZeroOnSigterm) {
  ASSERT_FALSE(Start().empty());
  server_->Signal(SIGTERM);
  absl::StatusOr<int> status = server_->Wait(std::chrono::seconds(15));
  ASSERT_TRUE(status.ok()) << "mock-server did not stop after SIGTERM";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "wait status " << *status;
}

TEST_F(MockServerTest, BadFlagsAreClearErrors) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  std::string out;
  EXPECT_NE(RunCommand(*bin + " bench mock-server --port 0 --threads 0", &out), 0);
  EXPECT_THAT(out, HasSubstr("--threads"));
  EXPECT_NE(RunCommand(*bin + " bench mock-server --host 999.1.1.1 --port 0", &out), 0);
  EXPECT_THAT(out, HasSubstr("999.1.1.1"));
}

}  // namespace
}  // namespace tandem::testing
