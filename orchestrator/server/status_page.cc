#include "orchestrator/server/status_page.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/html.h"

namespace tandem::router {
namespace {

template <typename T>
std::string Or(const std::optional<T>& v, const char* none = "-") {
  return v.has_value() ? absl::StrCat(*v) : none;
}

constexpr char kCss[] =
    "body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}h1{font-size:1.4em}"
    "h2{font-size:1.1em;margin-top:1.6em}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}th{background:#f3f3f3}"
    ".ok{color:#176117}.bad{color:#a11}code{font-size:.95em}.meta td{border:none;padding:.1em .6em}";

}  // namespace

void RecentDecisions::Add(RecentDecision d) {
  std::lock_guard<std::mutex> lock(mu_);
  decisions_.push_front(std::move(d));
  while (decisions_.size() > capacity_) decisions_.pop_back();
}

std::vector<RecentDecision> RecentDecisions::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {decisions_.begin(), decisions_.end()};
}

std::string RenderStatusPage(const StatusSnapshot& s) {
  std::string html = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta http-equiv=\"refresh\" content=\"5\">\n<title>tandem router: ",
      HtmlEscape(s.model), "</title>\n<style>", kCss,
      "</style>\n</head>\n<body>\n<h1>tandem router: ", HtmlEscape(s.model), "</h1>\n<table class=\"meta\">\n");
  struct Row {
    const char* id;
    const char* label;
    std::string value;
  };
  for (const Row& r :
       {Row{"tokenizer", "tokenizer", s.tokenizer}, Row{"disaggregation", "disaggregation", s.disaggregation},
        Row{"uptime", "uptime", absl::FormatDuration(absl::Seconds(s.uptime_s))},
        Row{"in-flight", "requests in flight", absl::StrCat(s.in_flight)},
        Row{"queued", "requests queued", absl::StrCat(s.queued)}}) {
    absl::StrAppend(&html, "<tr><td>", r.label, "</td><td id=\"", r.id, "\">", HtmlEscape(r.value), "</td></tr>\n");
  }
  html += "</table>\n";
  for (const StatusSnapshot::Pool& p : s.pools) {
    int healthy = 0;
    for (const auto& w : p.workers) healthy += w.healthy ? 1 : 0;
    absl::StrAppend(&html, "<h2>", HtmlEscape(p.name), " pool: ", healthy, " of ", p.workers.size(),
                    " workers healthy</h2>\n<p>policy <code class=\"policy\">", HtmlEscape(p.policy), "</code>");
    for (const auto& [k, v] : p.params) absl::StrAppend(&html, " ", HtmlEscape(k), "=<code>", HtmlEscape(v), "</code>");
    if (p.index_blocks.has_value()) absl::StrAppend(&html, "; KV index: ", *p.index_blocks, " entries");
    absl::StrAppend(&html, "</p>\n<table class=\"workers\" data-pool=\"", HtmlEscape(p.name),
                    "\">\n<tr><th>worker</th><th>state</th><th>in flight</th><th>running</th>"
                    "<th>waiting</th><th>KV used / total</th><th>KV cached</th>"
                    "<th>prefix hit rate</th></tr>\n");
    for (const StatusSnapshot::Worker& w : p.workers) {
      const std::string state = !w.incompatible.empty() ? absl::StrCat("refused: ", w.incompatible)
                                : w.healthy             ? "healthy"
                                                        : "unhealthy";
      absl::StrAppend(&html, "<tr><td class=\"address\">", HtmlEscape(w.address), "</td><td class=\"state ",
                      w.healthy ? "ok" : "bad", "\">", HtmlEscape(state), "</td><td>", w.in_flight, "</td><td>",
                      Or(w.running), "</td><td>", Or(w.waiting), "</td><td>", Or(w.used_blocks), " / ",
                      Or(w.total_blocks), "</td><td>", Or(w.cached_blocks), "</td><td>",
                      w.prefix_hit_rate.has_value() ? absl::StrFormat("%.1f%%", *w.prefix_hit_rate * 100) : "-",
                      "</td></tr>\n");
    }
    html += "</table>\n";
  }
  absl::StrAppend(&html,
                  "<h2>Recent routing decisions</h2>\n<table class=\"recent\">\n"
                  "<tr><th>time (UTC)</th><th>request</th><th>prompt tokens</th>"
                  "<th>expected cached</th><th>prefill</th><th>decode</th></tr>\n");
  for (const RecentDecision& d : s.recent) {
    absl::StrAppend(
        &html, "<tr><td>", absl::FormatTime("%H:%M:%E3S", absl::FromUnixMillis(d.unix_ms), absl::UTCTimeZone()),
        "</td><td>", HtmlEscape(d.request_id), "</td><td>", d.prompt_tokens, "</td><td>", d.expected_cached_tokens,
        "</td><td class=\"prefill\">", d.prefill_worker.empty() ? "(on decode)" : HtmlEscape(d.prefill_worker),
        "</td><td class=\"decode\">", HtmlEscape(d.decode_worker), "</td></tr>\n");
  }
  if (s.recent.empty()) html += "<tr><td colspan=\"6\">none yet</td></tr>\n";
  html +=
      "</table>\n<p>Per request, with <code>x-tandem-explain: 1</code>: why (the response's "
      "<code>x-tandem-route</code>). Metrics: <code>/metrics</code>.</p>\n</body>\n</html>\n";
  return html;
}

}  // namespace tandem::router
