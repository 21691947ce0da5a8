#include "common/metrics.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using metrics_internal::FormatValue;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------
// A strict parser of the text exposition format 0.0.4, as MetricsRegistry
// writes it: every family is "# HELP", then "# TYPE", then at least one
// sample; no comments, timestamps or trailing commas. Beyond the syntax it
// checks what Prometheus would reject or misread: samples outside their
// family, duplicate series, histograms whose buckets are not cumulative or
// whose _count differs from the +Inf bucket.

struct ParsedSample {
  std::string name;
  std::vector<std::pair<std::string, std::string>> labels;  // unescaped, in order
  double value = 0;
};

struct ParsedFamily {
  std::string name;
  std::string help;  // unescaped
  std::string type;
  std::vector<ParsedSample> samples;
};

bool IsNameChar(char c, bool first, bool colon) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':') ||
         (!first && c >= '0' && c <= '9');
}

// Consumes a metric name (colon) or label name from the front of `s`.
absl::StatusOr<std::string> TakeName(std::string_view& s, bool colon) {
  size_t n = 0;
  while (n < s.size() && IsNameChar(s[n], n == 0, colon)) ++n;
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat("expected a name at: ", std::string(s)));
  std::string name(s.substr(0, n));
  s.remove_prefix(n);
  return name;
}

absl::StatusOr<double> ParseValue(std::string_view s) {
  if (s == "+Inf") return kInf;
  if (s == "-Inf") return -kInf;
  if (s == "NaN") return kNaN;
  const bool starts_ok =
      !s.empty() && ((s[0] >= '0' && s[0] <= '9') || (s[0] == '-' && s.size() > 1 && s[1] >= '0' && s[1] <= '9'));
  double v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (!starts_ok || ec != std::errc() || ptr != s.data() + s.size()) {
    return absl::InvalidArgumentError(absl::StrCat("bad value \"", std::string(s), "\""));
  }
  return v;
}

// Unescapes help text (allowed: \\ and \n) or a label value (also \").
absl::StatusOr<std::string> Unescape(std::string_view s, bool quote) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '"' && quote) return absl::InvalidArgumentError("unescaped quote");
    if (s[i] != '\\') {
      out.push_back(s[i]);
      continue;
    }
    if (++i == s.size()) return absl::InvalidArgumentError("dangling backslash");
    if (s[i] == '\\') {
      out.push_back('\\');
    } else if (s[i] == 'n') {
      out.push_back('\n');
    } else if (s[i] == '"' && quote) {
      out.push_back('"');
    } else {
      return absl::InvalidArgumentError(absl::StrCat("bad escape \\", std::string(1, s[i])));
    }
  }
  return out;
}

absl::StatusOr<ParsedSample> ParseSampleLine(std::string_view line) {
  ParsedSample sample;
  std::string_view s = line;
  auto name = TakeName(s, /*colon=*/true);
  if (!name.ok()) return name.status();
  sample.name = *name;
  if (!s.empty() && s[0] == '{') {
    s.remove_prefix(1);
    std::set<std::string> seen;
    while (true) {
      auto label = TakeName(s, /*colon=*/false);
      if (!label.ok()) return label.status();
      if (!seen.insert(*label).second) return absl::InvalidArgumentError("repeated label");
      if (s.substr(0, 2) != "=\"") return absl::InvalidArgumentError("expected =\"");
      s.remove_prefix(2);
      size_t end = 0;  // the closing quote: the first not escaped
      while (end < s.size() && s[end] != '"') end += s[end] == '\\' ? 2 : 1;
      if (end >= s.size()) return absl::InvalidArgumentError("unterminated label value");
      auto value = Unescape(s.substr(0, end), /*quote=*/true);
      if (!value.ok()) return value.status();
      sample.labels.emplace_back(*label, *value);
      s.remove_prefix(end + 1);
      if (!s.empty() && s[0] == ',') {
        s.remove_prefix(1);
        continue;
      }
      if (!s.empty() && s[0] == '}') {
        s.remove_prefix(1);
        break;
      }
      return absl::InvalidArgumentError("expected , or }");
    }
  }
  if (s.empty() || s[0] != ' ') return absl::InvalidArgumentError("expected a space");
  s.remove_prefix(1);
  auto value = ParseValue(s);
  if (!value.ok()) return value.status();
  sample.value = *value;
  return sample;
}

