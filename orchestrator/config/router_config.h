// RouterConfig: everything `tandem router` reads from its one YAML file, as
// one typed struct with in-line defaults and a comment per field (leveldb's
// Options). The YAML keys mirror the field names; router.example.yaml beside
// this header documents every key.
//
// Contract: LoadRouterConfig / ParseRouterConfig return a config that has
// passed ValidateRouterConfig, or InvalidArgument whose message reads
// "FILE:LINE:COL: key.path: why" (1-based line and column) for YAML syntax
// errors, unknown or duplicate keys (with a "did you mean" when a known key
// is close), wrong types and invalid values. Routing policies are validated
// by creating them through RegisterBuiltinRoutingPolicies, so a bad policy
// name or parameter fails here, at load time, not at the first request.
// Nothing here touches the network: DNS names are checked for syntax only,
// and tokenizer / chat-template paths are not opened.
//
// Thread safety: the functions are pure and may be called concurrently.
// A RouterConfig is a plain value; reloads (SIGHUP) build a new one and swap
// it in as a whole, keeping the old one when the new file fails to load.
#ifndef TANDEM_ORCHESTRATOR_CONFIG_ROUTER_CONFIG_H_
#define TANDEM_ORCHESTRATOR_CONFIG_ROUTER_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "orchestrator/routing/routing_policy.h"

namespace tandem::router {

// Where the router accepts HTTP (OpenAI-compatible) requests.
struct ListenerConfig {
  // Address to bind: an IPv4/IPv6 literal or a host name. "0.0.0.0" (or
  // "::") listens on every interface, as in a container. Default: 127.0.0.1,
  // or $TANDEM_HOST where it is set.
  std::string host = "127.0.0.1";
  // TCP port, 0..65535; 0: the OS picks a free one (`tandem router --ready-file`
  // reports it).
  int port = 8000;

  friend bool operator==(const ListenerConfig&, const ListenerConfig&) = default;
};

// The one model this router serves.
struct ModelConfig {
  // The name clients send in the request's "model" field and see in
  // /v1/models. Non-empty.
  std::string served_name = "tandem";
  // Path to a tokenizer.json, or "builtin" for the tokenizer compiled into
  // the binary ("builtin:NAME": the one of built-in model NAME, e.g.
  // builtin:llama-3.1-8b, padded to its vocabulary). The router tokenizes
  // prompts to route on prefixes.
  std::string tokenizer = "builtin";
  // Path to a chat template that overrides the model's own; empty: use the
  // model's.
  std::string chat_template;
  // false (default): text in a chat message (content, name, tool_call_id)
  // or a chat_template_kwargs string that spells a special token, such as
  // "<|eot_id|>", is tokenized as plain text (OpenAI's semantics), so a user
  // cannot forge roles or end a turn; the template's own special tokens
  // still count. true: such text becomes the control token, as Hugging
  // Face's apply_chat_template + encode does.
  bool parse_special_tokens_in_messages = false;

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// A pool's workers found through DNS: `dns` is resolved every `interval_s`
// to all its A/AAAA records, as a Kubernetes headless Service exposes its
// pods; each address with `port` is one worker.
struct DnsDiscoveryConfig {
  // The name to resolve, e.g. "tandem-decode.default.svc.cluster.local".
  std::string dns;
  // The workers' gRPC port, 1..65535. Required.
  int port = 0;
  // Seconds between resolutions, in [1, 3600]. Pods that vanish from DNS
  // leave the pool within one interval.
  double interval_s = 10.0;

  friend bool operator==(const DnsDiscoveryConfig&, const DnsDiscoveryConfig&) = default;
};

// Which routing policy picks a worker within a pool, by registry name.
struct PolicyConfig {
  // One of round_robin, random, least_request, power_of_two, prefix_aware,
  // sticky_session, kv_cache_aware.
  std::string name = "least_request";
  // Policy-specific parameters as strings; each policy rejects names it does
  // not know and values it cannot parse (see orchestrator/routing/*.h).
  PolicyParams params;

  friend bool operator==(const PolicyConfig&, const PolicyConfig&) = default;
};

// A set of workers of one role and the policy that chooses among them.
// Exactly one of `workers` and `discovery` is set.
struct PoolConfig {
  // Static worker list, "host:port" each ("[v6addr]:port" for IPv6); no
  // duplicates.
  std::vector<std::string> workers;
  // DNS discovery instead of a static list.
  std::optional<DnsDiscoveryConfig> discovery;
  // How a worker is picked among the pool's healthy ones.
  PolicyConfig policy;

