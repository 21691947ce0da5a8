#include "orchestrator/config/router_config.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/listen_host.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "yaml-cpp/eventhandler.h"
#include "yaml-cpp/yaml.h"

namespace tandem::router {
namespace {

// ---------------------------------------------------------------------------
// Syntax helpers.

bool IsIpLiteral(int family, const std::string& s) {
  unsigned char buf[sizeof(struct in6_addr)];
  return inet_pton(family, s.c_str(), buf) == 1;
}

// A DNS host name (RFC 1123 labels; '_' allowed, as some clusters use it) or
// an IPv4 literal. Four all-numeric labels must be a valid IPv4 address, so
// "999.1.1.1" is rejected rather than looked up.
bool IsHostName(const std::string& host) {
  std::string h = host;
  if (!h.empty() && h.back() == '.') h.pop_back();
  if (h.empty() || h.size() > 253) return false;
  int labels = 0;
  bool all_numeric = true;
  size_t start = 0;
  while (true) {
    const size_t dot = h.find('.', start);
    const std::string label = h.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
      if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) all_numeric = false;
    }
    ++labels;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  if (all_numeric) return labels == 4 && IsIpLiteral(AF_INET, h);
  return true;
}

bool ParsePort(absl::string_view s, int* port) {
  if (s.empty() || s.size() > 5) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  int v = 0;
  if (!absl::SimpleAtoi(s, &v) || v < 1 || v > 65535) return false;
  *port = v;
  return true;
}

// "" when `addr` is a valid "host:port" / "[v6]:port", else why not.
std::string HostPortError(const std::string& addr) {
  constexpr absl::string_view kForm = "; expected host:port or [ipv6]:port";
  std::string host;
  absl::string_view port;
  if (!addr.empty() && addr.front() == '[') {
    const size_t close = addr.find("]:");
    if (close == std::string::npos) return absl::StrCat("'", addr, "' is not host:port", kForm);
    host = addr.substr(1, close - 1);
    port = absl::string_view(addr).substr(close + 2);
    if (!IsIpLiteral(AF_INET6, host)) return absl::StrCat("'", host, "' is not an IPv6 address");
  } else {
    const size_t colon = addr.find(':');
    if (colon == std::string::npos || addr.find(':', colon + 1) != std::string::npos) {
      return absl::StrCat("'", addr, "' is not host:port", kForm);
    }
    host = addr.substr(0, colon);
    port = absl::string_view(addr).substr(colon + 1);
    if (!IsHostName(host)) return absl::StrCat("'", host, "' is not a host name or IPv4 address");
  }
  int p = 0;
  if (!ParsePort(port, &p)) return absl::StrCat("port '", port, "' is not in 1..65535");
  return "";
}

// An API key's name: it labels metrics, so a short plain token.
bool IsKeyName(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') {
      return false;
    }
  }
  return true;
}

// A plain API key as it appears after "Bearer ": visible ASCII, no spaces.
bool IsPlainKey(std::string_view s) {
  if (s.empty() || s.size() > 256) return false;
  for (char c : s) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}

// RFC 9110 field-name: one or more tchar.
bool IsHttpToken(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (absl::ascii_isalnum(static_cast<unsigned char>(c))) continue;
    if (c == '\0' || std::strchr("!#$%&'*+-.^_`|~", c) == nullptr) return false;
  }
  return true;
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string Join(const std::string& path, absl::string_view key) {
  return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
}

// The path one level up: "a.b[2]" -> "a.b", "a.b" -> "a", "a" -> "".
std::string ParentPath(const std::string& path) {
  const size_t cut = path.find_last_of(".[");
  return cut == std::string::npos ? "" : path.substr(0, cut);
}

// ---------------------------------------------------------------------------
// Validation. `where(path)` gives the "FILE:LINE:COL: " prefix for a key path
// (empty for configs built in code).

using Where = std::function<std::string(const std::string& path)>;

class Validator {
 public:
  explicit Validator(Where where) : where_(std::move(where)) {}