// "name{a="x",b="y"}" without `le`, to group a histogram's lines.
std::string SeriesKey(std::string_view name, const ParsedSample& s, bool drop_le) {
  std::string key(name);
  key += '{';
  for (const auto& [k, v] : s.labels) {
    if (drop_le && k == "le") continue;
    absl::StrAppend(&key, k, "=\"", v, "\",");
  }
  key += '}';
  return key;
}

absl::Status CheckHistogram(const ParsedFamily& f) {
  struct Series {
    std::vector<std::pair<double, double>> buckets;  // (le, cumulative count)
    bool has_sum = false, has_count = false;
    double count = 0;
  };
  std::map<std::string, Series> series;
  for (const ParsedSample& s : f.samples) {
    Series& g = series[SeriesKey(f.name, s, /*drop_le=*/true)];
    const bool has_le = !s.labels.empty() && s.labels.back().first == "le";
    if (s.name == f.name + "_bucket") {
      if (!has_le) return absl::InvalidArgumentError("bucket without a trailing le");
      auto le = ParseValue(s.labels.back().second);
      if (!le.ok()) return le.status();
      g.buckets.emplace_back(*le, s.value);
    } else if (has_le || std::any_of(s.labels.begin(), s.labels.end(), [](const auto& l) { return l.first == "le"; })) {
      return absl::InvalidArgumentError("le outside a bucket");
    } else if (s.name == f.name + "_sum") {
      g.has_sum = true;
    } else if (s.name == f.name + "_count") {
      g.has_count = true;
      g.count = s.value;
    }
  }
  for (const auto& [key, g] : series) {
    if (g.buckets.empty() || !g.has_sum || !g.has_count) {
      return absl::InvalidArgumentError(absl::StrCat(key, ": incomplete histogram"));
    }
    for (size_t i = 1; i < g.buckets.size(); ++i) {
      if (!(g.buckets[i - 1].first < g.buckets[i].first)) {
        return absl::InvalidArgumentError(absl::StrCat(key, ": le not increasing"));
      }
      if (g.buckets[i - 1].second > g.buckets[i].second) {
        return absl::InvalidArgumentError(absl::StrCat(key, ": buckets not cumulative"));
      }
    }
    if (g.buckets.back().first != kInf) {
      return absl::InvalidArgumentError(absl::StrCat(key, ": no +Inf bucket"));
    }
    if (g.buckets.back().second != g.count) {
      return absl::InvalidArgumentError(
          absl::StrCat(key, ": _count ", g.count, " != +Inf bucket ", g.buckets.back().second));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ParsedFamily>> ParseExposition(std::string_view text) {
  std::vector<ParsedFamily> families;
  if (text.empty()) return families;
  if (text.back() != '\n') return absl::InvalidArgumentError("no final newline");
  std::set<std::string> family_names, series_keys;
  bool want_type = false;
  int line_no = 0;
  while (!text.empty()) {
    ++line_no;
    const size_t eol = text.find('\n');
    const std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol + 1);
    auto fail = [&](absl::Status s) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, " \"", std::string(line), "\": ", s.message()));
    };
    if (line.substr(0, 7) == "# HELP ") {
      if (want_type) return fail(absl::InvalidArgumentError("HELP without TYPE before it"));
      if (!families.empty() && families.back().samples.empty()) {
        return fail(absl::InvalidArgumentError("previous family has no samples"));
      }
      std::string_view s = line.substr(7);
      auto name = TakeName(s, /*colon=*/true);
      if (!name.ok()) return fail(name.status());
      if (s.empty() || s[0] != ' ') return fail(absl::InvalidArgumentError("expected a space"));
      auto help = Unescape(s.substr(1), /*quote=*/false);
      if (!help.ok()) return fail(help.status());
      if (!family_names.insert(*name).second) {
        return fail(absl::InvalidArgumentError("family repeated"));
      }
      families.push_back({*name, *help, "", {}});
      want_type = true;
    } else if (line.substr(0, 7) == "# TYPE ") {
      if (!want_type) return fail(absl::InvalidArgumentError("TYPE without HELP"));
      std::string_view s = line.substr(7);
      auto name = TakeName(s, /*colon=*/true);
      if (!name.ok()) return fail(name.status());
      if (*name != families.back().name) return fail(absl::InvalidArgumentError("TYPE of another name"));
      if (s != " counter" && s != " gauge" && s != " histogram") {
        return fail(absl::InvalidArgumentError("bad type"));
      }
      families.back().type = std::string(s.substr(1));
      want_type = false;
    } else if (!line.empty() && line[0] != '#') {
      if (families.empty() || want_type) return fail(absl::InvalidArgumentError("sample outside a family"));
      auto sample = ParseSampleLine(line);
      if (!sample.ok()) return fail(sample.status());
      ParsedFamily& f = families.back();
      const bool belongs = f.type == "histogram"
                               ? (sample->name == f.name + "_bucket" || sample->name == f.name + "_sum" ||
                                  sample->name == f.name + "_count")
                               : sample->name == f.name;
      if (!belongs) return fail(absl::InvalidArgumentError("sample of another family"));
      if (!series_keys.insert(SeriesKey(sample->name, *sample, /*drop_le=*/false)).second) {
        return fail(absl::InvalidArgumentError("duplicate series"));
      }
      f.samples.push_back(*std::move(sample));
    } else {
      return fail(absl::InvalidArgumentError("unexpected line"));
    }
  }
  if (want_type || families.back().samples.empty()) {
    return absl::InvalidArgumentError("last family incomplete");
  }
  for (const ParsedFamily& f : families) {
    if (f.type != "histogram") continue;
    if (absl::Status s = CheckHistogram(f); !s.ok()) return s;
  }
  return families;
}