  friend bool operator==(const PoolConfig&, const PoolConfig&) = default;
};

// Whether prefill and decode run on different workers.
enum class DisaggregationMode {
  kNever,   // "never": each request runs whole on one decode-pool worker
            // (workers of role "both"); no prefill pool needed.
  kAlways,  // "always": prefill on the prefill pool, KV shipped to decode.
  kAuto,    // "auto": prefill on the decode worker itself when the uncached
            // part of the prompt is shorter than auto_threshold_tokens.
};

// "never", "always" or "auto".
std::string_view DisaggregationModeName(DisaggregationMode mode);
// The mode DisaggregationModeName names; nullopt for any other text.
std::optional<DisaggregationMode> ParseDisaggregationMode(std::string_view name);

struct DisaggregationConfig {
  DisaggregationMode mode = DisaggregationMode::kAuto;
  // Mode auto: prompts with fewer uncached tokens than this are prefilled on
  // the decode worker. In [1, 1048576]. 512: below a few hundred tokens a
  // local prefill takes about as long as the prefill-worker round trip plus
  // the KV transfer, and it adds little to the decode batch's step time;
  // tune per model and network.
  int64_t auto_threshold_tokens = 512;

  friend bool operator==(const DisaggregationConfig&, const DisaggregationConfig&) = default;
};

// Deadlines, in seconds, each in (0, 86400].
struct TimeoutsConfig {
  // From accepting the request to the first token (queueing and prefill
  // included); past it the request fails with DeadlineExceeded (504).
  double first_token_s = 60.0;
  // Longest gap between two streamed tokens before the stream is cut.
  double idle_stream_s = 30.0;
  // Whole request, first byte in to last byte out. >= first_token_s.
  double request_s = 600.0;

  friend bool operator==(const TimeoutsConfig&, const TimeoutsConfig&) = default;
};

// A per-attempt deadline: fixed seconds, or `auto` (the multiplier times the
// observed p99, at least the floor). 0 seconds turns it off.
struct AttemptDeadlineConfig {
  bool automatic = true;  // YAML `auto`
  double seconds = 0;     // when not automatic, in [0, 86400]

  friend bool operator==(const AttemptDeadlineConfig&, const AttemptDeadlineConfig&) = default;
};

// Retries of a request that failed before its first token was sent (a
// worker that is unreachable, overloaded, frozen or dies mid-prefill), and
// failover of one that fails after it (the generation resumes on another
// decode worker from the prompt plus the tokens already sent).
struct RetriesConfig {
  // Attempts per request including the first, in [1, 10]; 1 disables retry.
  int max_attempts = 3;
  // Retries across all requests may be at most this fraction of requests
  // (a retry budget, so a sick cluster is not hit with max_attempts times
  // its load). In [0, 1]; 0 disables retry. Failovers do not draw on it.
  double budget_ratio = 0.2;
  // An attempt with no token this long after it started is cancelled and
  // placed on another worker (its worker is ejected as suspect), when
  // another healthy one exists. `auto`: auto_multiplier times the p99 of
  // recent attempts' first-token latency, at least auto_floor_s; until 20
  // attempts were seen, off.
  AttemptDeadlineConfig attempt_first_token;
  // Mid-stream: no token from the attempt for this long fails it over as
  // if its worker had died. `auto`: auto_multiplier times the p99 of recent
  // gaps between token messages, at least auto_floor_s; off until 20 gaps.
  AttemptDeadlineConfig attempt_idle;
  // `auto` deadlines: the multiple of the observed p99, in [1, 1000].
  double auto_multiplier = 5.0;
  // `auto` deadlines are never shorter than this, in (0, 3600] seconds.
  double auto_floor_s = 2.0;
  // Mid-stream failovers per choice, in [0, 10]; 0: a worker that fails
  // after the first token fails the stream (an error event).
  int max_failovers = 3;
  // A request that finds no healthy worker to go to (a pool restarting, a
  // pod rediscovered but not yet passed its health checks, a pool scaling
  // up) waits up to this long for one, placed as soon as one is healthy,
  // before it fails with 503. In [0, 3600] seconds; 0 fails at once. The
  // wait counts toward the request's timeouts.
  double wait_for_worker_s = 0;

