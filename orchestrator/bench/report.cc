#include "orchestrator/bench/report.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/html.h"

// Debian's Abseil has its own absl::string_view (the one StrCat takes), so
// this file uses it rather than std::string_view.

namespace tandem::bench {
namespace {

// The most distinct error texts a summary keeps, and how much of each the
// text report prints (a 5xx body can be a whole HTML page).
constexpr size_t kMaxErrors = 5;
constexpr size_t kMaxErrorChars = 300;

// Report layout, as vLLM's benchmark_serving.py prints it: 50 columns,
// labels left-aligned in 40.
constexpr size_t kTextWidth = 50;

// HTML charts: the scatter keeps at most this many points (a 10k-request run
// stays ~100 KB of SVG), the throughput chart at most this many bins (1 s
// each, or wider for runs over ~3 minutes), histograms this many bars.
constexpr size_t kMaxScatterPoints = 2000;
constexpr int kMaxTimeBins = 200;
constexpr int kHistogramBins = 40;

// Linear interpolation between closest ranks (numpy's default) over sorted
// `v`. REQUIRES: !v.empty().
double Percentile(const std::vector<double>& v, double p) {
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

// One successful request's latencies in ms; nullopt where undefined.
struct Latencies {
  std::optional<double> ttft_ms;  // needs a first token
  std::optional<double> tpot_ms;  // needs >= 2 output tokens
  double e2e_ms = 0;
};

Latencies LatenciesOf(const RequestRecord& r) {
  Latencies l;
  l.e2e_ms = (r.done_s - r.sent_s) * 1e3;
  if (r.first_token_s >= 0) {
    l.ttft_ms = (r.first_token_s - r.sent_s) * 1e3;
    if (r.output_tokens >= 2) {
      l.tpot_ms = (r.done_s - r.first_token_s) * 1e3 / static_cast<double>(r.output_tokens - 1);
    }
  }
  return l;
}

// The gaps between a request's consecutive token-bearing chunks, in ms.
std::vector<double> ItlGapsMs(const RequestRecord& r) {
  std::vector<double> gaps;
  for (size_t i = 1; i < r.token_times_s.size(); ++i) {
    gaps.push_back((r.token_times_s[i] - r.token_times_s[i - 1]) * 1e3);
  }
  return gaps;
}

bool HasSlo(const Slo& slo) { return slo.ttft_ms || slo.tpot_ms || slo.e2e_ms; }

// A request without a token is held to the TTFT SLO by its e2e latency (the
// user waited that long for an empty answer); one with < 2 tokens has no TPOT
// and passes that SLO, as in vLLM.
bool MeetsSlo(const Latencies& l, const Slo& slo) {
  if (slo.ttft_ms && l.ttft_ms.value_or(l.e2e_ms) > *slo.ttft_ms) return false;
  if (slo.tpot_ms && l.tpot_ms && *l.tpot_ms > *slo.tpot_ms) return false;
  if (slo.e2e_ms && l.e2e_ms > *slo.e2e_ms) return false;
  return true;
}

// Per-chart samples, from successful requests.
struct Samples {
  std::vector<double> ttft_ms, tpot_ms, itl_ms, e2e_ms;
};

Samples CollectSamples(const std::vector<RequestRecord>& records) {
  Samples s;
  for (const RequestRecord& r : records) {
    if (!r.ok) continue;
    const Latencies l = LatenciesOf(r);
    if (l.ttft_ms) s.ttft_ms.push_back(*l.ttft_ms);
    if (l.tpot_ms) s.tpot_ms.push_back(*l.tpot_ms);
    s.e2e_ms.push_back(l.e2e_ms);
    const std::vector<double> gaps = ItlGapsMs(r);
    s.itl_ms.insert(s.itl_ms.end(), gaps.begin(), gaps.end());
  }
  return s;
}

std::string SloText(const Slo& slo) {
  std::vector<std::string> parts;
  if (slo.ttft_ms) parts.push_back(absl::StrFormat("TTFT <= %g ms", *slo.ttft_ms));
  if (slo.tpot_ms) parts.push_back(absl::StrFormat("TPOT <= %g ms", *slo.tpot_ms));
  if (slo.e2e_ms) parts.push_back(absl::StrFormat("E2EL <= %g ms", *slo.e2e_ms));
  return absl::StrJoin(parts, ", ");
}

// The summary's "label: value" lines, shared by the text and HTML reports.
std::vector<std::pair<std::string, std::string>> SummaryRows(const Summary& s) {
  std::vector<std::pair<std::string, std::string>> rows = {
      {"Successful requests:", absl::StrCat(s.completed)},
      {"Failed requests:", absl::StrCat(s.failed)},
      {"Benchmark duration (s):", absl::StrFormat("%.2f", s.duration_s)},
      {"Total input tokens:", absl::StrCat(s.total_input_tokens)},
      {"Total generated tokens:", absl::StrCat(s.total_output_tokens)},
  };
  if (s.total_cached_tokens > 0) {
    rows.push_back({"Total cached input tokens:", absl::StrCat(s.total_cached_tokens)});
  }
  rows.push_back({"Request throughput (req/s):", absl::StrFormat("%.2f", s.request_throughput)});
  rows.push_back({"Input token throughput (tok/s):", absl::StrFormat("%.2f", s.input_throughput)});
  rows.push_back({"Output token throughput (tok/s):", absl::StrFormat("%.2f", s.output_throughput)});
  if (HasSlo(s.slo)) {
    rows.push_back({"Goodput (req/s):", absl::StrFormat("%.2f", s.goodput)});
    rows.push_back({"Goodput SLOs:", SloText(s.slo)});
  }
  if (s.router_prefix_hit_rate) {
    rows.push_back({"Router prefix cache hit rate:", absl::StrFormat("%.1f%%", *s.router_prefix_hit_rate * 100)});
  }
  rows.push_back({"Client overhead (us/request):", absl::StrFormat("%.1f", s.client_overhead_us_per_request)});
  return rows;
}

struct Section {
  const char* title;  // the text report's section rule
  const char* name;   // the metric's name in its lines
  const Distribution* d;
};

// One statistic of `d` as the reports print it: "n/a" when it has no sample
// (e.g. TPOT when every output was one token), never a misleading 0.
std::string Stat(const Distribution& d, double v) { return d.count > 0 ? absl::StrFormat("%.2f", v) : "n/a"; }

std::vector<Section> Sections(const Summary& s) {
  return {{"Time to First Token", "TTFT", &s.ttft_ms},
          {"Time per Output Token (excl. 1st token)", "TPOT", &s.tpot_ms},
          {"Inter-token Latency", "ITL", &s.itl_ms},
          {"End-to-end Latency", "E2EL", &s.e2e_ms}};
}

// `text` centred in kTextWidth columns of `fill`, as Python's
// "{:=^50}".format(text) does (the odd column goes right).
std::string Rule(absl::string_view text, char fill) {
  const size_t pad = kTextWidth > text.size() ? kTextWidth - text.size() : 0;
  return absl::StrCat(std::string(pad / 2, fill), text, std::string(pad - pad / 2, fill), "\n");
}

std::string Line(absl::string_view label, absl::string_view value) {
  return absl::StrFormat("%-40s %s\n", label, value);
}

// An error text on one line, cut to about kMaxErrorChars (at a UTF-8
// character boundary, so the HTML page stays valid UTF-8).
std::string OneLine(absl::string_view text) {
  size_t cut = std::min(text.size(), kMaxErrorChars);
  while (cut > 0 && cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  std::string out;
  for (char c : text.substr(0, cut)) out += (c == '\n' || c == '\r' || c == '\t') ? ' ' : c;
  if (cut < text.size()) out += "...";
  return out;
}

// ---------------------------------------------------------------------------
// HTML and SVG.

std::string Escape(absl::string_view text) { return HtmlEscape(std::string_view(text.data(), text.size())); }

// A 1, 2 or 5 times a power of ten near span / target: about `target` ticks.
double NiceStep(double span, int target) {
  const double raw = span / target;
  if (!(raw > 0) || !std::isfinite(raw)) return 1;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

struct Axis {
  double lo = 0, hi = 1, step = 1;

  // Calls f(v) for each tick value lo, lo + step, ... up to hi.
  template <typename F>
  void ForEachTick(F&& f) const {
    for (int i = 0;; ++i) {
      const double v = lo + i * step;
      if (v > hi + step * 1e-6) return;
      f(v);
    }
  }
};

// [lo, hi] widened to whole ticks; a point range becomes a unit around it.
Axis NiceAxis(double lo, double hi) {
  if (!(hi > lo)) {
    lo = lo - (lo == 0 ? 0 : std::abs(lo) * 0.1);
    hi = lo + (lo == 0 ? 1 : std::abs(lo) * 0.2);
  }
  Axis a;
  a.step = NiceStep(hi - lo, 5);
  a.lo = std::floor(lo / a.step) * a.step;
  a.hi = std::ceil(hi / a.step) * a.step;
  if (a.hi <= a.lo) a.hi = a.lo + a.step;
  return a;
}

// The plot area of one chart, in SVG pixels, and the data-to-pixel maps.
struct Frame {
  static constexpr double kWidth = 640, kHeight = 300;
  static constexpr double kLeft = 64, kRight = 16, kTop = 12, kBottom = 44;
  Axis x, y;
  double Px(double v) const { return kLeft + (v - x.lo) / (x.hi - x.lo) * (kWidth - kLeft - kRight); }
  double Py(double v) const { return kHeight - kBottom - (v - y.lo) / (y.hi - y.lo) * (kHeight - kTop - kBottom); }
};

std::string Tick(double v) {
  if (std::abs(v) < 1e-12) return "0";
  return absl::StrFormat("%g", v);
}

// Opens an <svg> with the axes, grid, tick labels and axis titles of `f`.
std::string OpenChart(const Frame& f, absl::string_view label, absl::string_view x_title, absl::string_view y_title) {
  std::string svg =
      absl::StrFormat("<svg viewBox=\"0 0 %g %g\" width=\"%g\" height=\"%g\" role=\"img\" aria-label=\"%s\">\n",
                      Frame::kWidth, Frame::kHeight, Frame::kWidth, Frame::kHeight, Escape(label));
  const double x0 = Frame::kLeft, x1 = Frame::kWidth - Frame::kRight;
  const double y0 = Frame::kHeight - Frame::kBottom, y1 = Frame::kTop;
  f.y.ForEachTick([&](double v) {
    const double py = f.Py(v);
    absl::StrAppendFormat(&svg, "<line class=\"grid\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>", x0, py, x1,
                          py);
    absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", x0 - 6, py + 4, Tick(v));
  });
  f.x.ForEachTick([&](double v) {
    const double px = f.Px(v);
    absl::StrAppendFormat(&svg, "<line class=\"axis\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>", px, y0, px,
                          y0 + 5);
    absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n", px, y0 + 18, Tick(v));
  });
  absl::StrAppendFormat(&svg,
                        "<line class=\"axis\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>"
                        "<line class=\"axis\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>\n",
                        x0, y0, x1, y0, x0, y0, x0, y1);
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n", (x0 + x1) / 2,
                        Frame::kHeight - 6, Escape(x_title));
  absl::StrAppendFormat(&svg,
                        "<text x=\"14\" y=\"%.1f\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 14 %.1f)\">%s</text>\n",
                        (y0 + y1) / 2, (y0 + y1) / 2, Escape(y_title));
  return svg;
}

std::string NoData(const Frame& f) {
  return absl::StrFormat("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">no data</text>\n",
                         (Frame::kLeft + Frame::kWidth - Frame::kRight) / 2,
                         (Frame::kTop + Frame::kHeight - Frame::kBottom) / 2);
}

std::string Figure(absl::string_view caption, absl::string_view svg, absl::string_view note) {
  return absl::StrCat("<figure><figcaption>", Escape(caption), "</figcaption>\n", svg, "</svg>\n",
                      note.empty() ? "" : absl::StrCat("<p class=\"note\">", Escape(note), "</p>\n"), "</figure>\n");
}

// A histogram of `samples` (ms). A long tail (the maximum more than twice as
// far from the minimum as P99 is) would squash the bulk into one bar, so the
// axis then ends near P99 and the last bar also counts the samples beyond.
std::string Histogram(absl::string_view caption, absl::string_view x_title, std::vector<double> samples) {
  Frame f;
  if (samples.empty()) {
    return Figure(caption, OpenChart(f, caption, x_title, "requests") + NoData(f), "");
  }
  std::sort(samples.begin(), samples.end());
  const double min = samples.front(), max = samples.back();
  const double p99 = Percentile(samples, 99);
  const double top = (max - min) > 2 * (p99 - min) && p99 > min ? p99 : max;
  f.x = NiceAxis(min, top);
  const double width = (f.x.hi - f.x.lo) / kHistogramBins;
  std::vector<int64_t> counts(kHistogramBins, 0);
  int64_t beyond = 0;
  for (double v : samples) {
    if (v > f.x.hi) ++beyond;
    const int bin = static_cast<int>((v - f.x.lo) / width);
    ++counts[std::clamp(bin, 0, kHistogramBins - 1)];
  }
  f.y = NiceAxis(0, static_cast<double>(*std::max_element(counts.begin(), counts.end())));
  std::string svg = OpenChart(f, caption, x_title, "count");
  for (int i = 0; i < kHistogramBins; ++i) {
    if (counts[i] == 0) continue;
    const double x = f.Px(f.x.lo + i * width), w = f.Px(f.x.lo + (i + 1) * width) - x;
    const double y = f.Py(static_cast<double>(counts[i]));
    absl::StrAppendFormat(&svg,
                          "<rect class=\"bar\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\">"
                          "<title>%s-%s ms: %d</title></rect>\n",
                          x, y, std::max(w - 1, 0.5), f.Py(0) - y, Tick(f.x.lo + i * width),
                          Tick(f.x.lo + (i + 1) * width), counts[i]);
  }
  std::string note;
  if (beyond > 0) {
    note = absl::StrFormat("The last bar also counts %d sample(s) above %g ms (max %.1f ms).", beyond, f.x.hi, max);
  }
  return Figure(caption, svg, note);
}

// Output tokens per second over the run, from successful requests: a chunk
// carries output_tokens / chunks tokens; a response without token times
// (not streamed) counts all its tokens when it ended.
std::string ThroughputChart(const Summary& s, const std::vector<RequestRecord>& records) {
  constexpr absl::string_view kCaption = "Output token throughput over time";
  Frame f;
  double start = 0, end = 0;
  bool any = false;
  for (const RequestRecord& r : records) {
    start = any ? std::min(start, r.sent_s) : r.sent_s;
    end = any ? std::max(end, r.done_s) : r.done_s;
    any = true;
  }
  const double span = end - start;
  if (!any || !(span > 0)) {
    return Figure(kCaption, OpenChart(f, kCaption, "time (s)", "tokens/s") + NoData(f), "");
  }
  const double bin_s = std::max(1.0, std::ceil(span / kMaxTimeBins));
  const int bins = std::max(1, static_cast<int>(std::ceil(span / bin_s)));
  std::vector<double> tokens(bins, 0);
  auto add = [&](double t, double n) { tokens[std::clamp(static_cast<int>((t - start) / bin_s), 0, bins - 1)] += n; };
  for (const RequestRecord& r : records) {
    if (!r.ok || r.output_tokens <= 0) continue;
    if (r.token_times_s.empty()) {
      add(r.done_s, static_cast<double>(r.output_tokens));
      continue;
    }
    const double per_chunk = static_cast<double>(r.output_tokens) / static_cast<double>(r.token_times_s.size());
    for (double t : r.token_times_s) add(t, per_chunk);
  }
  double peak = 0;
  for (double& t : tokens) peak = std::max(peak, t /= bin_s);
  f.x = NiceAxis(0, bins * bin_s);
  f.y = NiceAxis(0, peak);
  std::string svg = OpenChart(f, kCaption, "time since start (s)", "output tokens/s");
  for (int i = 0; i < bins; ++i) {
    if (tokens[i] <= 0) continue;
    const double x = f.Px(i * bin_s), w = f.Px((i + 1) * bin_s) - x, y = f.Py(tokens[i]);
    absl::StrAppendFormat(&svg,
                          "<rect class=\"bar\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\">"
                          "<title>%gs: %.1f tok/s</title></rect>\n",
                          x, y, std::max(w - (w > 3 ? 1 : 0), 0.5), f.Py(0) - y, i * bin_s, tokens[i]);
  }
  const double avg = s.output_throughput;
  if (avg > 0) {
    absl::StrAppendFormat(&svg,
                          "<line class=\"mean\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\">"
                          "<title>mean %.1f tok/s</title></line>\n",
                          f.Px(0), f.Py(avg), f.Px(bins * bin_s), f.Py(avg), avg);
  }
  return Figure(kCaption, svg,
                absl::StrFormat("Bins of %g s; the dashed line is the run's mean (%.1f tok/s).", bin_s, avg));
}

// E2E latency against send time, one dot per request (every k-th request
// when there are more than kMaxScatterPoints); failures in red at the time
// they took to fail.
std::string ScatterChart(const std::vector<RequestRecord>& records) {
  constexpr absl::string_view kCaption = "End-to-end latency by send time";
  Frame f;
  if (records.empty()) {
    return Figure(kCaption, OpenChart(f, kCaption, "send time (s)", "e2e latency (ms)") + NoData(f), "");
  }
  const size_t stride = (records.size() + kMaxScatterPoints - 1) / kMaxScatterPoints;
  double x_lo = records.front().sent_s, x_hi = x_lo, y_hi = 0;
  for (const RequestRecord& r : records) {
    x_lo = std::min(x_lo, r.sent_s);
    x_hi = std::max(x_hi, r.sent_s);
    y_hi = std::max(y_hi, (r.done_s - r.sent_s) * 1e3);
  }
  f.x = NiceAxis(std::min(x_lo, 0.0), x_hi);
  f.y = NiceAxis(0, y_hi);
  std::string svg = OpenChart(f, kCaption, "send time (s)", "e2e latency (ms)");
  for (size_t i = 0; i < records.size(); i += stride) {
    const RequestRecord& r = records[i];
    absl::StrAppendFormat(&svg, "<circle class=\"%s\" cx=\"%.1f\" cy=\"%.1f\" r=\"2\"/>\n", r.ok ? "ok" : "err",
                          f.Px(r.sent_s), f.Py((r.done_s - r.sent_s) * 1e3));
  }
  std::string note = "Red: failed requests.";
  if (stride > 1) {
    note = absl::StrFormat("One request in %d shown (of %d). %s", stride, records.size(), note);
  }
  return Figure(kCaption, svg, note);
}

constexpr absl::string_view kCss = R"(
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 1340px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.5em; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { padding: 3px 12px; border-bottom: 1px solid #ddd; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; } figcaption { font-weight: 600; margin-bottom: 4px; }
svg { background: #fff; border: 1px solid #ddd; max-width: 100%; height: auto; }
svg text { font-size: 11px; fill: #444; }
.axis { stroke: #666; } .grid { stroke: #eee; }
.bar { fill: #4c78a8; } .mean { stroke: #e45756; stroke-dasharray: 5 4; }
.ok { fill: #4c78a8; fill-opacity: 0.6; } .err { fill: #e45756; }
.note { color: #666; font-size: 12px; margin: 2px 0; }
pre { background: #f6f6f6; padding: 8px; white-space: pre-wrap; }
)";

}  // namespace

nlohmann::json DistributionJson(const Distribution& d) {
  auto v = [&d](double x) { return d.count > 0 ? nlohmann::json(x) : nlohmann::json(nullptr); };
  return {{"mean", v(d.mean)}, {"std", v(d.std)}, {"median", v(d.median)}, {"p90", v(d.p90)},
          {"p95", v(d.p95)},   {"p99", v(d.p99)}, {"count", d.count}};
}

Distribution Distribute(std::vector<double> samples) {
  Distribution d;
  if (samples.empty()) return d;
  std::sort(samples.begin(), samples.end());
  const double n = static_cast<double>(samples.size());
  double sum = 0;
  for (double v : samples) sum += v;
  d.mean = sum / n;
  double sq = 0;
  for (double v : samples) sq += (v - d.mean) * (v - d.mean);
  d.std = std::sqrt(sq / n);
  d.median = Percentile(samples, 50);
  d.p90 = Percentile(samples, 90);
  d.p95 = Percentile(samples, 95);
  d.p99 = Percentile(samples, 99);
  d.count = static_cast<int64_t>(samples.size());
  return d;
}

Summary Summarize(const std::vector<RequestRecord>& records, const Slo& slo) {
  Summary s;
  s.slo = slo;
  if (records.empty()) return s;
  double start = records.front().sent_s, end = records.front().done_s;
  int64_t good = 0;
  for (const RequestRecord& r : records) {
    start = std::min(start, r.sent_s);
    end = std::max(end, r.done_s);
    if (!r.ok) {
      ++s.failed;
      std::string error = r.error.empty() ? "(no error text)" : r.error;
      if (s.first_errors.size() < kMaxErrors &&
          std::find(s.first_errors.begin(), s.first_errors.end(), error) == s.first_errors.end()) {
        s.first_errors.push_back(std::move(error));
      }
      continue;
    }
    ++s.completed;
    s.total_input_tokens += r.prompt_tokens;
    s.total_output_tokens += r.output_tokens;
    s.total_cached_tokens += r.cached_tokens;
    if (HasSlo(slo) && MeetsSlo(LatenciesOf(r), slo)) ++good;
  }
  s.duration_s = std::max(0.0, end - start);
  if (s.duration_s > 0) {
    s.request_throughput = static_cast<double>(s.completed) / s.duration_s;
    s.input_throughput = static_cast<double>(s.total_input_tokens) / s.duration_s;
    s.output_throughput = static_cast<double>(s.total_output_tokens) / s.duration_s;
    s.goodput = static_cast<double>(good) / s.duration_s;
  }
  Samples samples = CollectSamples(records);
  s.ttft_ms = Distribute(std::move(samples.ttft_ms));
  s.tpot_ms = Distribute(std::move(samples.tpot_ms));
  s.itl_ms = Distribute(std::move(samples.itl_ms));
  s.e2e_ms = Distribute(std::move(samples.e2e_ms));
  return s;
}

std::string FormatText(const Summary& s, const std::string& title) {
  std::string out =
      Rule(title.empty() ? " Serving Benchmark Result " : absl::StrCat(" Serving Benchmark Result: ", title, " "), '=');
  for (const auto& [label, value] : SummaryRows(s)) out += Line(label, value);
  for (const Section& sec : Sections(s)) {
    out += Rule(sec.title, '-');
    const Distribution& d = *sec.d;
    for (const auto& [stat, v] : {std::pair<const char*, double>{"Mean", d.mean},
                                  {"Std", d.std},
                                  {"Median", d.median},
                                  {"P90", d.p90},
                                  {"P95", d.p95},
                                  {"P99", d.p99}}) {
      out += Line(absl::StrFormat("%s %s (ms):", stat, sec.name), Stat(d, v));
    }
  }
  if (s.failed > 0 && !s.first_errors.empty()) {
    out += Rule("First Errors", '-');
    for (const std::string& e : s.first_errors) absl::StrAppend(&out, OneLine(e), "\n");
  }
  out += std::string(kTextWidth, '=') + "\n";
  return out;
}

nlohmann::json ToJson(const Summary& s) {
  nlohmann::json j = {
      {"completed", s.completed},
      {"failed", s.failed},
      {"duration_s", s.duration_s},
      {"total_input_tokens", s.total_input_tokens},
      {"total_output_tokens", s.total_output_tokens},
      {"total_cached_tokens", s.total_cached_tokens},
      {"request_throughput", s.request_throughput},
      {"input_throughput", s.input_throughput},
      {"output_throughput", s.output_throughput},
      {"client_overhead_us_per_request", s.client_overhead_us_per_request},
      {"ttft_ms", DistributionJson(s.ttft_ms)},
      {"tpot_ms", DistributionJson(s.tpot_ms)},
      {"itl_ms", DistributionJson(s.itl_ms)},
      {"e2e_ms", DistributionJson(s.e2e_ms)},
      {"first_errors", s.first_errors},
  };
  if (s.router_prefix_hit_rate) j["router_prefix_hit_rate"] = *s.router_prefix_hit_rate;
  if (!s.run.empty()) {
    nlohmann::json run = nlohmann::json::object();
    for (const auto& [label, value] : s.run) run[label] = value;
    j["run"] = std::move(run);
  }
  if (HasSlo(s.slo)) {
    j["goodput"] = s.goodput;
    nlohmann::json slo = nlohmann::json::object();
    if (s.slo.ttft_ms) slo["ttft_ms"] = *s.slo.ttft_ms;
    if (s.slo.tpot_ms) slo["tpot_ms"] = *s.slo.tpot_ms;
    if (s.slo.e2e_ms) slo["e2e_ms"] = *s.slo.e2e_ms;
    j["slo"] = std::move(slo);
  }
  return j;
}

nlohmann::json RequestsJson(const std::vector<RequestRecord>& records) {
  std::vector<const RequestRecord*> order;
  for (const RequestRecord& r : records) order.push_back(&r);
  std::stable_sort(order.begin(), order.end(),
                   [](const RequestRecord* a, const RequestRecord* b) { return a->sent_s < b->sent_s; });
  nlohmann::json out = nlohmann::json::array();
  for (const RequestRecord* r : order) {
    const Latencies l = LatenciesOf(*r);
    nlohmann::json j = {
        {"ok", r->ok},
        {"sent_s", r->sent_s},
        {"session", r->session},
        {"turn", r->turn},
        {"ttft_ms", l.ttft_ms ? nlohmann::json(*l.ttft_ms) : nlohmann::json(nullptr)},
        {"e2e_ms", l.e2e_ms},
        {"tpot_ms", l.tpot_ms ? nlohmann::json(*l.tpot_ms) : nlohmann::json(nullptr)},
        {"prompt_tokens", r->prompt_tokens},
        {"output_tokens", r->output_tokens},
        {"cached_tokens", r->cached_tokens},
        {"itl_ms", ItlGapsMs(*r)},
    };
    if (!r->worker.empty()) j["worker"] = r->worker;
    if (!r->ok) j["error"] = r->error;
    out.push_back(std::move(j));
  }
  return out;
}

std::string RenderHtml(const Summary& s, const std::vector<RequestRecord>& records, const std::string& title) {
  const std::string heading = title.empty() ? "Serving Benchmark Result" : title;
  std::string html = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>",
      Escape(heading), "</title>\n<style>", kCss, "</style>\n</head>\n<body>\n<h1>", Escape(heading), "</h1>\n");

  if (!s.run.empty()) {
    html += "<h2>Run</h2>\n<table>\n";
    for (const auto& [label, value] : s.run) {
      absl::StrAppend(&html, "<tr><td>", Escape(label), "</td><td><code>", Escape(value), "</code></td></tr>\n");
    }
    html += "</table>\n";
  }
  html += "<h2>Summary</h2>\n<table>\n";
  for (const auto& [label, value] : SummaryRows(s)) {
    absl::StrAppend(&html, "<tr><td>", Escape(label.substr(0, label.size() - 1)), "</td><td>", Escape(value),
                    "</td></tr>\n");
  }
  html +=
      "</table>\n<h2>Latency (ms)</h2>\n<table>\n<tr><th>metric</th><th>mean</th><th>std</th>"
      "<th>median</th><th>P90</th><th>P95</th><th>P99</th><th>samples</th></tr>\n";
  for (const Section& sec : Sections(s)) {
    const Distribution& d = *sec.d;
    absl::StrAppendFormat(&html,
                          "<tr><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td>"
                          "<td>%s</td><td>%s</td><td>%d</td></tr>\n",
                          Escape(sec.title), Stat(d, d.mean), Stat(d, d.std), Stat(d, d.median), Stat(d, d.p90),
                          Stat(d, d.p95), Stat(d, d.p99), d.count);
  }
  html += "</table>\n";

  Samples samples = CollectSamples(records);
  html += "<h2>Charts</h2>\n<div class=\"charts\">\n";
  html += Histogram("Time to first token", "TTFT (ms)", std::move(samples.ttft_ms));
  html += Histogram("Inter-token latency", "ITL (ms)", std::move(samples.itl_ms));
  html += ThroughputChart(s, records);
  html += ScatterChart(records);
  html += "</div>\n";

  if (!s.first_errors.empty()) {
    html += "<h2>First errors</h2>\n";
    for (const std::string& e : s.first_errors) absl::StrAppend(&html, "<pre>", Escape(OneLine(e)), "</pre>\n");
  }
  html += "</body>\n</html>\n";
  return html;
}

}  // namespace tandem::bench