// series key ("name{a=\"x\",}") -> value, over every sample.
std::map<std::string, double> Values(const std::vector<ParsedFamily>& families) {
  std::map<std::string, double> values;
  for (const ParsedFamily& f : families) {
    for (const ParsedSample& s : f.samples) values[SeriesKey(s.name, s, false)] = s.value;
  }
  return values;
}

std::map<std::string, double> RenderAndParse(const MetricsRegistry& registry) {
  const std::string text = registry.Render();
  auto families = ParseExposition(text);
  EXPECT_TRUE(families.ok()) << families.status() << "\n" << text;
  return families.ok() ? Values(*families) : std::map<std::string, double>();
}

TEST(ExpositionParserTest, RejectsMalformedText) {
  const std::string kGood = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 2\n";
  ASSERT_TRUE(ParseExposition(kGood).ok());
  for (std::string_view bad : {
           "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 2",  // no newline
           "# TYPE a_total counter\na_total 2\n",                            // no HELP
           "# HELP a_total A.\n# TYPE a_total counter\n",                    // no samples
           "# HELP a_total A.\n# TYPE a_total counter\na_total 2x\n",
           "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1} 2\n",
           "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"a\"b\"} 2\n",
           "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"\\t\"} 2\n",
           "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\",} 2\n",
           "# HELP a_total A.\n# TYPE a_total counter\na_total{1x=\"1\"} 2\n",
           "# HELP a_total A.\n# TYPE a_total counter\nb_total 2\n",
           "# HELP a_total A.\n# TYPE a_total counter\na_total 1\na_total 2\n",
           "# HELP a_total A.\n# TYPE a_total summary\na_total 1\n",
           "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
           "h_sum 1\nh_count 1\n",
           "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n"
           "h_sum 1\nh_count 3\n",
           "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
       }) {
    EXPECT_FALSE(ParseExposition(bad).ok()) << bad;
  }
}