  friend bool operator==(const RetriesConfig&, const RetriesConfig&) = default;
};

// Admission limits; beyond them requests are refused, never stalled.
struct LimitsConfig {
  // Largest request body, in bytes, in [1024, 1073741824]; larger: 400.
  int64_t max_body_bytes = int64_t{8} << 20;
  // Requests waiting for a worker slot, in [0, 1048576]; beyond: 429.
  int64_t max_queue = 1024;
  // Sequences the router has on workers at once, in [1, 1048576]: each
  // choice of a request's `n` is one sequence, so a request with n = 8
  // takes 8. A request whose n exceeds it is refused (400, param "n").
  int64_t max_in_flight = 256;
  // Client connections open at once, in [1, 1048576]; a connection beyond
  // it is answered 503 (Retry-After: 1) and closed.
  int64_t max_connections = 4096;

  friend bool operator==(const LimitsConfig&, const LimitsConfig&) = default;
};

// Limits of one API key; 0 means no limit.
struct KeyLimitsConfig {
  // Requests per second, in [0, 1000000]: a token bucket refilled at this
  // rate that holds one second's worth (at least one request).
  double requests_per_s = 0;
  // Tokens per minute, in [0, 10^12]: a bucket of this many tokens refilled
  // over a minute. A request is charged its prompt tokens plus n x max_tokens
  // (max_tokens absent: the context left after the prompt), at most a full
  // bucket, when admitted; when it ends the charge is settled to what it
  // used (prompt + generated tokens): the unused part returns, an excess is
  // taken (the bucket may go below zero and refuse until it refills).
  int64_t tokens_per_min = 0;
  // Requests of the key admitted at once (queued or running), in
  // [0, 1048576].
  int64_t max_concurrent = 0;

  friend bool operator==(const KeyLimitsConfig&, const KeyLimitsConfig&) = default;
};

// One API key. The key itself is never kept: only its SHA-256 digest.
struct ApiKeyConfig {
  // Names the key in metrics and logs (never the key): 1 to 64 characters
  // of [A-Za-z0-9_.-], unique.
  std::string name;
  // The key's SHA-256 digest, 64 lowercase hex digits (the YAML may write
  // "sha256:<hex>"). Keys read from auth.keys_file are hashed at load.
  std::string sha256;
  // Admin keys also reach /metrics, /tokenize and /detokenize, and see
  // worker details (addresses in headers and error messages).
  bool admin = false;
  // The key's weight in the admission queue, in [1, 100]: queued keys are
  // served in proportion to it (weighted fair queueing).
  int priority = 1;
  // Overrides of auth.limits_per_key for this key; unset: the default.
  std::optional<double> requests_per_s;
  std::optional<int64_t> tokens_per_min;
  std::optional<int64_t> max_concurrent;

  // The default limits with this key's overrides applied.
  KeyLimitsConfig Limits(const KeyLimitsConfig& defaults) const;

  friend bool operator==(const ApiKeyConfig&, const ApiKeyConfig&) = default;
};

// API keys on the HTTP front: with at least one key, every endpoint but
// /health needs `Authorization: Bearer KEY` (401 otherwise), and the admin
// endpoints an admin key (403 otherwise). With none the router is open.
struct AuthConfig {
  // Keys given by digest in the YAML, then those read from keys_file.
  std::vector<ApiKeyConfig> keys;
  // A file of plain keys, read at load and at each reload: one per line,
  // "NAME KEY" or "NAME KEY admin" ('#' starts a comment line). A keys entry
  // with that name and no sha256 sets the key's priority and limits. The
  // file must hold at least one key. Empty: none.
  std::string keys_file;
  // Limits of every key unless its entry overrides them.
  KeyLimitsConfig limits_per_key;

  bool enabled() const { return !keys.empty(); }

  friend bool operator==(const AuthConfig&, const AuthConfig&) = default;
};

// What the router reveals about its workers.
struct DebugConfig {
  // Show worker addresses to every client: the x-tandem-prefill-worker and
  // x-tandem-decode-worker response headers and addresses in error
  // messages. Off: only admin keys see them; other clients get neutral
  // texts. For test and benchmark clusters.
  bool worker_details = false;