  absl::Status Validate(const RouterConfig& c) {
    if (!IsHostName(c.listener.host) && !IsIpLiteral(AF_INET6, c.listener.host)) {
      return Bad("listener.host", absl::StrCat("'", c.listener.host, "' is not a host name or IP address"));
    }
    RETURN_IF_ERROR(Range("listener.port", c.listener.port, 0, 65535));

    if (c.model.served_name.empty()) return Bad("model.served_name", "must not be empty");
    if (c.model.tokenizer.empty()) {
      return Bad("model.tokenizer", "must be a tokenizer.json path, \"builtin\" or \"builtin:NAME\"");
    }

    RETURN_IF_ERROR(
        Range("disaggregation.auto_threshold_tokens", c.disaggregation.auto_threshold_tokens, 1, int64_t{1} << 20));
    if (!c.decode.has_value()) {
      return Bad("pools.decode", "required: the decode pool (workers or discovery)");
    }
    const bool never = c.disaggregation.mode == DisaggregationMode::kNever;
    if (!never && !c.prefill.has_value()) {
      return Bad("pools.prefill", absl::StrCat("required when disaggregation.mode is ",
                                               std::string(DisaggregationModeName(c.disaggregation.mode)),
                                               " (only mode never runs without a prefill pool)"));
    }
    if (never && c.prefill.has_value()) {
      return Bad("pools.prefill",
                 "disaggregation.mode is never, so the prefill pool would go unused; remove it "
                 "or set mode to always or auto");
    }
    if (c.prefill.has_value()) RETURN_IF_ERROR(Pool("pools.prefill", *c.prefill, c));
    RETURN_IF_ERROR(Pool("pools.decode", *c.decode, c));

    const TimeoutsConfig& t = c.timeouts;
    RETURN_IF_ERROR(Seconds("timeouts.first_token_s", t.first_token_s, 0, false, 86400));
    RETURN_IF_ERROR(Seconds("timeouts.idle_stream_s", t.idle_stream_s, 0, false, 86400));
    RETURN_IF_ERROR(Seconds("timeouts.request_s", t.request_s, 0, false, 86400));
    if (t.request_s < t.first_token_s) {
      return Bad("timeouts.request_s", absl::StrCat("must be >= timeouts.first_token_s (", t.first_token_s, ")"));
    }

    RETURN_IF_ERROR(Range("retries.max_attempts", c.retries.max_attempts, 1, 10));
    RETURN_IF_ERROR(Seconds("retries.budget_ratio", c.retries.budget_ratio, 0, true, 1));
    for (const auto& [path, d] : {std::pair{"retries.attempt_first_token_s", c.retries.attempt_first_token},
                                  std::pair{"retries.attempt_idle_s", c.retries.attempt_idle}}) {
      if (!d.automatic) RETURN_IF_ERROR(Seconds(path, d.seconds, 0, true, 86400));
    }
    RETURN_IF_ERROR(Seconds("retries.auto_multiplier", c.retries.auto_multiplier, 1, true, 1000));
    RETURN_IF_ERROR(Seconds("retries.auto_floor_s", c.retries.auto_floor_s, 0, false, 3600));
    RETURN_IF_ERROR(Range("retries.max_failovers", c.retries.max_failovers, 0, 10));
    RETURN_IF_ERROR(Seconds("retries.wait_for_worker_s", c.retries.wait_for_worker_s, 0, true, 3600));
    if (c.retries.wait_for_worker_s > t.first_token_s) {
      return Bad("retries.wait_for_worker_s", absl::StrCat("must be <= timeouts.first_token_s (", t.first_token_s,
                                                           "): a longer wait would end as a first-token timeout"));
    }

    RETURN_IF_ERROR(Range("limits.max_body_bytes", c.limits.max_body_bytes, 1024, int64_t{1} << 30));
    RETURN_IF_ERROR(Range("limits.max_queue", c.limits.max_queue, 0, int64_t{1} << 20));
    RETURN_IF_ERROR(Range("limits.max_in_flight", c.limits.max_in_flight, 1, int64_t{1} << 20));
    RETURN_IF_ERROR(Range("limits.max_connections", c.limits.max_connections, 1, int64_t{1} << 20));
    RETURN_IF_ERROR(Auth(c.auth));

    const HealthConfig& h = c.health;
    RETURN_IF_ERROR(Seconds("health.interval_s", h.interval_s, 0.1, true, 3600));
    RETURN_IF_ERROR(Seconds("health.timeout_s", h.timeout_s, 0, false, h.interval_s));
    RETURN_IF_ERROR(Range("health.unhealthy_after", h.unhealthy_after, 1, 100));
    RETURN_IF_ERROR(Range("health.healthy_after", h.healthy_after, 1, 100));

    if (!IsHttpToken(c.sessions.header)) {
      return Bad("sessions.header", absl::StrCat("'", c.sessions.header, "' is not a valid HTTP header name"));
    }

    // Last, so that a config's other mistakes are reported as before.
    const TlsConfig& tls = c.tls;
    switch (tls.mode) {
      case TlsMode::kUnset:
        return Bad("tls",
                   "required: tls.ca, tls.cert and tls.key for mutual TLS with the "
                   "workers (`tandem certs --out DIR` makes them), or tls.mode: insecure");
      case TlsMode::kInsecure:
        if (!tls.ca.empty() || !tls.cert.empty() || !tls.key.empty()) {
          return Bad("tls.mode",
                     "is insecure, but tls.ca/cert/key are given: remove them, or "
                     "set mode: mutual");
        }
        break;
      case TlsMode::kMutual:
        for (const auto& [key, value] : {std::pair<const char*, const std::string*>{"tls.ca", &tls.ca},
                                         std::pair<const char*, const std::string*>{"tls.cert", &tls.cert},
                                         std::pair<const char*, const std::string*>{"tls.key", &tls.key}}) {
          if (value->empty()) return Bad(key, "required when tls.mode is mutual (a PEM file path)");
        }
        break;
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Bad(const std::string& path, absl::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat(where_(path), path, ": ", why));
  }

  absl::Status Range(const std::string& path, int64_t v, int64_t lo, int64_t hi) const {
    if (v < lo || v > hi) return Bad(path, absl::StrCat(v, " is not in [", lo, ", ", hi, "]"));
    return absl::OkStatus();
  }

  // lo < v (or lo <= v with lo_inclusive) and v <= hi, and finite.
  absl::Status Seconds(const std::string& path, double v, double lo, bool lo_inclusive, double hi) const {
    const bool ok = std::isfinite(v) && (lo_inclusive ? v >= lo : v > lo) && v <= hi;
    if (!ok) {
      return Bad(path, absl::StrCat(v, " is not in ", lo_inclusive ? "[" : "(", lo, ", ", hi, "]"));
    }
    return absl::OkStatus();
  }

  absl::Status KeyLimits(const std::string& path, const KeyLimitsConfig& l) const {
    RETURN_IF_ERROR(Seconds(Join(path, "requests_per_s"), l.requests_per_s, 0, true, 1e6));
    RETURN_IF_ERROR(Range(Join(path, "tokens_per_min"), l.tokens_per_min, 0, int64_t{1000000000000}));
    return Range(Join(path, "max_concurrent"), l.max_concurrent, 0, int64_t{1} << 20);
  }

  absl::Status Auth(const AuthConfig& a) const {
    RETURN_IF_ERROR(KeyLimits("auth.limits_per_key", a.limits_per_key));
    std::map<std::string, size_t> names, digests;
    for (size_t i = 0; i < a.keys.size(); ++i) {
      const ApiKeyConfig& k = a.keys[i];
      const std::string path = absl::StrCat("auth.keys[", i, "]");
      if (!IsKeyName(k.name)) {
        return Bad(Join(path, "name"), absl::StrCat("'", k.name,
                                                    "' is not 1 to 64 characters of "
                                                    "[A-Za-z0-9_.-]"));
      }
      if (!names.emplace(k.name, i).second) {
        return Bad(Join(path, "name"), absl::StrCat("'", k.name, "' names two keys"));
      }
      if (k.sha256.empty()) {
        return Bad(Join(path, "sha256"), absl::StrCat("required: the key's digest, sha256:<64 hex digits> (or a key "
                                                      "named '",
                                                      k.name, "' in auth.keys_file)"));
      }
      if (!ParseDigestHex(k.sha256).has_value()) {
        return Bad(Join(path, "sha256"), "is not a SHA-256 digest: expected sha256:<64 hex digits>");
      }
      if (auto [it, added] = digests.emplace(k.sha256, i); !added) {
        return Bad(Join(path, "sha256"),
                   absl::StrCat("the same key as auth.keys[", it->second, "] ('", a.keys[it->second].name, "')"));
      }
      RETURN_IF_ERROR(Range(Join(path, "priority"), k.priority, 1, 100));
      RETURN_IF_ERROR(KeyLimits(path, k.Limits(a.limits_per_key)));
    }
    return absl::OkStatus();
  }

  absl::Status Pool(const std::string& path, const PoolConfig& pool, const RouterConfig& c) const {
    if (!pool.workers.empty() && pool.discovery.has_value()) {
      return Bad(Join(path, "discovery"), "set either workers or discovery, not both");
    }
    if (pool.workers.empty() && !pool.discovery.has_value()) {
      return Bad(path, "needs workers (a list of host:port) or discovery (dns, port)");
    }
    std::set<std::string> seen;
    for (size_t i = 0; i < pool.workers.size(); ++i) {
      const std::string wpath = absl::StrCat(path, ".workers[", i, "]");
      const std::string why = HostPortError(pool.workers[i]);
      if (!why.empty()) return Bad(wpath, why);
      if (!seen.insert(pool.workers[i]).second) {
        return Bad(wpath, absl::StrCat("'", pool.workers[i], "' is listed twice"));
      }
    }
    if (pool.discovery.has_value()) {
      const DnsDiscoveryConfig& d = *pool.discovery;
      const std::string dpath = Join(path, "discovery");
      if (d.dns.empty()) return Bad(Join(dpath, "dns"), "required: the name to resolve");
      if (!IsHostName(d.dns)) {
        return Bad(Join(dpath, "dns"), absl::StrCat("'", d.dns, "' is not a DNS name"));
      }
      RETURN_IF_ERROR(Range(Join(dpath, "port"), d.port, 1, 65535));
      RETURN_IF_ERROR(Seconds(Join(dpath, "interval_s"), d.interval_s, 1, true, 3600));
    }

    // The policy: created for real, so its own parameter checks run now.
    const std::string ppath = Join(path, "policy");
    RoutingPolicyRegistry registry;
    RegisterBuiltinRoutingPolicies(registry);
    auto policy = registry.Create(pool.policy.name, pool.policy.params);
    if (!policy.ok()) {
      const std::string msg(policy.status().message());
      for (const auto& [key, value] : pool.policy.params) {
        if (msg.find(absl::StrCat("parameter '", key, "'")) != std::string::npos) {
          return Bad(absl::StrCat(ppath, ".params.", key), msg);
        }
      }
      const auto names = registry.names();
      if (std::find(names.begin(), names.end(), pool.policy.name) == names.end()) {
        return Bad(Join(ppath, "name"), msg);
      }
      return Bad(Join(ppath, "params"), msg);
    }
    return absl::OkStatus();
  }

  Where where_;
};

// ---------------------------------------------------------------------------
// YAML reading: types and key names only; values are checked by Validator.

std::string Describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
      return "nothing (null)";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Scalar:
      return absl::StrCat("'", n.Scalar(), "'");
    case YAML::NodeType::Undefined:
      break;
  }
  return "nothing";
}