// ---------------------------------------------------------------------------
// Rendering.

TEST(MetricsRegistryTest, RendersExactText) {
  MetricsRegistry registry;
  CounterFamily& requests = registry.AddCounter("tandem_requests_total", "Requests received.", {"route", "code"});
  requests.WithLabels({"chat", "200"}).Inc();
  requests.WithLabels({"chat", "200"}).Inc(2);
  requests.WithLabels({"completions", "429"}).Inc(0.5);
  requests.WithLabels({"a\"b\\c\nd", "500"}).Inc();

  GaugeFamily& depth = registry.AddGauge("tandem_queue_depth", "Requests waiting.\nPer router; a \\ in help.");
  depth.Get().Set(7);
  depth.Get().Dec(2);

  HistogramFamily& latency =
      registry.AddHistogram("tandem_request_latency_seconds", "Time to last token.", {"route"}, {0.005, 0.25, 1});
  Histogram& chat = latency.WithLabels({"chat"});
  for (double v : {0.125, 0.25, 0.5, 3.0}) chat.Observe(v);  // 0.25 is in le="0.25"
  latency.WithLabels({"embeddings"}).Observe(1);
  latency.Remove({"embeddings"});

  registry.AddCallbackGauge("tandem_worker_in_flight", "In-flight requests per worker.", {"worker"},
                            [](MetricEmitter& e) {
                              e.Emit({"w2"}, 3);
                              e.Emit({"w1"}, 1.5);
                            });
  registry.AddGauge("tandem_unused", "Never set: not rendered.", {"x"});
  registry.AddCounter("tandem_errors_total", "Errors.");

  const std::string kWant = R"txt(# HELP tandem_requests_total Requests received.
# TYPE tandem_requests_total counter
tandem_requests_total{route="a\"b\\c\nd",code="500"} 1
tandem_requests_total{route="chat",code="200"} 3
tandem_requests_total{route="completions",code="429"} 0.5
# HELP tandem_queue_depth Requests waiting.\nPer router; a \\ in help.
# TYPE tandem_queue_depth gauge
tandem_queue_depth 5
# HELP tandem_request_latency_seconds Time to last token.
# TYPE tandem_request_latency_seconds histogram
tandem_request_latency_seconds_bucket{route="chat",le="0.005"} 0
tandem_request_latency_seconds_bucket{route="chat",le="0.25"} 2
tandem_request_latency_seconds_bucket{route="chat",le="1"} 3
tandem_request_latency_seconds_bucket{route="chat",le="+Inf"} 4
tandem_request_latency_seconds_sum{route="chat"} 3.875
tandem_request_latency_seconds_count{route="chat"} 4
# HELP tandem_worker_in_flight In-flight requests per worker.
# TYPE tandem_worker_in_flight gauge
tandem_worker_in_flight{worker="w1"} 1.5
tandem_worker_in_flight{worker="w2"} 3
# HELP tandem_errors_total Errors.
# TYPE tandem_errors_total counter
tandem_errors_total 0
)txt";
  const std::string text = registry.Render();
  EXPECT_EQ(text, kWant);

  auto parsed = ParseExposition(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 5u);
  EXPECT_EQ((*parsed)[0].samples[0].labels[0].second, "a\"b\\c\nd");  // escaping round-trips
  EXPECT_EQ((*parsed)[1].help, "Requests waiting.\nPer router; a \\ in help.");
}

TEST(MetricsRegistryTest, EmptyRegistryRendersNothing) {
  MetricsRegistry registry;
  EXPECT_EQ(registry.Render(), "");
}

