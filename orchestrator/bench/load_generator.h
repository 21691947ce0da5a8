// The load generator of `tandem bench --url`: sends a workload's sessions
// to an OpenAI-compatible server as streaming requests and records what the
// client saw of each (RequestRecord).
//
// One thread runs every connection (Boost.Asio coroutines over Beast), so
// thousands of concurrent streams cost one core at most; the caller reports
// the client's own CPU time per request. Connections are kept alive and
// reused (as aiohttp's pool does for vLLM's benchmark): a request takes an
// idle one or opens one, so there are at most as many as requests in flight;
// a reused connection the server closed meanwhile is retried once on a new
// one. With keep_alive = false every request opens its own.
//
// Sessions start by a Poisson process of `request_rate` per second (gamma
// intervals with shape `burstiness`, as vLLM's benchmark: 1 is Poisson,
// lower is burstier), all at once for an infinite rate, or at their own
// arrival_s (trace replay). A session's turns go one after another, each
// turn sent when the previous one's response has ended, carrying the whole
// history (system prompt, earlier user turns and the server's own answers)
// and the session id in `session_header`. At most `max_concurrency` requests
// are in flight (0: no limit); the rest wait in arrival order.
//
// Requests: completions send the prompt as token ids (exact lengths) unless
// `prompt_as_text`; chat sends the decoded text as messages. Every request
// streams with usage (stream_options.include_usage), temperature 0, and
// ignore_eos when asked (so outputs have the asked length).
#ifndef TANDEM_ORCHESTRATOR_BENCH_LOAD_GENERATOR_H_
#define TANDEM_ORCHESTRATOR_BENCH_LOAD_GENERATOR_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "orchestrator/bench/datasets.h"
#include "orchestrator/bench/report.h"
#include "orchestrator/tokenizer/tokenizer.h"

namespace tandem::bench {

using router::Tokenizer;

struct LoadOptions {
  std::string url;                       // http://host:port
  std::string endpoint = "completions";  // completions | chat
  std::string model;                     // empty: the first of GET /v1/models
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1.0;
  int max_concurrency = 0;
  int num_warmups = 0;  // requests sent (and awaited) first, not recorded
  uint64_t seed = 0;
  std::string session_header = "X-Session-ID";
  bool ignore_eos = true;
  bool prompt_as_text = false;  // completions: send text instead of ids
  bool keep_alive = true;       // reuse connections between requests
  std::chrono::seconds request_timeout{600};
  // Called on the client thread after each recorded request ends.
  std::function<void(int done, int total)> progress;
};

// "http://host:port" split; InvalidArgument for anything else (https is not
// supported).
struct Endpoint {
  std::string host;
  std::string port;
};
absl::StatusOr<Endpoint> ParseUrl(const std::string& url);

// One GET; the status and body (status 0 and the error in `body` when the
// connection failed).
struct SimpleResponse {
  int status = 0;
  std::string body;
};
SimpleResponse HttpGetOnce(const Endpoint& ep, const std::string& target,
                           std::chrono::seconds timeout = std::chrono::seconds(30));

// Counter values from a Prometheus text page, by series name without labels
// (the sum over label sets).
std::map<std::string, double> ParseCounters(const std::string& metrics_text);

// The model to send: options.model, or the first that GET /v1/models lists
// (Unavailable naming the URL when the server does not answer with one).
absl::StatusOr<std::string> ResolveModel(const LoadOptions& options);

// Runs the workload; one record per turn, in session order. Fails only if
// the server cannot be reached at all or `options` are invalid; failed
// requests are records with ok = false.
absl::StatusOr<std::vector<RequestRecord>> RunLoad(const LoadOptions& options, const std::vector<Session>& sessions,
                                                   const Tokenizer& tokenizer);

}  // namespace tandem::bench

#endif  // TANDEM_ORCHESTRATOR_BENCH_LOAD_GENERATOR_H_
