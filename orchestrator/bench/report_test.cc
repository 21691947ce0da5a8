#include "orchestrator/bench/report.h"

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::bench {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr double kEps = 1e-9;

size_t Count(std::string_view text, std::string_view needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string_view::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

void ExpectDistribution(const Distribution& d, double mean, double std, double median, double p90, double p95,
                        double p99, int64_t count) {
  EXPECT_NEAR(d.mean, mean, kEps);
  EXPECT_NEAR(d.std, std, kEps);
  EXPECT_NEAR(d.median, median, kEps);
  EXPECT_NEAR(d.p90, p90, kEps);
  EXPECT_NEAR(d.p95, p95, kEps);
  EXPECT_NEAR(d.p99, p99, kEps);
  EXPECT_EQ(d.count, count);
}

RequestRecord Ok(double sent, double first, std::vector<double> chunks, double done, int64_t prompt, int64_t output,
                 int64_t cached = 0) {
  RequestRecord r;
  r.ok = true;
  r.sent_s = sent;
  r.first_token_s = first;
  r.token_times_s = std::move(chunks);
  r.done_s = done;
  r.prompt_tokens = prompt;
  r.output_tokens = output;
  r.cached_tokens = cached;
  return r;
}

RequestRecord Failed(double sent, double done, std::string error) {
  RequestRecord r;
  r.sent_s = sent;
  r.done_s = done;
  r.error = std::move(error);
  r.prompt_tokens = 7;  // not counted: the request failed
  return r;
}

// Three successes and three failures over 2 s:
//   r0: TTFT 100 ms, 4 tokens in 4 chunks (ITL 50, 100, 50), TPOT 200/3, E2E 300;
//   r1: TTFT 200 ms, 3 tokens in 2 chunks (ITL 100), TPOT 100, E2E 400;
//   r2: TTFT 50 ms, 1 token (no TPOT, no ITL), E2E 100.
std::vector<RequestRecord> Records() {
  return {Ok(0.0, 0.1, {0.1, 0.15, 0.25, 0.3}, 0.3, 10, 4, 5),
          Ok(0.5, 0.7, {0.7, 0.8}, 0.9, 20, 3),
          Ok(1.0, 1.05, {1.05}, 1.1, 5, 1),
          Failed(1.2, 2.0, "HTTP 503: no healthy worker"),
          Failed(1.5, 1.6, "HTTP 503: no healthy worker"),
          Failed(1.8, 1.9, "HTTP 429: overloaded")};
}

// Expected values are numpy's (np.mean, np.std, np.median, np.percentile).
TEST(DistributeTest, MatchesNumpy) {
  ExpectDistribution(Distribute({7, 3, 10, 1, 5, 9, 2, 8, 6, 4}), 5.5, 2.8722813232690143, 5.5, 9.1, 9.55, 9.91, 10);
  ExpectDistribution(Distribute({3, 1, 4, 1, 5}), 2.8, 1.6, 3.0, 4.6, 4.8, 4.96, 5);
}

TEST(DistributeTest, EmptyIsZerosAndOneSampleIsItself) {
  ExpectDistribution(Distribute({}), 0, 0, 0, 0, 0, 0, 0);
  ExpectDistribution(Distribute({42}), 42, 0, 42, 42, 42, 42, 1);
}

TEST(SummarizeTest, CountsTokensAndThroughput) {
  const Summary s = Summarize(Records(), Slo{});
  EXPECT_EQ(s.completed, 3);
  EXPECT_EQ(s.failed, 3);
  EXPECT_NEAR(s.duration_s, 2.0, kEps);
  EXPECT_EQ(s.total_input_tokens, 35);
  EXPECT_EQ(s.total_output_tokens, 8);
  EXPECT_EQ(s.total_cached_tokens, 5);
  EXPECT_NEAR(s.request_throughput, 1.5, kEps);
  EXPECT_NEAR(s.input_throughput, 17.5, kEps);
  EXPECT_NEAR(s.output_throughput, 4.0, kEps);
  EXPECT_EQ(s.goodput, 0);  // no SLO
  EXPECT_FALSE(s.router_prefix_hit_rate.has_value());
  EXPECT_THAT(s.first_errors, ::testing::ElementsAre("HTTP 503: no healthy worker", "HTTP 429: overloaded"));
}

TEST(SummarizeTest, LatenciesFromSuccessfulRequests) {
  const Summary s = Summarize(Records(), Slo{});
  ExpectDistribution(s.ttft_ms, 116.66666666666667, 62.36095644623236, 100, 180, 190, 198, 3);
  ExpectDistribution(s.tpot_ms, 83.33333333333334, 16.666666666666664, 83.33333333333334, 96.66666666666667,
                     98.33333333333333, 99.66666666666667, 2);
  ExpectDistribution(s.itl_ms, 75, 25, 75, 100, 100, 100, 4);
  ExpectDistribution(s.e2e_ms, 266.6666666666667, 124.72191289246472, 300, 380, 390, 398, 3);
}

TEST(SummarizeTest, Goodput) {
  Slo slo;
  slo.ttft_ms = 150;  // r0 and r2
  Summary s = Summarize(Records(), slo);
  EXPECT_NEAR(s.goodput, 1.0, kEps);
  EXPECT_EQ(s.slo.ttft_ms, 150);

  slo.tpot_ms = 70;  // r0 (66.7 ms) passes, r2 has one token and passes
  EXPECT_NEAR(Summarize(Records(), slo).goodput, 1.0, kEps);
  slo.tpot_ms = 50;  // r0 fails now
  EXPECT_NEAR(Summarize(Records(), slo).goodput, 0.5, kEps);

  Slo e2e;
  e2e.e2e_ms = 350;  // r0 and r2; failures never count
  EXPECT_NEAR(Summarize(Records(), e2e).goodput, 1.0, kEps);
  e2e.e2e_ms = 1000;
  EXPECT_NEAR(Summarize(Records(), e2e).goodput, 1.5, kEps);
}

TEST(SummarizeTest, RequestWithoutTokensMeetsTtftByItsE2e) {
  std::vector<RequestRecord> records = {Ok(0, -1, {}, 0.1, 3, 0), Ok(0, -1, {}, 1.0, 3, 0)};
  Slo slo;
  slo.ttft_ms = 500;
  const Summary s = Summarize(records, slo);
  EXPECT_EQ(s.ttft_ms.count, 0);
  EXPECT_EQ(s.e2e_ms.count, 2);
  EXPECT_NEAR(s.goodput, 1.0, kEps);  // the first of two, over 1 s
}

TEST(SummarizeTest, EmptyIsZeros) {
  const Summary s = Summarize({}, Slo{});
  EXPECT_EQ(s.completed, 0);
  EXPECT_EQ(s.failed, 0);
  EXPECT_EQ(s.duration_s, 0);
  EXPECT_EQ(s.request_throughput, 0);
  EXPECT_EQ(s.ttft_ms.count, 0);
  EXPECT_TRUE(s.first_errors.empty());
}

TEST(SummarizeTest, KeepsFiveDistinctErrors) {
  std::vector<RequestRecord> records;
  for (int i = 0; i < 10; ++i) records.push_back(Failed(0, 1, "error " + std::to_string(i % 7)));
  const Summary s = Summarize(records, Slo{});
  EXPECT_EQ(s.failed, 10);
  EXPECT_THAT(s.first_errors, ::testing::ElementsAre("error 0", "error 1", "error 2", "error 3", "error 4"));
  EXPECT_EQ(s.request_throughput, 0);
}

TEST(FormatTextTest, LongErrorsAreCutToOneLine) {
  std::string long_error = "HTTP 502: <html>\n";
  for (int i = 0; i < 200; ++i) long_error += "\xc3\xa9";  // "é", two bytes each
  const Summary s = Summarize({Failed(0, 1, long_error)}, Slo{});
  const std::string text = FormatText(s, "");
  EXPECT_THAT(text, HasSubstr("\nHTTP 502: <html> \xc3\xa9"));
  EXPECT_THAT(text, HasSubstr("\xc3\xa9...\n"));
  EXPECT_LT(text.size(), 4000u);
}

TEST(ToJsonTest, KeysAndValues) {
  Slo slo;
  slo.ttft_ms = 150;
  Summary s = Summarize(Records(), slo);
  s.router_prefix_hit_rate = 0.432;
  const nlohmann::json j = ToJson(s);
  for (const char* key : {"completed", "failed", "duration_s", "request_throughput", "input_throughput",
                          "output_throughput", "goodput", "total_input_tokens", "total_output_tokens"}) {
    ASSERT_TRUE(j.contains(key)) << key;
    EXPECT_TRUE(j[key].is_number()) << key;
  }
  EXPECT_EQ(j["completed"], 3);
  EXPECT_EQ(j["failed"], 3);
  EXPECT_EQ(j["total_input_tokens"], 35);
  EXPECT_EQ(j["total_output_tokens"], 8);
  EXPECT_NEAR(j["output_throughput"].get<double>(), 4.0, kEps);
  EXPECT_NEAR(j["goodput"].get<double>(), 1.0, kEps);
  for (const char* metric : {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}) {
    ASSERT_TRUE(j[metric].is_object()) << metric;
    for (const char* stat : {"mean", "std", "median", "p90", "p95", "p99", "count"}) {
      EXPECT_TRUE(j[metric].contains(stat) && j[metric][stat].is_number()) << metric << "." << stat;
    }
  }
  EXPECT_NEAR(j["ttft_ms"]["p90"].get<double>(), 180, kEps);
  EXPECT_EQ(j["itl_ms"]["count"], 4);
  EXPECT_NEAR(j["router_prefix_hit_rate"].get<double>(), 0.432, kEps);
  EXPECT_EQ(j["slo"], nlohmann::json({{"ttft_ms", 150.0}}));

  const nlohmann::json plain = ToJson(Summarize(Records(), Slo{}));
  EXPECT_FALSE(plain.contains("slo"));
  EXPECT_FALSE(plain.contains("goodput")) << "no SLO, no goodput";
  EXPECT_FALSE(plain.contains("router_prefix_hit_rate"));
  EXPECT_FALSE(plain.contains("run"));
}

// A statistic with no sample is n/a (text, HTML) and null (JSON), never 0:
// here every request failed, so there is no latency at all.
TEST(EmptyStatisticsTest, AreNotAvailableRatherThanZero) {
  std::vector<RequestRecord> failed = Records();
  for (RequestRecord& r : failed) r.ok = false;
  Summary s = Summarize(failed, Slo{});
  const std::string text = FormatText(s, "");
  EXPECT_THAT(text, HasSubstr("\nMean TTFT (ms):                          n/a\n"));
  EXPECT_THAT(text, HasSubstr("\nP99 E2EL (ms):                           n/a\n"));
  EXPECT_THAT(text, Not(HasSubstr("0.00\n---")));
  const nlohmann::json j = ToJson(s);
  EXPECT_TRUE(j["ttft_ms"]["mean"].is_null());
  EXPECT_EQ(j["ttft_ms"]["count"], 0);
  const std::string html = RenderHtml(s, failed, "t");
  EXPECT_THAT(html, HasSubstr("<tr><td>Time to First Token</td><td>n/a</td><td>n/a</td>"));
}

// The run's description goes into the JSON and HTML reports.
TEST(RunDescriptionTest, IsInTheJsonAndHtmlReports) {
  Summary s = Summarize(Records(), Slo{});
  s.run = {{"command", "tandem bench --url http://h:1 --dataset random"}, {"model", "m<1>"}};
  const nlohmann::json j = ToJson(s);
  EXPECT_EQ(j["run"]["command"], "tandem bench --url http://h:1 --dataset random");
  EXPECT_EQ(j["run"]["model"], "m<1>");
  const std::string html = RenderHtml(s, Records(), "t");
  EXPECT_THAT(html, HasSubstr("<h2>Run</h2>"));
  EXPECT_THAT(html, HasSubstr("<tr><td>model</td><td><code>m&lt;1&gt;</code></td></tr>"));
}

TEST(RequestsJsonTest, EveryRequestInSendOrder) {
  std::vector<RequestRecord> records = Records();
  records[0].worker = "10.0.0.1:50051";
  std::swap(records[0], records[4]);  // completion order is not send order
  const nlohmann::json j = RequestsJson(records);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 6u);
  for (size_t i = 1; i < j.size(); ++i) {
    EXPECT_LE(j[i - 1]["sent_s"].get<double>(), j[i]["sent_s"].get<double>());
  }
  const nlohmann::json& r0 = j[0];
  EXPECT_EQ(r0["session"], 0);
  EXPECT_EQ(r0["turn"], 0);
  EXPECT_TRUE(r0["ok"].get<bool>());
  EXPECT_NEAR(r0["ttft_ms"].get<double>(), 100, kEps);
  EXPECT_NEAR(r0["e2e_ms"].get<double>(), 300, kEps);
  EXPECT_NEAR(r0["tpot_ms"].get<double>(), 200.0 / 3, kEps);
  EXPECT_EQ(r0["prompt_tokens"], 10);
  EXPECT_EQ(r0["output_tokens"], 4);
  EXPECT_EQ(r0["cached_tokens"], 5);
  ASSERT_EQ(r0["itl_ms"].size(), 3u);
  EXPECT_NEAR(r0["itl_ms"][1].get<double>(), 100, kEps);
  EXPECT_FALSE(r0.contains("error"));
  EXPECT_EQ(r0["worker"], "10.0.0.1:50051");
  EXPECT_FALSE(j[1].contains("worker"));   // the server did not say
  EXPECT_TRUE(j[2]["tpot_ms"].is_null());  // one token
  EXPECT_TRUE(j[2]["itl_ms"].empty());
  EXPECT_FALSE(j[3]["ok"].get<bool>());
  EXPECT_TRUE(j[3]["ttft_ms"].is_null());
  EXPECT_EQ(j[3]["error"], "HTTP 503: no healthy worker");
  EXPECT_TRUE(RequestsJson({}).empty());
}

TEST(FormatTextTest, LinesAndSections) {
  Summary s = Summarize(Records(), Slo{});
  const std::string text = FormatText(s, "");
  EXPECT_THAT(text, StartsWith("============ Serving Benchmark Result ============\n"));
  EXPECT_THAT(text, HasSubstr("\nSuccessful requests:                     3\n"));
  EXPECT_THAT(text, HasSubstr("\nFailed requests:                         3\n"));
  EXPECT_THAT(text, HasSubstr("\nBenchmark duration (s):                  2.00\n"));
  EXPECT_THAT(text, HasSubstr("\nTotal input tokens:                      35\n"));
  EXPECT_THAT(text, HasSubstr("\nTotal generated tokens:                  8\n"));
  EXPECT_THAT(text, HasSubstr("\nRequest throughput (req/s):              1.50\n"));
  EXPECT_THAT(text, HasSubstr("\nOutput token throughput (tok/s):         4.00\n"));
  EXPECT_THAT(text, HasSubstr("\n---------------Time to First Token----------------\n"));
  EXPECT_THAT(text, HasSubstr("\n-----Time per Output Token (excl. 1st token)------\n"));
  EXPECT_THAT(text, HasSubstr("\n---------------Inter-token Latency----------------\n"));
  EXPECT_THAT(text, HasSubstr("\n----------------End-to-end Latency----------------\n"));
  EXPECT_THAT(text, HasSubstr("\nMean TTFT (ms):                          116.67\n"));
  EXPECT_THAT(text, HasSubstr("\nP90 TTFT (ms):                           180.00\n"));
  EXPECT_THAT(text, HasSubstr("\nMedian ITL (ms):                         75.00\n"));
  EXPECT_THAT(text, HasSubstr("\nP99 E2EL (ms):                           398.00\n"));
  EXPECT_THAT(text, HasSubstr("\nHTTP 429: overloaded\n"));
  EXPECT_THAT(text, HasSubstr("\n==================================================\n"));
  EXPECT_THAT(text, Not(HasSubstr("Goodput")));
  EXPECT_THAT(text, Not(HasSubstr("prefix cache hit rate")));
  for (const char* stat : {"Mean", "Std", "Median", "P90", "P95", "P99"}) {
    for (const char* metric : {"TTFT", "TPOT", "ITL", "E2EL"}) {
      EXPECT_THAT(text, HasSubstr(std::string("\n") + stat + " " + metric + " (ms):")) << stat << metric;
    }
  }
}

TEST(FormatTextTest, GoodputHitRateAndTitle) {
  Slo slo;
  slo.ttft_ms = 150;
  slo.tpot_ms = 70;
  Summary s = Summarize(Records(), slo);
  s.router_prefix_hit_rate = 0.432;
  s.client_overhead_us_per_request = 12.5;
  const std::string text = FormatText(s, "kv");
  EXPECT_THAT(text, StartsWith("========== Serving Benchmark Result: kv ==========\n"));
  EXPECT_THAT(text, HasSubstr("\nGoodput (req/s):                         1.00\n"));
  EXPECT_THAT(text, HasSubstr("TTFT <= 150 ms, TPOT <= 70 ms"));
  EXPECT_THAT(text, HasSubstr("\nRouter prefix cache hit rate:            43.2%\n"));
  EXPECT_THAT(text, HasSubstr("\nClient overhead (us/request):            12.5\n"));
}

void ExpectSelfContained(const std::string& html) {
  EXPECT_THAT(html, StartsWith("<!DOCTYPE html>"));
  EXPECT_EQ(Count(html, "<svg"), 4u);
  EXPECT_EQ(Count(html, "</svg>"), 4u);
  EXPECT_EQ(Count(html, "<figure"), Count(html, "</figure>"));
  EXPECT_EQ(Count(html, "<table"), Count(html, "</table>"));
  EXPECT_EQ(Count(html, "<tr>"), Count(html, "</tr>"));
  EXPECT_THAT(html, HasSubstr("</html>"));
  EXPECT_THAT(html, Not(HasSubstr("http://")));
  EXPECT_THAT(html, Not(HasSubstr("https://")));
  EXPECT_THAT(html, Not(HasSubstr("<script")));
  EXPECT_THAT(html, Not(HasSubstr("nan")));
  EXPECT_THAT(html, Not(HasSubstr("inf")));
}

TEST(RenderHtmlTest, SelfContainedAndEscaped) {
  const std::vector<RequestRecord> records = Records();
  Summary s = Summarize(records, Slo{});
  const std::string html = RenderHtml(s, records, "run <a&b> \"x\"");
  ExpectSelfContained(html);
  EXPECT_THAT(html, HasSubstr("<title>run &lt;a&amp;b&gt; &#34;x&#34;</title>"));
  EXPECT_THAT(html, Not(HasSubstr("<a&b>")));
  EXPECT_THAT(html, HasSubstr("Successful requests"));
  EXPECT_THAT(html, HasSubstr("HTTP 503: no healthy worker"));
  EXPECT_EQ(Count(html, "<circle"), records.size());
}

TEST(RenderHtmlTest, EmptyRunStillDrawsFourCharts) {
  const std::string html = RenderHtml(Summarize({}, Slo{}), {}, "");
  ExpectSelfContained(html);
  EXPECT_EQ(Count(html, "no data"), 4u);
}

TEST(RenderHtmlTest, LargeRunStaysCompact) {
  // 10k requests over ~300 s, 64 tokens each, one stalled stream.
  std::vector<RequestRecord> records;
  for (int i = 0; i < 10000; ++i) {
    const double sent = i * 0.03, first = sent + 0.05 + (i % 17) * 0.004;
    std::vector<double> chunks;
    for (int t = 0; t < 64; ++t) chunks.push_back(first + t * (0.02 + (i % 5) * 0.001));
    records.push_back(Ok(sent, first, chunks, chunks.back(), 500, 64));
  }
  RequestRecord& stalled = records[1234];  // a 30 s stall before its 6th chunk
  for (size_t t = 5; t < stalled.token_times_s.size(); ++t) stalled.token_times_s[t] += 30;
  stalled.done_s = stalled.token_times_s.back();
  for (int i = 0; i < 50; ++i) records[i * 200].ok = false;
  const Summary s = Summarize(records, Slo{});
  const std::string html = RenderHtml(s, records, "large");
  ExpectSelfContained(html);
  EXPECT_LT(html.size(), 1500u * 1000u);
  EXPECT_LE(Count(html, "<circle"), 2000u);
  EXPECT_GE(Count(html, "<circle"), 1000u);
  EXPECT_THAT(html, HasSubstr("Bins of 2 s"));                                 // 300 s in at most 200 bins
  EXPECT_THAT(html, HasSubstr("The last bar also counts 1 sample(s) above"));  // the stall
}

}  // namespace
}  // namespace tandem::bench