TEST(MetricsRegistryTest, ChildrenSortedByLabelValuesFamiliesInRegistrationOrder) {
  MetricsRegistry registry;
  GaugeFamily& z = registry.AddGauge("z_gauge", "Z.", {"a", "b"});
  CounterFamily& a = registry.AddCounter("a_total", "A.");
  z.WithLabels({"y", "2"}).Set(1);
  z.WithLabels({"x", "9"}).Set(2);
  z.WithLabels({"y", "1"}).Set(3);
  a.Get().Inc();
  EXPECT_EQ(registry.Render(),
            "# HELP z_gauge Z.\n# TYPE z_gauge gauge\n"
            "z_gauge{a=\"x\",b=\"9\"} 2\n"
            "z_gauge{a=\"y\",b=\"1\"} 3\n"
            "z_gauge{a=\"y\",b=\"2\"} 1\n"
            "# HELP a_total A.\n# TYPE a_total counter\na_total 1\n");
}

TEST(MetricsRegistryTest, InvalidUtf8InLabelValuesIsReplaced) {
  MetricsRegistry registry;
  registry.AddGauge("g", "G.", {"worker"}).WithLabels({"w\xff"}).Set(1);
  EXPECT_THAT(registry.Render(), HasSubstr("g{worker=\"w\xEF\xBF\xBD\"} 1\n"));
}

