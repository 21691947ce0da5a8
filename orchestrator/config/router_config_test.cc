#include "orchestrator/config/router_config.h"

#include <fstream>
#include <string>

#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::router {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// The smallest valid config: one decode pool, no disaggregation.
constexpr char kMinimal[] = R"(
disaggregation: {mode: never}
pools:
  decode:
    workers: [decode-0:50051]
)";

// The tests below are about other sections: a config without a tls section
// gets `tls: {mode: insecure}` (a file must choose; see the Tls tests).
absl::StatusOr<RouterConfig> Parse(const std::string& yaml) {
  if (yaml.find("tls:") != std::string::npos) return ParseRouterConfig(yaml, "t.yaml");
  return ParseRouterConfig(yaml + "\ntls: {mode: insecure}\n", "t.yaml");
}

// The error message of parsing `yaml`, which must fail with InvalidArgument.
std::string ErrorOf(const std::string& yaml) {
  auto config = Parse(yaml);
  EXPECT_FALSE(config.ok()) << yaml;
  if (config.ok()) return "";
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(config.status().message());
}

TEST(RouterConfigTest, DisaggregationModesParseByTheirNames) {
  for (DisaggregationMode mode : {DisaggregationMode::kNever, DisaggregationMode::kAlways, DisaggregationMode::kAuto}) {
    EXPECT_EQ(ParseDisaggregationMode(DisaggregationModeName(mode)), mode);
  }
  EXPECT_FALSE(ParseDisaggregationMode("sometimes").has_value());
  EXPECT_FALSE(ParseDisaggregationMode("Auto").has_value());
  EXPECT_FALSE(ParseDisaggregationMode("").has_value());
}

TEST(RouterConfigTest, ExampleLoads) {
  auto config = LoadRouterConfig(TANDEM_ROUTER_EXAMPLE_YAML);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->listener.host, "0.0.0.0");
  EXPECT_EQ(config->disaggregation.mode, DisaggregationMode::kAuto);
  ASSERT_TRUE(config->prefill.has_value());
  ASSERT_TRUE(config->prefill->discovery.has_value());
  EXPECT_EQ(config->prefill->discovery->port, 50051);
  EXPECT_EQ(config->prefill->policy.name, "kv_cache_aware");
  EXPECT_EQ(config->prefill->policy.params.at("overlap_weight"), "1.0");
  ASSERT_TRUE(config->decode.has_value());
  EXPECT_EQ(config->decode->workers.size(), 2u);
  EXPECT_EQ(config->sessions.header, "X-Session-ID");
}

// A container image sets TANDEM_HOST=0.0.0.0: the listener's default where
// the file names no host; a host in the file still wins.
TEST(RouterConfigTest, TandemHostSetsTheDefaultListenerHost) {
  setenv("TANDEM_HOST", "0.0.0.0", 1);
  auto from_env = Parse(kMinimal);
  auto from_file = Parse(std::string(kMinimal) + "listener: {host: 127.0.0.2}\n");
  unsetenv("TANDEM_HOST");
  ASSERT_TRUE(from_env.ok()) << from_env.status();
  EXPECT_EQ(from_env->listener.host, "0.0.0.0");
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->listener.host, "127.0.0.2");
  auto unset = Parse(kMinimal);
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_EQ(unset->listener.host, "127.0.0.1");
}