// The keys of one YAML mapping, checked against the known ones.
struct Fields {
  std::string path;
  std::map<std::string, YAML::Node> values;

  const YAML::Node* Find(absl::string_view key) const {
    auto it = values.find(std::string(key));
    return it == values.end() ? nullptr : &it->second;
  }
};

// The number of YAML documents in `yaml`, counting up to `at_most`. Throws
// what yaml-cpp's parser throws on a syntax error.
int CountDocuments(std::string_view yaml, int at_most) {
  struct Ignore final : YAML::EventHandler {
    void OnDocumentStart(const YAML::Mark&) override {}
    void OnDocumentEnd() override {}
    void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
    void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
    void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
    void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
    void OnSequenceEnd() override {}
    void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
    void OnMapEnd() override {}
  } ignore;
  std::istringstream in{std::string(yaml)};
  YAML::Parser parser(in);
  int count = 0;
  while (count < at_most && parser.HandleNextDocument(ignore)) ++count;
  return count;
}

class Parser {
 public:
  explicit Parser(std::string name) : name_(std::move(name)) {}

  absl::StatusOr<RouterConfig> Parse(std::string_view yaml) {
    // yaml-cpp 0.7's LoadAll never returns on some inputs (after a stray ','
    // its parser reports empty documents forever, allocating each: found by
    // router_config_fuzzer), so documents are counted by a bounded loop over
    // the parser's events and only the first one is built.
    int count = 0;
    YAML::Node doc;
    try {
      count = CountDocuments(yaml, /*at_most=*/2);
      if (count == 1) doc = YAML::Load(std::string(yaml));
    } catch (const YAML::ParserException& e) {
      return absl::InvalidArgumentError(absl::StrCat(At(e.mark), "YAML syntax error: ", e.msg));
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(At(e.mark), "YAML error: ", e.msg));
    }
    if (count > 1) {
      return absl::InvalidArgumentError(absl::StrCat(name_, ": holds more than one YAML document; expected one"));
    }
    marks_[""] = YAML::Mark();  // line 0, column 0: the top of the file
    RouterConfig config;
    if (count == 1) RETURN_IF_ERROR(Root(doc, &config));
    RETURN_IF_ERROR(Validator([this](const std::string& path) { return Where(path); }).Validate(config));
    return config;
  }

 private:
  std::string At(const YAML::Mark& m) const {
    if (m.is_null()) return absl::StrCat(name_, ": ");
    return absl::StrCat(name_, ":", m.line + 1, ":", m.column + 1, ": ");
  }

  // The location of `path`, or of its nearest ancestor that the file has.
  std::string Where(std::string path) const {
    while (true) {
      auto it = marks_.find(path);
      if (it != marks_.end()) return At(it->second);
      if (path.empty()) return At(YAML::Mark::null_mark());
      path = ParentPath(path);
    }
  }

  absl::Status Bad(const YAML::Mark& mark, const std::string& path, absl::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat(At(mark), path.empty() ? "(top level)" : path, ": ", why));
  }

  // Checks that `node` is a mapping (null counts as empty) whose keys are
  // unique scalars from `known`, and records where each key is.
  absl::StatusOr<Fields> Map(const YAML::Node& node, const std::string& path,
                             std::initializer_list<absl::string_view> known) {
    Fields f{path, {}};
    if (node.IsNull()) return f;
    if (!node.IsMap()) return Bad(node.Mark(), path, absl::StrCat("expected a mapping, got ", Describe(node)));
    for (auto it = node.begin(); it != node.end(); ++it) {
      // A copy: the iterator's -> yields a temporary proxy, which a reference
      // into it would outlive.
      const YAML::Node k = it->first;
      if (!k.IsScalar()) return Bad(k.Mark(), path, "keys must be plain names");
      const std::string key = k.Scalar();
      const std::string kpath = Join(path, key);
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        std::string why = "unknown key";
        size_t best = 3;
        absl::string_view suggestion;
        for (absl::string_view candidate : known) {
          const size_t d = EditDistance(key, candidate);
          if (d < best) best = d, suggestion = candidate;
        }
        if (!suggestion.empty()) absl::StrAppend(&why, "; did you mean '", suggestion, "'?");
        absl::StrAppend(&why, " (known: ", absl::StrJoin(known, ", "), ")");
        return Bad(k.Mark(), kpath, why);
      }
      if (!f.values.emplace(key, it->second).second) return Bad(k.Mark(), kpath, "duplicate key");
      // Scalars point at the value; mappings and lists at their key.
      marks_[kpath] = it->second.IsScalar() ? it->second.Mark() : k.Mark();
    }
    return f;
  }

  absl::StatusOr<Fields> SubMap(const Fields& parent, absl::string_view key,
                                std::initializer_list<absl::string_view> known) {
    const YAML::Node* n = parent.Find(key);
    return Map(n ? *n : YAML::Node(), Join(parent.path, key), known);
  }

  absl::Status Scalar(const YAML::Node& n, const std::string& path, absl::string_view expected) const {
    if (n.IsScalar()) return absl::OkStatus();
    return Bad(n.Mark(), path, absl::StrCat("expected ", expected, ", got ", Describe(n)));
  }

  absl::Status String(const Fields& f, absl::string_view key, std::string* out) const {
    const YAML::Node* n = f.Find(key);
    if (n == nullptr) return absl::OkStatus();
    RETURN_IF_ERROR(Scalar(*n, Join(f.path, key), "a string"));
    *out = n->Scalar();
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status Int(const Fields& f, absl::string_view key, T* out) const {
    const YAML::Node* n = f.Find(key);
    if (n == nullptr) return absl::OkStatus();
    const std::string path = Join(f.path, key);
    RETURN_IF_ERROR(Scalar(*n, path, "an integer"));
    int64_t v = 0;
    if (!absl::SimpleAtoi(n->Scalar(), &v)) {
      return Bad(n->Mark(), path, absl::StrCat("expected an integer, got ", Describe(*n)));
    }
    if constexpr (sizeof(T) < sizeof(int64_t)) {
      if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
        return Bad(n->Mark(), path, absl::StrCat(v, " is out of range"));
      }
    }
    *out = static_cast<T>(v);
    return absl::OkStatus();
  }

  absl::Status Double(const Fields& f, absl::string_view key, double* out) const {
    const YAML::Node* n = f.Find(key);
    if (n == nullptr) return absl::OkStatus();
    const std::string path = Join(f.path, key);
    RETURN_IF_ERROR(Scalar(*n, path, "a number"));
    double v = 0;
    if (!absl::SimpleAtod(n->Scalar(), &v) || !std::isfinite(v)) {
      return Bad(n->Mark(), path, absl::StrCat("expected a number, got ", Describe(*n)));
    }
    *out = v;
    return absl::OkStatus();
  }

  // `auto` or a number of seconds.
  absl::Status AttemptDeadline(const Fields& f, absl::string_view key, AttemptDeadlineConfig* out) const {
    const YAML::Node* n = f.Find(key);
    if (n == nullptr) return absl::OkStatus();
    const std::string path = Join(f.path, key);
    RETURN_IF_ERROR(Scalar(*n, path, "auto or a number of seconds"));
    if (n->Scalar() == "auto") {
      *out = AttemptDeadlineConfig{.automatic = true};
      return absl::OkStatus();
    }
    double v = 0;
    if (!absl::SimpleAtod(n->Scalar(), &v) || !std::isfinite(v)) {
      return Bad(n->Mark(), path, absl::StrCat("expected auto or a number of seconds, got ", Describe(*n)));
    }
    *out = AttemptDeadlineConfig{.automatic = false, .seconds = v};
    return absl::OkStatus();
  }

  absl::Status Bool(const Fields& f, absl::string_view key, bool* out) const {
    const YAML::Node* n = f.Find(key);
    if (n == nullptr) return absl::OkStatus();
    const std::string path = Join(f.path, key);
    RETURN_IF_ERROR(Scalar(*n, path, "true or false"));
    const std::string s = absl::AsciiStrToLower(n->Scalar());
    if (s != "true" && s != "false") {
      return Bad(n->Mark(), path, absl::StrCat("expected true or false, got ", Describe(*n)));
    }
    *out = s == "true";
    return absl::OkStatus();
  }

  absl::Status Root(const YAML::Node& root, RouterConfig* c) {
    ASSIGN_OR_RETURN(Fields top, Map(root, "",
                                     {"listener", "model", "pools", "disaggregation", "timeouts", "retries", "limits",
                                      "health", "kv_events", "sessions", "tls", "auth", "debug"}));

    ASSIGN_OR_RETURN(Fields listener, SubMap(top, "listener", {"host", "port"}));
    // A container image sets TANDEM_HOST=0.0.0.0: the default where the file has no host.
    if (const char* env = std::getenv(kListenHostEnv); env != nullptr && *env != '\0') {
      c->listener.host = env;
    }
    RETURN_IF_ERROR(String(listener, "host", &c->listener.host));
    RETURN_IF_ERROR(Int(listener, "port", &c->listener.port));

    ASSIGN_OR_RETURN(
        Fields model,
        SubMap(top, "model", {"served_name", "tokenizer", "chat_template", "parse_special_tokens_in_messages"}));
    RETURN_IF_ERROR(String(model, "served_name", &c->model.served_name));
    RETURN_IF_ERROR(String(model, "tokenizer", &c->model.tokenizer));
    RETURN_IF_ERROR(String(model, "chat_template", &c->model.chat_template));
    RETURN_IF_ERROR(Bool(model, "parse_special_tokens_in_messages", &c->model.parse_special_tokens_in_messages));

    ASSIGN_OR_RETURN(Fields pools, SubMap(top, "pools", {"prefill", "decode"}));
    for (absl::string_view role : {"prefill", "decode"}) {
      const YAML::Node* n = pools.Find(role);
      if (n == nullptr) continue;
      PoolConfig pool;
      RETURN_IF_ERROR(Pool(*n, Join(pools.path, role), &pool));
      (role == "prefill" ? c->prefill : c->decode) = std::move(pool);
    }

    ASSIGN_OR_RETURN(Fields disagg, SubMap(top, "disaggregation", {"mode", "auto_threshold_tokens"}));
    if (const YAML::Node* n = disagg.Find("mode")) {
      const std::string path = Join(disagg.path, "mode");
      RETURN_IF_ERROR(Scalar(*n, path, "never, always or auto"));
      const std::optional<DisaggregationMode> mode = ParseDisaggregationMode(n->Scalar());
      if (!mode.has_value()) {
        return Bad(n->Mark(), path, absl::StrCat("expected never, always or auto, got ", Describe(*n)));
      }
      c->disaggregation.mode = *mode;
    }
    RETURN_IF_ERROR(Int(disagg, "auto_threshold_tokens", &c->disaggregation.auto_threshold_tokens));

    ASSIGN_OR_RETURN(Fields timeouts, SubMap(top, "timeouts", {"first_token_s", "idle_stream_s", "request_s"}));
    RETURN_IF_ERROR(Double(timeouts, "first_token_s", &c->timeouts.first_token_s));
    RETURN_IF_ERROR(Double(timeouts, "idle_stream_s", &c->timeouts.idle_stream_s));
    RETURN_IF_ERROR(Double(timeouts, "request_s", &c->timeouts.request_s));

    ASSIGN_OR_RETURN(Fields retries, SubMap(top, "retries",
                                            {"max_attempts", "budget_ratio", "attempt_first_token_s", "attempt_idle_s",
                                             "auto_multiplier", "auto_floor_s", "max_failovers", "wait_for_worker_s"}));
    RETURN_IF_ERROR(Int(retries, "max_attempts", &c->retries.max_attempts));
    RETURN_IF_ERROR(Double(retries, "budget_ratio", &c->retries.budget_ratio));
    RETURN_IF_ERROR(AttemptDeadline(retries, "attempt_first_token_s", &c->retries.attempt_first_token));
    RETURN_IF_ERROR(AttemptDeadline(retries, "attempt_idle_s", &c->retries.attempt_idle));
    RETURN_IF_ERROR(Double(retries, "auto_multiplier", &c->retries.auto_multiplier));
    RETURN_IF_ERROR(Double(retries, "auto_floor_s", &c->retries.auto_floor_s));
    RETURN_IF_ERROR(Int(retries, "max_failovers", &c->retries.max_failovers));
    RETURN_IF_ERROR(Double(retries, "wait_for_worker_s", &c->retries.wait_for_worker_s));

    ASSIGN_OR_RETURN(Fields limits,
                     SubMap(top, "limits", {"max_body_bytes", "max_queue", "max_in_flight", "max_connections"}));
    RETURN_IF_ERROR(Int(limits, "max_body_bytes", &c->limits.max_body_bytes));
    RETURN_IF_ERROR(Int(limits, "max_queue", &c->limits.max_queue));
    RETURN_IF_ERROR(Int(limits, "max_in_flight", &c->limits.max_in_flight));
    RETURN_IF_ERROR(Int(limits, "max_connections", &c->limits.max_connections));

    ASSIGN_OR_RETURN(Fields health,
                     SubMap(top, "health", {"interval_s", "timeout_s", "unhealthy_after", "healthy_after"}));
    RETURN_IF_ERROR(Double(health, "interval_s", &c->health.interval_s));
    RETURN_IF_ERROR(Double(health, "timeout_s", &c->health.timeout_s));
    RETURN_IF_ERROR(Int(health, "unhealthy_after", &c->health.unhealthy_after));
    RETURN_IF_ERROR(Int(health, "healthy_after", &c->health.healthy_after));

    ASSIGN_OR_RETURN(Fields kv_events, SubMap(top, "kv_events", {"enabled"}));
    RETURN_IF_ERROR(Bool(kv_events, "enabled", &c->kv_events.enabled));

    ASSIGN_OR_RETURN(Fields sessions, SubMap(top, "sessions", {"header"}));
    RETURN_IF_ERROR(String(sessions, "header", &c->sessions.header));

    ASSIGN_OR_RETURN(Fields tls, SubMap(top, "tls", {"mode", "ca", "cert", "key"}));
    RETURN_IF_ERROR(String(tls, "ca", &c->tls.ca));
    RETURN_IF_ERROR(String(tls, "cert", &c->tls.cert));
    RETURN_IF_ERROR(String(tls, "key", &c->tls.key));
    if (const YAML::Node* n = tls.Find("mode")) {
      const std::string path = Join(tls.path, "mode");
      RETURN_IF_ERROR(Scalar(*n, path, "mutual or insecure"));
      if (n->Scalar() == "mutual") {
        c->tls.mode = TlsMode::kMutual;
      } else if (n->Scalar() == "insecure") {
        c->tls.mode = TlsMode::kInsecure;
      } else {
        return Bad(n->Mark(), path, absl::StrCat("expected mutual or insecure, got ", Describe(*n)));
      }
    } else if (!c->tls.ca.empty() || !c->tls.cert.empty() || !c->tls.key.empty()) {
      c->tls.mode = TlsMode::kMutual;
    }
    RETURN_IF_ERROR(Auth(top, &c->auth));
    ASSIGN_OR_RETURN(Fields debug, SubMap(top, "debug", {"worker_details"}));
    RETURN_IF_ERROR(Bool(debug, "worker_details", &c->debug.worker_details));
    return absl::OkStatus();
  }

  absl::Status KeyLimits(const Fields& f, KeyLimitsConfig* l) const {
    RETURN_IF_ERROR(Double(f, "requests_per_s", &l->requests_per_s));
    RETURN_IF_ERROR(Int(f, "tokens_per_min", &l->tokens_per_min));
    return Int(f, "max_concurrent", &l->max_concurrent);
  }

  absl::Status Auth(const Fields& top, AuthConfig* auth) {
    ASSIGN_OR_RETURN(Fields f, SubMap(top, "auth", {"keys", "keys_file", "limits_per_key"}));
    ASSIGN_OR_RETURN(Fields limits,
                     SubMap(f, "limits_per_key", {"requests_per_s", "tokens_per_min", "max_concurrent"}));
    RETURN_IF_ERROR(KeyLimits(limits, &auth->limits_per_key));
    if (const YAML::Node* keys = f.Find("keys")) {
      const std::string kpath = Join(f.path, "keys");
      if (!keys->IsNull() && !keys->IsSequence()) {
        return Bad(keys->Mark(), kpath, absl::StrCat("expected a list of keys, got ", Describe(*keys)));
      }
      for (size_t i = 0; keys->IsSequence() && i < keys->size(); ++i) {
        const std::string ipath = absl::StrCat(kpath, "[", i, "]");
        const YAML::Node item = (*keys)[i];
        marks_[ipath] = item.Mark();
        ASSIGN_OR_RETURN(Fields k, Map(item, ipath,
                                       {"name", "sha256", "admin", "priority", "requests_per_s", "tokens_per_min",
                                        "max_concurrent"}));
        ApiKeyConfig key;
        RETURN_IF_ERROR(String(k, "name", &key.name));
        RETURN_IF_ERROR(String(k, "sha256", &key.sha256));
        if (absl::StartsWith(key.sha256, "sha256:")) key.sha256 = key.sha256.substr(7);
        key.sha256 = absl::AsciiStrToLower(key.sha256);
        RETURN_IF_ERROR(Bool(k, "admin", &key.admin));
        RETURN_IF_ERROR(Int(k, "priority", &key.priority));
        if (k.Find("requests_per_s") != nullptr) {
          RETURN_IF_ERROR(Double(k, "requests_per_s", &key.requests_per_s.emplace()));
        }
        if (k.Find("tokens_per_min") != nullptr) {
          RETURN_IF_ERROR(Int(k, "tokens_per_min", &key.tokens_per_min.emplace()));
        }
        if (k.Find("max_concurrent") != nullptr) {
          RETURN_IF_ERROR(Int(k, "max_concurrent", &key.max_concurrent.emplace()));
        }
        auth->keys.push_back(std::move(key));
      }
    }
    RETURN_IF_ERROR(String(f, "keys_file", &auth->keys_file));
    if (!auth->keys_file.empty()) RETURN_IF_ERROR(KeysFile(Join(f.path, "keys_file"), auth));
    return absl::OkStatus();
  }

  // Reads auth.keys_file into `auth->keys`. Errors name the file's line,
  // never the key on it.
  absl::Status KeysFile(const std::string& path, AuthConfig* auth) {
    const YAML::Mark mark = marks_[path];
    absl::StatusOr<std::string> text = ReadFile(auth->keys_file);
    if (!text.ok()) return Bad(mark, path, text.status().message());
    int line_no = 0, added = 0;
    for (absl::string_view line : absl::StrSplit(*text, '\n')) {
      ++line_no;
      line = absl::StripAsciiWhitespace(line);
      if (line.empty() || line.front() == '#') continue;
      std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
      auto bad = [&](absl::string_view why) {
        return Bad(mark, path, absl::StrCat(auth->keys_file, " line ", line_no, ": ", why));
      };
      if (fields.size() < 2 || fields.size() > 3 || (fields.size() == 3 && fields[2] != "admin")) {
        return bad("expected NAME KEY or NAME KEY admin");
      }
      const std::string name(fields[0]);
      const std::string_view plain(fields[1].data(), fields[1].size());
      if (!IsPlainKey(plain)) return bad("the key must be 1 to 256 visible ASCII characters");
      ApiKeyConfig key;
      key.name = name;
      key.sha256 = Sha256Hex(plain);
      key.admin = fields.size() == 3;
      // A keys entry of this name without a digest holds its settings.
      auto it = std::find_if(auth->keys.begin(), auth->keys.end(),
                             [&](const ApiKeyConfig& k) { return k.name == name && k.sha256.empty(); });
      if (it != auth->keys.end()) {
        it->sha256 = key.sha256;
        it->admin = it->admin || key.admin;
      } else {
        auth->keys.push_back(std::move(key));
      }
      ++added;
    }
    if (added == 0) {
      // An empty file must not open the router to everyone.
      return Bad(mark, path, absl::StrCat(auth->keys_file, " holds no key"));
    }
    return absl::OkStatus();
  }

  absl::Status Pool(const YAML::Node& node, const std::string& path, PoolConfig* pool) {
    ASSIGN_OR_RETURN(Fields f, Map(node, path, {"workers", "discovery", "policy"}));
    if (const YAML::Node* w = f.Find("workers")) {
      const std::string wpath = Join(path, "workers");
      if (!w->IsSequence()) {
        return Bad(w->Mark(), wpath, absl::StrCat("expected a list of host:port, got ", Describe(*w)));
      }
      if (w->size() == 0) return Bad(w->Mark(), wpath, "is empty; list at least one host:port");
      for (size_t i = 0; i < w->size(); ++i) {
        const YAML::Node item = (*w)[i];
        const std::string ipath = absl::StrCat(wpath, "[", i, "]");
        RETURN_IF_ERROR(Scalar(item, ipath, "a host:port string"));
        marks_[ipath] = item.Mark();
        pool->workers.push_back(item.Scalar());
      }
    }
    if (const YAML::Node* d = f.Find("discovery")) {
      ASSIGN_OR_RETURN(Fields disc, Map(*d, Join(path, "discovery"), {"dns", "port", "interval_s"}));
      DnsDiscoveryConfig dns;
      RETURN_IF_ERROR(String(disc, "dns", &dns.dns));
      RETURN_IF_ERROR(Int(disc, "port", &dns.port));
      RETURN_IF_ERROR(Double(disc, "interval_s", &dns.interval_s));
      pool->discovery = std::move(dns);
    }
    ASSIGN_OR_RETURN(Fields policy, SubMap(f, "policy", {"name", "params"}));
    RETURN_IF_ERROR(String(policy, "name", &pool->policy.name));
    // Params are the policy's business: any names, scalar values.
    if (const YAML::Node* p = policy.Find("params")) {
      const std::string ppath = Join(policy.path, "params");
      if (!p->IsNull() && !p->IsMap()) {
        return Bad(p->Mark(), ppath, absl::StrCat("expected a mapping, got ", Describe(*p)));
      }
      for (auto it = p->begin(); p->IsMap() && it != p->end(); ++it) {
        // A copy: the iterator's -> yields a temporary proxy, which a
        // reference into it would outlive.
        const YAML::Node k = it->first;
        if (!k.IsScalar()) return Bad(k.Mark(), ppath, "keys must be plain names");
        const std::string kpath = Join(ppath, k.Scalar());
        RETURN_IF_ERROR(Scalar(it->second, kpath, "a scalar value"));
        if (!pool->policy.params.emplace(k.Scalar(), it->second.Scalar()).second) {
          return Bad(k.Mark(), kpath, "duplicate key");
        }
        marks_[kpath] = it->second.Mark();
      }
    }
    return absl::OkStatus();
  }

  std::string name_;
  std::map<std::string, YAML::Mark> marks_;  // key path -> where it is
};

}  // namespace

