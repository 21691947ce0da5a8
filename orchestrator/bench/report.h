// Results of a serving benchmark (`tandem bench --url`): per-request records
// in, the summary users compare systems by out, as text, JSON and a
// self-contained HTML page.
//
// Definitions follow vLLM's benchmark_serving.py and `max benchmark`:
//   TTFT  request sent -> first content token received;
//   TPOT  (e2e - ttft) / (output_tokens - 1), per request with >= 2 tokens
//         (the first token excluded);
//   ITL   every gap between consecutive token-bearing chunks of a stream,
//         pooled over all requests (a chunk carrying k tokens contributes
//         one gap);
//   E2E   request sent -> last byte received.
// Percentiles use linear interpolation between closest ranks (numpy's
// default), std is the population standard deviation; a metric with no
// samples reports zeros. Throughputs divide by the benchmark's duration
// (first request sent -> last response finished). Goodput counts requests
// that succeeded and met every SLO given, per second.
//
// Thread safety: plain functions over values.
#ifndef TANDEM_ORCHESTRATOR_BENCH_REPORT_H_
#define TANDEM_ORCHESTRATOR_BENCH_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace tandem::bench {

// One request as the client saw it. Times are seconds since the benchmark's
// start (the first request sent), so records can be laid on a timeline.
struct RequestRecord {
  bool ok = false;
  std::string error;                  // why it failed (HTTP status and message), when !ok
  double sent_s = 0;                  // when the request was sent
  double first_token_s = -1;          // when the first token arrived; < 0: none
  double done_s = 0;                  // when the response ended (or failed)
  std::vector<double> token_times_s;  // arrival time of each token-bearing chunk, in order
  int64_t prompt_tokens = 0;          // from the response's usage (or the dataset when absent)
  int64_t output_tokens = 0;          // from usage (or counted chunks when absent)
  int64_t cached_tokens = 0;          // usage.prompt_tokens_details.cached_tokens, when reported
  int64_t session = 0;                // the dataset's session index (one per request but multi-turn)
  int turn = 0;                       // the turn within its session, from 0
  std::string worker;                 // the worker that decoded it, when the server says (tandem)
};

// Service-level objectives for goodput, in milliseconds; unset: not checked.
struct Slo {
  std::optional<double> ttft_ms;
  std::optional<double> tpot_ms;
  std::optional<double> e2e_ms;
};

struct Distribution {
  double mean = 0, std = 0, median = 0, p90 = 0, p95 = 0, p99 = 0;
  int64_t count = 0;
};

// Distribution of `samples` (any order).
Distribution Distribute(std::vector<double> samples);

// {mean, std, median, p90, p95, p99, count}: a distribution as the JSON
// report writes it.
nlohmann::json DistributionJson(const Distribution& d);

struct Summary {
  int64_t completed = 0;
  int64_t failed = 0;
  double duration_s = 0;
  int64_t total_input_tokens = 0;
  int64_t total_output_tokens = 0;
  int64_t total_cached_tokens = 0;  // from usage, where reported
  double request_throughput = 0;    // completed requests / s
  double input_throughput = 0;      // input tokens of completed requests / s
  double output_throughput = 0;     // output tokens / s
  double goodput = 0;               // requests / s that met every SLO (0 if no SLO)
  Slo slo;
  Distribution ttft_ms, tpot_ms, itl_ms, e2e_ms;
  // Filled by the caller (not by Summarize) when known:
  std::optional<double> router_prefix_hit_rate;  // from /metrics deltas, in [0, 1]
  double client_overhead_us_per_request = 0;     // the client's own CPU time per request
  std::vector<std::string> first_errors;         // up to a few distinct error texts
  // What was run, for the reports (command, URL, model, dataset and its
  // parameters, rate, date): label, value.
  std::vector<std::pair<std::string, std::string>> run;
};

// The summary of `records`; duration from the earliest sent_s to the latest
// done_s over all records (0 requests: zeros). Latencies, ITL gaps and token
// totals come from successful requests only; failures are counted, and their
// first few distinct errors kept. For goodput, a request with < 2 output
// tokens passes the TPOT SLO, and one with no token at all is held to the
// TTFT SLO by its e2e latency.
Summary Summarize(const std::vector<RequestRecord>& records, const Slo& slo);

// A fixed-width text report like `max benchmark`'s ("============ Serving
// Benchmark Result ============", one "label: value" line each, sections for
// TTFT, TPOT, ITL and E2E with mean/std/median/P90/P95/P99).
std::string FormatText(const Summary& s, const std::string& title);

// JSON with at least: completed, failed, duration_s, request_throughput,
// input_throughput, output_throughput, goodput, total_input_tokens,
// total_output_tokens, and ttft_ms, tpot_ms, itl_ms, e2e_ms each an object
// with mean, std, median, p90, p95, p99 (and count); also
// total_cached_tokens, client_overhead_us_per_request and first_errors;
// router_prefix_hit_rate when known; slo (its set fields) when any is given.
nlohmann::json ToJson(const Summary& s);

// Per request, in send order, for `--save-detailed` (vLLM's flag): an array
// of objects with ok, sent_s, session, turn, ttft_ms (null without a first
// token), e2e_ms, tpot_ms (null under 2 tokens), prompt_tokens,
// output_tokens, cached_tokens, itl_ms (the gaps between its token-bearing
// chunks), worker (when the server named it: tandem's x-tandem-decode-worker)
// and error (when !ok).
nlohmann::json RequestsJson(const std::vector<RequestRecord>& records);

// A self-contained HTML page (no external assets, no scripts required):
// the summary table, and inline SVG charts: TTFT histogram, ITL histogram,
// output-token throughput over time (1 s bins, or coarser for long runs),
// and request latency (e2e) over send time as a scatter.
std::string RenderHtml(const Summary& s, const std::vector<RequestRecord>& records, const std::string& title);

}  // namespace tandem::bench

#endif  // TANDEM_ORCHESTRATOR_BENCH_REPORT_H_