TEST(RouterConfigTest, DefaultsFillWhatTheFileOmits) {
  auto config = Parse(kMinimal);
  ASSERT_TRUE(config.ok()) << config.status();
  const RouterConfig defaults;
  EXPECT_EQ(config->listener.host, "127.0.0.1");
  EXPECT_EQ(config->listener.port, 8000);
  EXPECT_EQ(config->model.tokenizer, "builtin");
  EXPECT_EQ(config->model.chat_template, "");
  EXPECT_FALSE(config->prefill.has_value());
  ASSERT_TRUE(config->decode.has_value());
  EXPECT_EQ(config->decode->policy.name, "least_request");
  EXPECT_TRUE(config->decode->policy.params.empty());
  EXPECT_EQ(config->disaggregation.mode, DisaggregationMode::kNever);
  EXPECT_EQ(config->disaggregation.auto_threshold_tokens, defaults.disaggregation.auto_threshold_tokens);
  EXPECT_EQ(config->timeouts.first_token_s, defaults.timeouts.first_token_s);
  EXPECT_EQ(config->timeouts.idle_stream_s, defaults.timeouts.idle_stream_s);
  EXPECT_EQ(config->timeouts.request_s, defaults.timeouts.request_s);
  EXPECT_EQ(config->retries.max_attempts, 3);
  EXPECT_EQ(config->limits.max_body_bytes, defaults.limits.max_body_bytes);
  EXPECT_EQ(config->limits.max_queue, defaults.limits.max_queue);
  EXPECT_EQ(config->limits.max_in_flight, defaults.limits.max_in_flight);
  EXPECT_EQ(config->health.interval_s, defaults.health.interval_s);
  EXPECT_EQ(config->health.unhealthy_after, defaults.health.unhealthy_after);
  EXPECT_EQ(config->health.healthy_after, defaults.health.healthy_after);
  EXPECT_TRUE(config->kv_events.enabled);
  EXPECT_EQ(config->sessions.header, "X-Session-ID");
}

TEST(RouterConfigTest, ModeNeverNeedsNoPrefillPool) { ASSERT_TRUE(Parse(kMinimal).ok()); }

TEST(RouterConfigTest, DiscoveryPool) {
  auto config = Parse(R"(
pools:
  prefill:
    discovery: {dns: tandem-prefill.ns.svc.cluster.local, port: 50051, interval_s: 2.5}
  decode:
    workers: ["[::1]:50052", 127.0.0.1:50053]
    policy: {name: prefix_aware, params: {prefix_tokens: 128}}
)");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->prefill->discovery->dns, "tandem-prefill.ns.svc.cluster.local");
  EXPECT_EQ(config->prefill->discovery->interval_s, 2.5);
  EXPECT_EQ(config->decode->policy.params.at("prefix_tokens"), "128");
}

TEST(RouterConfigTest, UnknownNestedKeyNamesLineAndSuggests) {
  const std::string msg = ErrorOf(R"(pools:
  decode:
    workers: [a:1]
    polcy: {name: random}
)");
  EXPECT_THAT(msg, StartsWith("t.yaml:4:5: pools.decode.polcy: unknown key"));
  EXPECT_THAT(msg, HasSubstr("did you mean 'policy'"));
}

TEST(RouterConfigTest, UnknownTopLevelKeyWithoutCloseMatch) {
  const std::string msg = ErrorOf("frobnicate: 1\n");
  EXPECT_THAT(msg, StartsWith("t.yaml:1:1: frobnicate: unknown key"));
  EXPECT_THAT(msg, Not(HasSubstr("did you mean")));
}

TEST(RouterConfigTest, DuplicateKey) {
  EXPECT_THAT(ErrorOf("listener: {port: 1}\nlistener: {port: 2}\n"), StartsWith("t.yaml:2:1: listener: duplicate key"));
}

TEST(RouterConfigTest, WrongType) {
  EXPECT_THAT(ErrorOf("listener:\n  port: eighty\n"),
              StartsWith("t.yaml:2:9: listener.port: expected an integer, got 'eighty'"));
  EXPECT_THAT(ErrorOf("listener: [1, 2]\n"), StartsWith("t.yaml:1:11: listener: expected a mapping, got a list"));
  EXPECT_THAT(ErrorOf("kv_events: {enabled: maybe}\n"),
              StartsWith("t.yaml:1:22: kv_events.enabled: expected true or false"));
  EXPECT_THAT(ErrorOf("pools: {decode: {workers: a:1}}\n"),
              StartsWith("t.yaml:1:27: pools.decode.workers: expected a list"));
}