std::string_view DisaggregationModeName(DisaggregationMode mode) {
  switch (mode) {
    case DisaggregationMode::kNever:
      return "never";
    case DisaggregationMode::kAlways:
      return "always";
    case DisaggregationMode::kAuto:
      return "auto";
  }
  return "unknown";
}

std::optional<DisaggregationMode> ParseDisaggregationMode(std::string_view name) {
  for (DisaggregationMode mode : {DisaggregationMode::kNever, DisaggregationMode::kAlways, DisaggregationMode::kAuto}) {
    if (DisaggregationModeName(mode) == name) return mode;
  }
  return std::nullopt;
}

KeyLimitsConfig ApiKeyConfig::Limits(const KeyLimitsConfig& defaults) const {
  KeyLimitsConfig l = defaults;
  if (requests_per_s.has_value()) l.requests_per_s = *requests_per_s;
  if (tokens_per_min.has_value()) l.tokens_per_min = *tokens_per_min;
  if (max_concurrent.has_value()) l.max_concurrent = *max_concurrent;
  return l;
}

absl::Status ValidateRouterConfig(const RouterConfig& config) {
  return Validator([](const std::string&) { return std::string(); }).Validate(config);
}

absl::StatusOr<RouterConfig> ParseRouterConfig(std::string_view yaml, const std::string& name_for_errors) {
  return Parser(name_for_errors).Parse(yaml);
}