  friend bool operator==(const DebugConfig&, const DebugConfig&) = default;
};

// Active health checks of every worker in every pool.
struct HealthConfig {
  // Seconds between checks of one worker, in [0.1, 3600].
  double interval_s = 5.0;
  // Seconds a check may take before it counts as a failure, in
  // (0, interval_s].
  double timeout_s = 2.0;
  // Consecutive failures that eject a healthy worker, in [1, 100].
  int unhealthy_after = 3;
  // Consecutive successes that restore an ejected worker, in [1, 100].
  int healthy_after = 2;

  friend bool operator==(const HealthConfig&, const HealthConfig&) = default;
};

// The workers' KV-cache event streams (blocks stored / evicted), which feed
// the router's index for kv_cache_aware routing and tell the router at once
// that a worker drains.
struct KvEventsConfig {
  // Subscribe to every healthy worker's stream (with its events where a
  // policy keeps an index). false: no streams; kv_cache_aware then learns
  // from its own decisions (approximate), and a draining worker is ejected
  // by its next health check.
  bool enabled = true;

  friend bool operator==(const KvEventsConfig&, const KvEventsConfig&) = default;
};

// Session affinity for the sticky_session policy.
struct SessionsConfig {
  // HTTP request header whose value is the session id; an HTTP token
  // (RFC 9110 field-name characters), matched case-insensitively.
  std::string header = "X-Session-ID";

  friend bool operator==(const SessionsConfig&, const SessionsConfig&) = default;
};

// How the router and its workers authenticate each other
// (docs/architecture.md, "Security"). Required, so that plain TCP is only
// ever chosen by name.
enum class TlsMode {
  kUnset,     // no tls section: refused at load
  kMutual,    // "mutual": mTLS under the cluster CA (ca, cert, key required)
  kInsecure,  // "insecure": plain TCP, no authentication either way; a
              // WARNING at start (tests, a single trusted host)
};
struct TlsConfig {
  // "mutual" or "insecure"; omitted with ca/cert/key given: mutual.
  TlsMode mode = TlsMode::kUnset;
  // Mutual: PEM paths of the cluster CA's certificate, the router's
  // certificate (router role: DNS SAN tandem-router; `tandem certs` makes
  // one) and its key. Read at start (a bad file fails it, naming the key);
  // fixed until restart, like the listener.
  std::string ca;
  std::string cert;
  std::string key;

  friend bool operator==(const TlsConfig&, const TlsConfig&) = default;
};

struct RouterConfig {
  ListenerConfig listener;
  ModelConfig model;
  // Pools by role. `decode` is required; `prefill` is required unless
  // disaggregation.mode is never, and must be absent when it is never.
  std::optional<PoolConfig> prefill;
  std::optional<PoolConfig> decode;
  DisaggregationConfig disaggregation;
  TimeoutsConfig timeouts;
  RetriesConfig retries;
  LimitsConfig limits;
  HealthConfig health;
  KvEventsConfig kv_events;
  SessionsConfig sessions;
  TlsConfig tls;
  AuthConfig auth;
  DebugConfig debug;

  friend bool operator==(const RouterConfig&, const RouterConfig&) = default;
};

// Checks every field's range and the rules between fields (see each field's
// comment). InvalidArgument "key.path: why" on the first violation; for a
// config built in code rather than read from YAML.
absl::Status ValidateRouterConfig(const RouterConfig& config);

// Parses and validates YAML text. `name_for_errors` (usually the file path)
// starts every error message.
absl::StatusOr<RouterConfig> ParseRouterConfig(std::string_view yaml, const std::string& name_for_errors);

// YAML text that ParseRouterConfig reads back as `config` (every field
// written, strings quoted and escaped by yaml-cpp's emitter; keys by their
// digests). auth.keys_file is not written: the keys it gave are in
// auth.keys already, so the text stands alone. `tandem up` writes its
// router's file with it.
std::string SerializeRouterConfig(const RouterConfig& config);

// Reads `path` and parses it as above. NotFound naming the path when the file
// does not exist; InvalidArgument when it cannot be read or is invalid.
absl::StatusOr<RouterConfig> LoadRouterConfig(const std::string& path);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_CONFIG_ROUTER_CONFIG_H_