TEST(RouterConfigTest, OutOfRangeValue) {
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "health:\n  unhealthy_after: 0\n"),
              StartsWith("t.yaml:7:20: health.unhealthy_after: 0 is not in [1, 100]"));
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "timeouts: {first_token_s: -1}\n"),
              StartsWith("t.yaml:6:27: timeouts.first_token_s:"));
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "listener: {port: 70000}\n"), StartsWith("t.yaml:6:18: listener.port:"));
  EXPECT_THAT(ErrorOf("disaggregation: {mode: sometimes}\n"),
              StartsWith("t.yaml:1:24: disaggregation.mode: expected never, always or auto"));
}

TEST(RouterConfigTest, AttemptDeadlinesAndFailovers) {
  auto defaults = Parse(kMinimal);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_TRUE(defaults->retries.attempt_first_token.automatic);
  EXPECT_TRUE(defaults->retries.attempt_idle.automatic);
  EXPECT_EQ(defaults->retries.max_failovers, 3);
  EXPECT_EQ(defaults->retries.wait_for_worker_s, 0);

  auto config = Parse(std::string(kMinimal) +
                      "retries: {attempt_first_token_s: 1.5, attempt_idle_s: auto, "
                      "auto_multiplier: 8, auto_floor_s: 0.5, max_failovers: 0, wait_for_worker_s: 12.5}\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->retries.attempt_first_token.automatic);
  EXPECT_EQ(config->retries.attempt_first_token.seconds, 1.5);
  EXPECT_TRUE(config->retries.attempt_idle.automatic);
  EXPECT_EQ(config->retries.auto_multiplier, 8);
  EXPECT_EQ(config->retries.auto_floor_s, 0.5);
  EXPECT_EQ(config->retries.max_failovers, 0);
  EXPECT_EQ(config->retries.wait_for_worker_s, 12.5);

  // Each refusal: the YAML after kMinimal, and how its error starts.
  const std::pair<const char*, const char*> refused[] = {
      {"retries: {attempt_idle_s: soon}\n",
       "t.yaml:6:27: retries.attempt_idle_s: expected auto or a number of seconds, got 'soon'"},
      {"retries: {attempt_first_token_s: -2}\n", "t.yaml:6:34: retries.attempt_first_token_s: -2 is not in [0, 86400]"},
      {"retries: {max_failovers: 11}\n", "t.yaml:6:26: retries.max_failovers: 11 is not in [0, 10]"},
      {"retries: {auto_floor_s: 0}\n", "t.yaml:6:25: retries.auto_floor_s: 0 is not in (0, 3600]"},
      {"retries: {auto_multiplier: 0.5}\n", "t.yaml:6:28: retries.auto_multiplier: 0.5 is not in [1, 1000]"},
      {"retries: {wait_for_worker_s: 3601}\n", "t.yaml:6:30: retries.wait_for_worker_s: 3601 is not in [0, 3600]"},
      {"retries: {wait_for_worker_s: soon}\n", "t.yaml:6:30: retries.wait_for_worker_s:"},
      {"timeouts: {first_token_s: 5}\nretries: {wait_for_worker_s: 6}\n",
       "t.yaml:7:30: retries.wait_for_worker_s: must be <= timeouts.first_token_s (5)"},
  };
  for (const auto& [yaml, error] : refused) {
    EXPECT_THAT(ErrorOf(std::string(kMinimal) + yaml), StartsWith(error)) << yaml;
  }
}

TEST(RouterConfigTest, BadPolicyName) {
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "    policy: {name: fastest}\n"),
              StartsWith("t.yaml:6:20: pools.decode.policy.name: unknown routing policy "
                         "'fastest'"));
}

TEST(RouterConfigTest, BadPolicyParam) {
  const std::string msg = ErrorOf(std::string(kMinimal) + R"(    policy:
      name: prefix_aware
      params:
        virtual_nodes: 0
)");
  EXPECT_THAT(msg, StartsWith("t.yaml:9:24: pools.decode.policy.params.virtual_nodes:"));
  EXPECT_THAT(msg, HasSubstr("prefix_aware"));
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "    policy: {name: random, params: {bogus: 1}}\n"),
              StartsWith("t.yaml:6:44: pools.decode.policy.params.bogus:"));
}