absl::StatusOr<RouterConfig> LoadRouterConfig(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) {
    // NotFound stays NotFound; any other failure to read is a bad config.
    const absl::StatusCode code = text.status().code() == absl::StatusCode::kNotFound
                                      ? absl::StatusCode::kNotFound
                                      : absl::StatusCode::kInvalidArgument;
    return absl::Status(code, absl::StrCat("router config: ", text.status().message()));
  }
  return ParseRouterConfig(*text, path);
}

}  // namespace tandem::router

namespace tandem::router {
namespace {

// The shortest text of `v` that reads back as `v` (yaml-cpp's emitter
// always writes 17 digits: 0.2 as 0.20000000000000001).
std::string ShortestDouble(double v) {
  char buf[32];
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

void Pair(YAML::Emitter& out, const char* key, double value) {
  out << YAML::Key << key << YAML::Value << ShortestDouble(value);
}
void Pair(YAML::Emitter& out, const char* key, const std::string& value) {
  out << YAML::Key << key << YAML::Value << YAML::DoubleQuoted << value;
}
template <typename T>
void Pair(YAML::Emitter& out, const char* key, const T& value) {
  out << YAML::Key << key << YAML::Value << value;
}

void Pool(YAML::Emitter& out, const char* role, const PoolConfig& pool) {
  out << YAML::Key << role << YAML::Value << YAML::BeginMap;
  if (!pool.workers.empty() || !pool.discovery.has_value()) {
    out << YAML::Key << "workers" << YAML::Value << YAML::Flow << YAML::BeginSeq;
    for (const std::string& w : pool.workers) out << YAML::DoubleQuoted << w;
    out << YAML::EndSeq;
  }
  if (pool.discovery.has_value()) {
    out << YAML::Key << "discovery" << YAML::Value << YAML::BeginMap;
    Pair(out, "dns", pool.discovery->dns);
    Pair(out, "port", pool.discovery->port);
    Pair(out, "interval_s", pool.discovery->interval_s);
    out << YAML::EndMap;
  }
  out << YAML::Key << "policy" << YAML::Value << YAML::BeginMap;
  Pair(out, "name", pool.policy.name);
  if (!pool.policy.params.empty()) {
    out << YAML::Key << "params" << YAML::Value << YAML::BeginMap;
    for (const auto& [k, v] : pool.policy.params) Pair(out, k.c_str(), v);
    out << YAML::EndMap;
  }
  out << YAML::EndMap << YAML::EndMap;
}

std::string Deadline(const AttemptDeadlineConfig& d) { return d.automatic ? "auto" : ShortestDouble(d.seconds); }

}  // namespace

std::string SerializeRouterConfig(const RouterConfig& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "listener" << YAML::Value << YAML::BeginMap;
  Pair(out, "host", c.listener.host);
  Pair(out, "port", c.listener.port);
  out << YAML::EndMap;
  out << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  Pair(out, "served_name", c.model.served_name);
  Pair(out, "tokenizer", c.model.tokenizer);
  if (!c.model.chat_template.empty()) Pair(out, "chat_template", c.model.chat_template);
  Pair(out, "parse_special_tokens_in_messages", c.model.parse_special_tokens_in_messages);
  out << YAML::EndMap;
  out << YAML::Key << "pools" << YAML::Value << YAML::BeginMap;
  if (c.prefill.has_value()) Pool(out, "prefill", *c.prefill);
  if (c.decode.has_value()) Pool(out, "decode", *c.decode);
  out << YAML::EndMap;
  out << YAML::Key << "disaggregation" << YAML::Value << YAML::BeginMap;
  Pair(out, "mode", std::string(DisaggregationModeName(c.disaggregation.mode)));
  Pair(out, "auto_threshold_tokens", c.disaggregation.auto_threshold_tokens);
  out << YAML::EndMap;
  out << YAML::Key << "timeouts" << YAML::Value << YAML::BeginMap;
  Pair(out, "first_token_s", c.timeouts.first_token_s);
  Pair(out, "idle_stream_s", c.timeouts.idle_stream_s);
  Pair(out, "request_s", c.timeouts.request_s);
  out << YAML::EndMap;
  out << YAML::Key << "retries" << YAML::Value << YAML::BeginMap;
  Pair(out, "max_attempts", c.retries.max_attempts);
  Pair(out, "budget_ratio", c.retries.budget_ratio);
  out << YAML::Key << "attempt_first_token_s" << YAML::Value << Deadline(c.retries.attempt_first_token);
  out << YAML::Key << "attempt_idle_s" << YAML::Value << Deadline(c.retries.attempt_idle);
  Pair(out, "auto_multiplier", c.retries.auto_multiplier);
  Pair(out, "auto_floor_s", c.retries.auto_floor_s);
  Pair(out, "max_failovers", c.retries.max_failovers);
  Pair(out, "wait_for_worker_s", c.retries.wait_for_worker_s);
  out << YAML::EndMap;
  out << YAML::Key << "limits" << YAML::Value << YAML::BeginMap;
  Pair(out, "max_body_bytes", c.limits.max_body_bytes);
  Pair(out, "max_queue", c.limits.max_queue);
  Pair(out, "max_in_flight", c.limits.max_in_flight);
  Pair(out, "max_connections", c.limits.max_connections);
  out << YAML::EndMap;
  out << YAML::Key << "health" << YAML::Value << YAML::BeginMap;
  Pair(out, "interval_s", c.health.interval_s);
  Pair(out, "timeout_s", c.health.timeout_s);
  Pair(out, "unhealthy_after", c.health.unhealthy_after);
  Pair(out, "healthy_after", c.health.healthy_after);
  out << YAML::EndMap;
  out << YAML::Key << "kv_events" << YAML::Value << YAML::BeginMap;
  Pair(out, "enabled", c.kv_events.enabled);
  out << YAML::EndMap;
  out << YAML::Key << "sessions" << YAML::Value << YAML::BeginMap;
  Pair(out, "header", c.sessions.header);
  out << YAML::EndMap;
  if (c.tls.mode != TlsMode::kUnset) {
    out << YAML::Key << "tls" << YAML::Value << YAML::BeginMap;
    Pair(out, "mode", std::string(c.tls.mode == TlsMode::kMutual ? "mutual" : "insecure"));
    if (c.tls.mode == TlsMode::kMutual) {
      Pair(out, "ca", c.tls.ca);
      Pair(out, "cert", c.tls.cert);
      Pair(out, "key", c.tls.key);
    }
    out << YAML::EndMap;
  }
  out << YAML::Key << "auth" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "limits_per_key" << YAML::Value << YAML::BeginMap;
  Pair(out, "requests_per_s", c.auth.limits_per_key.requests_per_s);
  Pair(out, "tokens_per_min", c.auth.limits_per_key.tokens_per_min);
  Pair(out, "max_concurrent", c.auth.limits_per_key.max_concurrent);
  out << YAML::EndMap;
  if (!c.auth.keys.empty()) {
    out << YAML::Key << "keys" << YAML::Value << YAML::BeginSeq;
    for (const ApiKeyConfig& k : c.auth.keys) {
      out << YAML::BeginMap;
      Pair(out, "name", k.name);
      Pair(out, "sha256", absl::StrCat("sha256:", k.sha256));
      Pair(out, "admin", k.admin);
      Pair(out, "priority", k.priority);
      if (k.requests_per_s) Pair(out, "requests_per_s", *k.requests_per_s);
      if (k.tokens_per_min) Pair(out, "tokens_per_min", *k.tokens_per_min);
      if (k.max_concurrent) Pair(out, "max_concurrent", *k.max_concurrent);
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::EndMap;
  out << YAML::Key << "debug" << YAML::Value << YAML::BeginMap;
  Pair(out, "worker_details", c.debug.worker_details);
  out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace tandem::router