TEST(FormatValueTest, ShortestRoundTripAndIntegersPlain) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(-0.0), "0");
  EXPECT_EQ(FormatValue(3), "3");
  EXPECT_EQ(FormatValue(-2), "-2");
  EXPECT_EQ(FormatValue(123456789), "123456789");
  EXPECT_EQ(FormatValue(1e6), "1000000");
  EXPECT_EQ(FormatValue(9007199254740992.0), "9007199254740992");  // 2^53
  EXPECT_EQ(FormatValue(1e20), "1e+20");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(0.005), "0.005");
  EXPECT_EQ(FormatValue(1e-05), "1e-05");
  EXPECT_EQ(FormatValue(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(FormatValue(kInf), "+Inf");
  EXPECT_EQ(FormatValue(-kInf), "-Inf");
  EXPECT_EQ(FormatValue(kNaN), "NaN");
  for (double v : {0.1, 1.0 / 3, 2.5e-300, 6.02214076e23, -7.25}) {
    EXPECT_EQ(std::stod(FormatValue(v)), v) << FormatValue(v);
  }
}

// ---------------------------------------------------------------------------
// Children.

TEST(CounterTest, IncrementsAndDropsNegativeAndNaN) {
  MetricsRegistry registry;
  Counter& c = registry.AddCounter("c_total", "C.").Get();
  c.Inc();
  c.Inc(2);
  c.Inc(0.25);
  c.Inc(-1);
  c.Inc(kNaN);
  c.Inc(0);
  EXPECT_EQ(c.Value(), 3.25);
}

TEST(GaugeTest, SetIncDec) {
  MetricsRegistry registry;
  Gauge& g = registry.AddGauge("g", "G.").Get();
  g.Set(10);
  g.Inc();
  g.Inc(0.5);
  g.Dec(3);
  EXPECT_EQ(g.Value(), 8.5);
  g.Set(-kInf);
  EXPECT_EQ(RenderAndParse(registry)["g{}"], -kInf);
}

TEST(HistogramTest, BucketsAreInclusiveUpperBounds) {
  MetricsRegistry registry;
  Histogram& h = registry.AddHistogram("h_seconds", "H.", {}, {1, 2, 4, kInf}).Get();
  EXPECT_THAT(h.bounds(), ElementsAre(1, 2, 4));  // the trailing +Inf is implied
  for (double v : {-5.0, 1.0, 1.5, 2.0, 4.0, 4.5, kInf, kNaN}) h.Observe(v);
  const Histogram::Snapshot s = h.Read();
  EXPECT_THAT(s.cumulative, ElementsAre(2, 4, 5, 8));
  EXPECT_EQ(s.count(), 8u);
  EXPECT_TRUE(std::isnan(s.sum));
  std::map<std::string, double> values = RenderAndParse(registry);
  EXPECT_EQ(values["h_seconds_bucket{le=\"2\",}"], 4);
  EXPECT_EQ(values["h_seconds_count{}"], 8);
  EXPECT_TRUE(std::isnan(values["h_seconds_sum{}"]));
}

TEST(HistogramTest, ValidatesBucketBounds) {
  EXPECT_TRUE(ValidateBucketBounds({0.1, 1, 10}).ok());
  EXPECT_TRUE(ValidateBucketBounds({-1, 0, kInf}).ok());
  EXPECT_EQ(ValidateBucketBounds({}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ValidateBucketBounds({kInf}).ok());
  EXPECT_FALSE(ValidateBucketBounds({1, 1}).ok());
  EXPECT_FALSE(ValidateBucketBounds({2, 1}).ok());
  EXPECT_FALSE(ValidateBucketBounds({1, kNaN}).ok());
  EXPECT_FALSE(ValidateBucketBounds({-kInf, 1}).ok());
  EXPECT_FALSE(ValidateBucketBounds({1, kInf, 2}).ok());
}

TEST(HistogramTest, BucketHelpers) {
  EXPECT_THAT(ExponentialBuckets(0.001, 2, 4), ElementsAre(0.001, 0.002, 0.004, 0.008));
  EXPECT_THAT(LinearBuckets(0, 0.5, 3), ElementsAre(0, 0.5, 1));
  EXPECT_TRUE(ValidateBucketBounds(ExponentialBuckets(1e-4, 1.5, 40)).ok());
}

// ---------------------------------------------------------------------------
// Removal and callbacks.

TEST(MetricFamilyTest, RemoveHidesChildAndReAddStartsAtZero) {
  MetricsRegistry registry;
  CounterFamily& family = registry.AddCounter("worker_requests_total", "R.", {"worker"});
  Counter& w1 = family.WithLabels({"w1"});
  Counter& w2 = family.WithLabels({"w2"});
  w1.Inc(5);
  w2.Inc(7);
  EXPECT_EQ(&family.WithLabels({"w1"}), &w1);  // stable

  family.Remove({"w1"});
  family.Remove({"unknown"});  // no-op
  w1.Inc();                    // a stale cached reference stays valid
  std::map<std::string, double> values = RenderAndParse(registry);
  EXPECT_EQ(values.count("worker_requests_total{worker=\"w1\",}"), 0u);
  EXPECT_EQ(values["worker_requests_total{worker=\"w2\",}"], 7);

  Counter& again = family.WithLabels({"w1"});
  EXPECT_EQ(again.Value(), 0);
  again.Inc();
  EXPECT_EQ(RenderAndParse(registry)["worker_requests_total{worker=\"w1\",}"], 1);

  family.Remove({"w1"});
  family.Remove({"w2"});
  EXPECT_EQ(registry.Render(), "");  // a family left with no children is omitted
}

TEST(CallbackFamilyTest, EmitsAtRenderTime) {
  MetricsRegistry registry;
  std::atomic<int> kv_blocks{10};
  std::map<std::string, int> in_flight = {{"w1", 2}};
  registry.AddCallbackGauge("kv_index_blocks", "Blocks indexed.", {},
                            [&](MetricEmitter& e) { e.Emit({}, kv_blocks.load()); });
  registry.AddCallbackGauge("worker_in_flight", "In flight.", {"worker"}, [&](MetricEmitter& e) {
    for (const auto& [worker, n] : in_flight) e.Emit({worker}, n);
    if (in_flight.contains("w1")) e.Emit({"w1"}, 99);  // a duplicate: the first emitted wins
  });
  registry.AddCallbackCounter("worker_restarts_total", "Restarts.", {"worker"},
                              [](MetricEmitter& e) { e.Emit({"w1"}, 4); });
  registry.AddCallbackGauge("nothing", "Emits nothing.", {"x"}, [](MetricEmitter&) {});

  EXPECT_EQ(registry.Render(),
            "# HELP kv_index_blocks Blocks indexed.\n# TYPE kv_index_blocks gauge\n"
            "kv_index_blocks 10\n"
            "# HELP worker_in_flight In flight.\n# TYPE worker_in_flight gauge\n"
            "worker_in_flight{worker=\"w1\"} 2\n"
            "# HELP worker_restarts_total Restarts.\n# TYPE worker_restarts_total counter\n"
            "worker_restarts_total{worker=\"w1\"} 4\n");
  kv_blocks = 12;
  in_flight = {{"w3", 1}, {"w2", 0}};  // w1 left the pool
  std::map<std::string, double> values = RenderAndParse(registry);
  EXPECT_EQ(values["kv_index_blocks{}"], 12);
  EXPECT_EQ(values.count("worker_in_flight{worker=\"w1\",}"), 0u);
  EXPECT_EQ(values["worker_in_flight{worker=\"w2\",}"], 0);
  EXPECT_EQ(values["worker_in_flight{worker=\"w3\",}"], 1);
}

TEST(CallbackFamilyTest, CallbackMayTakeLocksAndRenderAnotherRegistry) {
  MetricsRegistry inner;
  inner.AddCounter("inner_total", "I.").Get().Inc(3);
  MetricsRegistry registry;
  std::mutex mu;
  registry.AddCallbackGauge("inner_render_bytes", "Bytes of the inner registry's text.", {}, [&](MetricEmitter& e) {
    std::lock_guard<std::mutex> lock(mu);
    e.Emit({}, static_cast<double>(inner.Render().size()));
  });
  EXPECT_EQ(RenderAndParse(registry)["inner_render_bytes{}"], inner.Render().size());
}

// ---------------------------------------------------------------------------
// Registration errors are programming errors: CHECK-fail.

class MetricsDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(MetricsDeathTest, BadRegistrations) {
  MetricsRegistry r;
  r.AddCounter("taken_total", "T.");
  r.AddHistogram("latency_seconds", "L.", {}, {1});
  EXPECT_DEATH(r.AddGauge("taken_total", "Again."), "registered twice");
  EXPECT_DEATH(r.AddGauge("latency_seconds_count", "Clash."), "registered twice");
  EXPECT_DEATH(r.AddCounter("requests", "R."), "must end in _total");
  EXPECT_DEATH(r.AddGauge("1bad", "B."), "invalid metric name");
  EXPECT_DEATH(r.AddGauge("bad-name", "B."), "invalid metric name");
  EXPECT_DEATH(r.AddGauge("g", ""), "help text is empty");
  EXPECT_DEATH(r.AddGauge("g", "G.", {"bad-label"}), "invalid label name");
  EXPECT_DEATH(r.AddGauge("g", "G.", {"a:b"}), "invalid label name");
  EXPECT_DEATH(r.AddGauge("g", "G.", {"__internal"}), "reserved");
  EXPECT_DEATH(r.AddGauge("g", "G.", {"a", "a"}), "repeated");
  EXPECT_DEATH(r.AddHistogram("h", "H.", {"le"}, {1}), "le is reserved");
  EXPECT_DEATH(r.AddHistogram("h", "H.", {}, {2, 1}), "strictly increasing");
  EXPECT_DEATH(r.AddHistogram("h", "H.", {}, {}), "at least one");
  EXPECT_DEATH(ExponentialBuckets(0, 2, 3), "ExponentialBuckets");
  EXPECT_DEATH(LinearBuckets(0, 0, 3), "LinearBuckets");
  r.AddGauge("le_is_fine_in_a_gauge", "G.", {"le"});
}

TEST_F(MetricsDeathTest, WrongNumberOfLabelValues) {
  MetricsRegistry r;
  GaugeFamily& g = r.AddGauge("g", "G.", {"a", "b"});
  EXPECT_DEATH(g.WithLabels({"x"}), "1 label values for 2 label names");
  EXPECT_DEATH(g.Get(), "has labels");
  r.AddCallbackGauge("cb", "C.", {"a"}, [](MetricEmitter& e) { e.Emit({}, 1); });
  EXPECT_DEATH(r.Render(), "0 label values emitted for 1 label names");
}

// ---------------------------------------------------------------------------
// Concurrency: updates, new children and removals on several threads while
// two others render. Meant to be run under TSan as well.

TEST(MetricsConcurrencyTest, UpdatesWhileRendering) {
  constexpr int kThreads = 4;
  constexpr int kIters = 50000;
  MetricsRegistry registry;
  CounterFamily& per_thread = registry.AddCounter("per_thread_total", "P.", {"thread"});
  Counter& shared = registry.AddCounter("shared_total", "S.").Get();
  Histogram& latency = registry.AddHistogram("latency_seconds", "L.", {}, ExponentialBuckets(0.25, 2, 4)).Get();
  GaugeFamily& churn = registry.AddGauge("churn", "C.", {"worker"});
  Gauge& balance = registry.AddGauge("balance", "B.").Get();
  std::atomic<int64_t> callback_value{0};
  registry.AddCallbackGauge("callback", "Cb.", {},
                            [&](MetricEmitter& e) { e.Emit({}, static_cast<double>(callback_value.load())); });

  std::atomic<bool> done{false};
  std::atomic<int> renders{0};
  std::atomic<bool> parse_failed{false};
  auto render_loop = [&] {
    double last_shared = 0, last_count = 0;
    while (!done.load()) {
      std::map<std::string, double> values = RenderAndParse(registry);
      if (values.empty()) {  // the parse failed; already reported
        parse_failed = true;
        return;
      }
      const double now_shared = values["shared_total{}"];
      const double now_count = values["latency_seconds_count{}"];
      EXPECT_GE(now_shared, last_shared);
      EXPECT_GE(now_count, last_count);
      last_shared = now_shared;
      last_count = now_count;
      renders.fetch_add(1);
    }
  };
  std::thread renderer1(render_loop);
  std::thread renderer2(render_loop);

  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      const std::string name = absl::StrCat("t", t);
      Counter& mine = per_thread.WithLabels({name});
      for (int i = 0; i < kIters; ++i) {
        mine.Inc();
        shared.Inc();
        latency.Observe(0.5 * (i % 4));  // 0, 0.5, 1, 1.5: exact sums
        balance.Inc(0.5);
        balance.Dec(0.5);
        callback_value.fetch_add(1);
        if (i % 500 == 0) {
          const std::string worker = absl::StrCat("w", (i / 500) % 3);
          churn.WithLabels({worker}).Set(i);
          if (i % 1000 == 0) churn.Remove({worker});
        }
      }
    });
  }
  for (std::thread& w : workers) w.join();
  // Let the renderers see at least one complete state before stopping.
  const int renders_before = renders.load();
  while (renders.load() < renders_before + 2 && !parse_failed.load()) std::this_thread::yield();
  done = true;
  renderer1.join();
  renderer2.join();

  std::map<std::string, double> values = RenderAndParse(registry);
  EXPECT_EQ(values["shared_total{}"], kThreads * kIters);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(values[absl::StrCat("per_thread_total{thread=\"t", t, "\",}")], kIters);
  }
  EXPECT_EQ(values["latency_seconds_count{}"], kThreads * kIters);
  EXPECT_EQ(values["latency_seconds_sum{}"], kThreads * (kIters / 4) * (0 + 0.5 + 1 + 1.5));
  EXPECT_EQ(values["latency_seconds_bucket{le=\"0.5\",}"], kThreads * kIters / 2);
  EXPECT_EQ(values["balance{}"], 0);
  EXPECT_EQ(values["callback{}"], kThreads * kIters);
  EXPECT_GT(renders.load(), 2);
}

}  // namespace
}  // namespace tandem