TEST(RouterConfigTest, KvCacheAwareWithoutKvEventsIsApproximate) {
  // Allowed: the policy's index then learns from its own decisions.
  absl::StatusOr<RouterConfig> config =
      Parse(std::string(kMinimal) + "    policy: {name: kv_cache_aware}\nkv_events: {enabled: false}\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->kv_events.enabled);
  EXPECT_EQ(config->decode->policy.name, "kv_cache_aware");
}

TEST(RouterConfigTest, BothWorkersAndDiscovery) {
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "    discovery: {dns: decode, port: 1}\n"),
              StartsWith("t.yaml:6:5: pools.decode.discovery: set either workers or discovery, "
                         "not both"));
}

TEST(RouterConfigTest, PoolWithNeitherWorkersNorDiscovery) {
  EXPECT_THAT(ErrorOf("disaggregation: {mode: never}\npools:\n  decode: {policy: {name: random}}\n"),
              StartsWith("t.yaml:3:3: pools.decode: needs workers"));
}

TEST(RouterConfigTest, MissingDecodePool) {
  EXPECT_THAT(ErrorOf("listener: {port: 9000}\npools:\n  prefill: {workers: [p:1]}\n"),
              StartsWith("t.yaml:2:1: pools.decode: required"));
  // No pools at all: the top of the file.
  EXPECT_THAT(ErrorOf("listener: {port: 9000}\n"), StartsWith("t.yaml:1:1: pools.decode: required"));
  EXPECT_THAT(ErrorOf(""), StartsWith("t.yaml:1:1: pools.decode: required"));
}

TEST(RouterConfigTest, PrefillPoolRequiredUnlessModeNever) {
  EXPECT_THAT(ErrorOf("pools:\n  decode: {workers: [d:1]}\n"),
              StartsWith("t.yaml:1:1: pools.prefill: required when disaggregation.mode is auto"));
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "  prefill: {workers: [p:1]}\n"),
              StartsWith("t.yaml:6:3: pools.prefill: disaggregation.mode is never"));
}

TEST(RouterConfigTest, BadHostPort) {
  const std::string head = "disaggregation: {mode: never}\npools:\n  decode:\n    workers:\n";
  EXPECT_THAT(ErrorOf(head + "      - a:1\n      - b:99999\n"),
              StartsWith("t.yaml:6:9: pools.decode.workers[1]: port '99999' is not in 1..65535"));
  EXPECT_THAT(ErrorOf(head + "      - noport\n"),
              StartsWith("t.yaml:5:9: pools.decode.workers[0]: 'noport' is not host:port"));
  EXPECT_THAT(ErrorOf(head + "      - bad_-host-:1\n"),
              StartsWith("t.yaml:5:9: pools.decode.workers[0]: 'bad_-host-' is not a host name"));
  EXPECT_THAT(ErrorOf(head + "      - 300.1.1.1:1\n"), StartsWith("t.yaml:5:9: pools.decode.workers[0]:"));
  EXPECT_THAT(ErrorOf(head + "      - \"[zz::1]:1\"\n"),
              StartsWith("t.yaml:5:9: pools.decode.workers[0]: 'zz::1' is not an IPv6"));
  EXPECT_THAT(ErrorOf(head + "      - a:1\n      - a:1\n"),
              StartsWith("t.yaml:6:9: pools.decode.workers[1]: 'a:1' is listed twice"));
}

TEST(RouterConfigTest, BadSessionHeader) {
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "sessions: {header: \"X Session\"}\n"),
              StartsWith("t.yaml:6:20: sessions.header:"));
}

TEST(RouterConfigTest, YamlSyntaxError) {
  const std::string msg = ErrorOf("listener:\n  port: 1\n  host: [a, b\n");
  EXPECT_THAT(msg, StartsWith("t.yaml:"));
  EXPECT_THAT(msg, HasSubstr("YAML syntax error"));
  EXPECT_THAT(ErrorOf("a: 1\n---\nb: 2\n"), HasSubstr("more than one YAML document"));
}

// Found by router_config_fuzzer: yaml-cpp's LoadAll never returned on a stray
// ',' (empty documents forever, the heap growing), so a reload hung. Each
// input must now give an answer; the fuzzer's timeout input is the last one.
TEST(RouterConfigTest, StrayCommaIsAnErrorNotAHang) {
  for (const std::string yaml :
       {",", "{a: 1}\n,", "[a]\n,\n", "{listener: {host: '::', port: 8080}, disaggregation: {mode: never}}\n,"}) {
    EXPECT_THAT(ErrorOf(yaml), HasSubstr("more than one YAML document")) << yaml;
  }
  // A file of comments only is the empty config, as before.
  auto empty = Parse("# nothing\n");
  EXPECT_EQ(empty.status().code(), Parse("").status().code());
}

TEST(RouterConfigTest, LoadNamesTheFile) {
  auto missing = LoadRouterConfig("/nonexistent/router.yaml");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/router.yaml"));

  const std::string path = ::testing::TempDir() + "/router_config_test.yaml";
  {
    std::ofstream out(path);
    out << "listener:\n  prot: 1\n";
  }
  auto bad = LoadRouterConfig(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              StartsWith(path + ":2:3: listener.prot: unknown key; did you mean 'port'"));
}

constexpr char kDigest[] = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

TEST(RouterConfigTest, AuthKeysByDigestWithLimitsAndPriority) {
  auto config = Parse(std::string(kMinimal) + R"(
auth:
  limits_per_key: {requests_per_s: 2.5, tokens_per_min: 1000}
  keys:
    - name: alice
      sha256: "sha256:9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08"
      priority: 3
      max_concurrent: 4
limits: {max_connections: 10}
debug: {worker_details: true}
)");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->auth.keys.size(), 1u);
  const ApiKeyConfig& k = config->auth.keys[0];
  EXPECT_EQ(k.sha256, kDigest);  // prefix dropped, lowercased
  EXPECT_EQ(k.priority, 3);
  EXPECT_FALSE(k.admin);
  const KeyLimitsConfig l = k.Limits(config->auth.limits_per_key);
  EXPECT_EQ(l.requests_per_s, 2.5);
  EXPECT_EQ(l.tokens_per_min, 1000);
  EXPECT_EQ(l.max_concurrent, 4);
  EXPECT_TRUE(config->auth.enabled());
  EXPECT_EQ(config->limits.max_connections, 10);
  EXPECT_TRUE(config->debug.worker_details);
  // Without an auth section the router is open, and hides worker details.
  auto open = Parse(kMinimal);
  ASSERT_TRUE(open.ok());
  EXPECT_FALSE(open->auth.enabled());
  EXPECT_FALSE(open->debug.worker_details);
}

TEST(RouterConfigTest, BadAuthEntriesNameTheKey) {
  const std::string base = std::string(kMinimal) + "auth:\n  keys:\n";
  EXPECT_THAT(ErrorOf(base + "    - {name: a, sha256: \"sha256:abc\"}\n"),
              HasSubstr("auth.keys[0].sha256: is not a SHA-256 digest"));
  EXPECT_THAT(ErrorOf(base + "    - {name: a}\n"), HasSubstr("auth.keys[0].sha256: required"));
  EXPECT_THAT(ErrorOf(base + "    - {name: \"a b\", sha256: " + kDigest + "}\n"), HasSubstr("auth.keys[0].name"));
  EXPECT_THAT(ErrorOf(base + "    - {name: a, sha256: " + kDigest + "}\n    - {name: b, sha256: " + kDigest + "}\n"),
              HasSubstr("auth.keys[1].sha256: the same key as auth.keys[0] ('a')"));
  EXPECT_THAT(ErrorOf(base + "    - {name: a, sha256: " + kDigest + ", priority: 0}\n"),
              HasSubstr("auth.keys[0].priority: 0 is not in [1, 100]"));
  EXPECT_THAT(ErrorOf(base + "    - {name: a, sha256: " + kDigest + ", requests_per_s: -1}\n"),
              HasSubstr("auth.keys[0].requests_per_s"));
  EXPECT_THAT(ErrorOf(base + "    - {name: a, sha256: " + kDigest + ", colour: red}\n"), HasSubstr("unknown key"));
}

TEST(RouterConfigTest, KeysFileIsHashedAndNeverQuoted) {
  const std::string path = ::testing::TempDir() + "/router_config_test_keys";
  {
    std::ofstream out(path);
    out << "# comment\n\nops  ops-secret admin\nalice alice-secret\n";
  }
  auto config =
      Parse(std::string(kMinimal) + "auth:\n  keys_file: " + path + "\n  keys:\n    - {name: alice, priority: 5}\n");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->auth.keys.size(), 2u);
  EXPECT_EQ(config->auth.keys[0].name, "alice");  // the YAML entry, completed by the file
  EXPECT_EQ(config->auth.keys[0].priority, 5);
  EXPECT_EQ(config->auth.keys[0].sha256, Sha256Hex("alice-secret"));
  EXPECT_EQ(config->auth.keys[1].name, "ops");
  EXPECT_TRUE(config->auth.keys[1].admin);
  EXPECT_EQ(config->auth.keys[1].sha256, Sha256Hex("ops-secret"));
  {
    std::ofstream out(path);
    out << "alice alice-secret extra\n";
  }
  std::string err = ErrorOf(std::string(kMinimal) + "auth:\n  keys_file: " + path + "\n");
  EXPECT_THAT(err, HasSubstr("auth.keys_file: " + path + " line 1: expected NAME KEY"));
  EXPECT_THAT(err, Not(HasSubstr("alice-secret")));
  {
    std::ofstream out(path);
    out << "# no keys\n";
  }
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "auth:\n  keys_file: " + path + "\n"), HasSubstr("holds no key"));
  std::remove(path.c_str());
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "auth:\n  keys_file: " + path + "\n"), HasSubstr("auth.keys_file"));
}

TEST(RouterConfigTest, ValidateConfigBuiltInCode) {
  RouterConfig config;
  config.disaggregation.mode = DisaggregationMode::kNever;
  EXPECT_THAT(std::string(ValidateRouterConfig(config).message()), StartsWith("pools.decode: required"));
  config.decode.emplace();
  config.decode->workers = {"localhost:50051"};
  EXPECT_THAT(std::string(ValidateRouterConfig(config).message()), StartsWith("tls: required"));
  config.tls.mode = TlsMode::kInsecure;
  EXPECT_TRUE(ValidateRouterConfig(config).ok());
  config.retries.max_attempts = 0;
  EXPECT_THAT(std::string(ValidateRouterConfig(config).message()),
              StartsWith("retries.max_attempts: 0 is not in [1, 10]"));
}

TEST(RouterConfigTest, TlsIsChosenByNameNeverByOmission) {
  // No tls section: refused, saying what to write.
  absl::StatusOr<RouterConfig> none = ParseRouterConfig(kMinimal, "t.yaml");
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("tls: required"));
  EXPECT_THAT(none.status().message(), HasSubstr("tls.mode: insecure"));

  auto insecure = Parse(std::string(kMinimal) + "tls: {mode: insecure}\n");
  ASSERT_TRUE(insecure.ok()) << insecure.status();
  EXPECT_EQ(insecure->tls.mode, TlsMode::kInsecure);

  // Files without a mode mean mutual.
  auto mutual = Parse(std::string(kMinimal) +
                      "tls:\n  ca: /etc/tandem/ca.crt\n  cert: /etc/tandem/router.crt\n"
                      "  key: /etc/tandem/router.key\n");
  ASSERT_TRUE(mutual.ok()) << mutual.status();
  EXPECT_EQ(mutual->tls.mode, TlsMode::kMutual);
  EXPECT_EQ(mutual->tls.cert, "/etc/tandem/router.crt");

  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "tls:\n  mode: mutual\n  ca: /a\n  cert: /b\n"),
              HasSubstr("tls.key: required when tls.mode is mutual"));
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "tls:\n  mode: insecure\n  ca: /a\n"),
              HasSubstr("tls.mode: is insecure, but tls.ca/cert/key are given"));
  const std::string bad_mode = ErrorOf(std::string(kMinimal) + "tls:\n  mode: plaintext\n");
  EXPECT_THAT(bad_mode, StartsWith("t.yaml:"));
  EXPECT_THAT(bad_mode, HasSubstr("tls.mode: expected mutual or insecure"));
  EXPECT_THAT(ErrorOf(std::string(kMinimal) + "tls:\n  mode: insecure\n  cafile: /a\n"), HasSubstr("tls.cafile"));
}

}  // namespace
}  // namespace tandem::router

namespace tandem::router {
namespace {

// SerializeRouterConfig's text parses back to the same config: every field
// set away from its default, and strings YAML would misread unquoted.
TEST(RouterConfigSerializeTest, RoundTripsEveryField) {
  RouterConfig c;
  c.listener = {.host = "0.0.0.0", .port = 9123};
  c.model = {.served_name = "acme/\"chat\": v1 # not a comment",
             .tokenizer = "/models/x/tokenizer.json",
             .chat_template = "/models/x/template.jinja",
             .parse_special_tokens_in_messages = true};
  PoolConfig prefill;
  prefill.workers = {"10.0.0.1:50051", "[::1]:50052"};
  prefill.policy = {.name = "kv_cache_aware", .params = {{"overlap_weight", "2.5"}, {"load_weight", "0.5"}}};
  PoolConfig decode;
  decode.discovery = DnsDiscoveryConfig{.dns = "tandem-decode.llm.svc.cluster.local", .port = 50051, .interval_s = 2.5};
  decode.policy = {.name = "power_of_two", .params = {{"seed", "7"}}};
  c.prefill = prefill;
  c.decode = decode;
  c.disaggregation = {.mode = DisaggregationMode::kAlways, .auto_threshold_tokens = 1024};
  c.timeouts = {.first_token_s = 12.5, .idle_stream_s = 7.25, .request_s = 300.125};
  c.retries.max_attempts = 4;
  c.retries.budget_ratio = 0.3;
  c.retries.attempt_first_token = {.automatic = false, .seconds = 1.75};
  c.retries.attempt_idle = {.automatic = true};
  c.retries.auto_multiplier = 3.5;
  c.retries.auto_floor_s = 0.5;
  c.retries.max_failovers = 2;
  c.retries.wait_for_worker_s = 7.5;
  c.limits = {.max_body_bytes = 1 << 20, .max_queue = 17, .max_in_flight = 33, .max_connections = 99};
  c.health = {.interval_s = 0.7, .timeout_s = 0.3, .unhealthy_after = 4, .healthy_after = 3};
  c.kv_events.enabled = false;
  c.sessions.header = "X-Conversation";
  c.tls = {.mode = TlsMode::kInsecure};
  c.auth.limits_per_key = {.requests_per_s = 2.5, .tokens_per_min = 100000, .max_concurrent = 8};
  c.auth.keys = {{.name = "ops", .sha256 = std::string(64, 'a'), .admin = true, .priority = 5},
                 {.name = "app.1",
                  .sha256 = std::string(64, 'b'),
                  .requests_per_s = 0.5,
                  .tokens_per_min = 5000,
                  .max_concurrent = 2}};
  c.debug.worker_details = true;
  ASSERT_TRUE(ValidateRouterConfig(c).ok()) << ValidateRouterConfig(c);

  const std::string text = SerializeRouterConfig(c);
  absl::StatusOr<RouterConfig> back = ParseRouterConfig(text, "serialized");
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << text;
  EXPECT_TRUE(*back == c) << text;
  EXPECT_EQ(back->model.served_name, c.model.served_name);
  EXPECT_EQ(SerializeRouterConfig(*back), text);

  // The defaults (with the required pool and tls) round-trip too.
  RouterConfig d;
  d.decode = PoolConfig{.workers = {"127.0.0.1:50051"}};
  d.disaggregation.mode = DisaggregationMode::kNever;
  d.tls = {.mode = TlsMode::kInsecure};
  absl::StatusOr<RouterConfig> d_back = ParseRouterConfig(SerializeRouterConfig(d), "defaults");
  ASSERT_TRUE(d_back.ok()) << d_back.status() << "\n" << SerializeRouterConfig(d);
  EXPECT_TRUE(*d_back == d) << SerializeRouterConfig(d);
}

}  // namespace
}  // namespace tandem::router
