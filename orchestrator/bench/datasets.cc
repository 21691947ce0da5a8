#include "orchestrator/bench/datasets.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace tandem::bench {
namespace {

// True if `s` is valid UTF-8 made of printable characters (spaces allowed,
// no control characters).
bool PrintableUtf8(std::string_view s) {
  if (s.empty()) return false;
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      len = 1;
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (int k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp < 0xA0)) return false;
    i += len;
  }
  return true;
}

class TokenSource {
 public:
  TokenSource(const std::vector<int32_t>& alphabet, uint64_t seed)
      : alphabet_(alphabet), rng_(seed), pick_(0, alphabet.size() - 1) {}
  std::vector<int32_t> Draw(int n) {
    std::vector<int32_t> out(static_cast<size_t>(std::max(0, n)));
    for (int32_t& t : out) t = alphabet_[pick_(rng_)];
    return out;
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  const std::vector<int32_t>& alphabet_;
  std::mt19937_64 rng_;
  std::uniform_int_distribution<size_t> pick_;
};

// A length around `len`: uniform in [len (1 - r), len (1 + r)], at least 1.
int Around(int len, double r, std::mt19937_64& rng) {
  const int lo = std::max(1, static_cast<int>(std::floor(len * (1.0 - r))));
  const int hi = std::max(lo, static_cast<int>(std::ceil(len * (1.0 + r))));
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

absl::Status CheckPositive(const char* name, int v) {
  if (v < 1) return absl::InvalidArgumentError(absl::StrFormat("%s must be >= 1, got %d", name, v));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Session>> Random(const DatasetOptions& o, TokenSource& src) {
  RETURN_IF_ERROR(CheckPositive("--random-input-len", o.input_len));
  RETURN_IF_ERROR(CheckPositive("--random-output-len", o.output_len));
  if (!(o.range_ratio >= 0 && o.range_ratio < 1)) {
    return absl::InvalidArgumentError(absl::StrFormat("--random-range-ratio must be in [0, 1), got %g", o.range_ratio));
  }
  std::vector<Session> out;
  for (int i = 0; i < o.num_prompts; ++i) {
    const int in = Around(o.input_len, o.range_ratio, src.rng());
    const int max_tokens = Around(o.output_len, o.range_ratio, src.rng());
    out.push_back(Session{.turns = {Turn{.tokens = src.Draw(in), .max_tokens = max_tokens}}});
  }
  return out;
}

absl::StatusOr<std::vector<Session>> SharedPrefix(const DatasetOptions& o, TokenSource& src) {
  RETURN_IF_ERROR(CheckPositive("--num-groups", o.num_groups));
  RETURN_IF_ERROR(CheckPositive("--prefix-len", o.prefix_len));
  RETURN_IF_ERROR(CheckPositive("--suffix-len", o.suffix_len));
  RETURN_IF_ERROR(CheckPositive("--output-len", o.output_len));
  std::vector<std::vector<int32_t>> prefixes;
  for (int g = 0; g < o.num_groups; ++g) prefixes.push_back(src.Draw(o.prefix_len));
  std::vector<int> groups;
  for (int i = 0; i < o.num_prompts; ++i) groups.push_back(i % o.num_groups);
  std::shuffle(groups.begin(), groups.end(), src.rng());
  std::vector<Session> out;
  for (int g : groups) {
    std::vector<int32_t> tokens = prefixes[g];
    const std::vector<int32_t> suffix = src.Draw(o.suffix_len);
    tokens.insert(tokens.end(), suffix.begin(), suffix.end());
    out.push_back(Session{.turns = {Turn{.tokens = std::move(tokens), .max_tokens = o.output_len}}});
  }
  return out;
}

absl::StatusOr<std::vector<Session>> MultiTurn(const DatasetOptions& o, TokenSource& src) {
  RETURN_IF_ERROR(CheckPositive("--turns", o.turns));
  RETURN_IF_ERROR(CheckPositive("--user-len", o.user_len));
  RETURN_IF_ERROR(CheckPositive("--output-len", o.output_len));
  if (o.system_len < 0) return absl::InvalidArgumentError("--system-len must be >= 0");
  if (o.common_prefix_len < 0) {
    return absl::InvalidArgumentError("--common-prefix-len must be >= 0");
  }
  const int sessions = (o.num_prompts + o.turns - 1) / o.turns;
  const std::vector<int32_t> common = src.Draw(o.common_prefix_len);
  std::uniform_int_distribution<uint64_t> id_bits;
  std::vector<Session> out;
  for (int s = 0; s < sessions; ++s) {
    Session session{.id = absl::StrFormat("bench-%d-%016x", s, id_bits(src.rng())), .system = common};
    const std::vector<int32_t> own = src.Draw(o.system_len);
    session.system.insert(session.system.end(), own.begin(), own.end());
    for (int t = 0; t < o.turns; ++t) {
      session.turns.push_back(Turn{.tokens = src.Draw(o.user_len), .max_tokens = o.output_len});
    }
    out.push_back(std::move(session));
  }
  return out;
}

absl::StatusOr<std::vector<Session>> ShareGpt(const DatasetOptions& o, const Tokenizer& tok, std::mt19937_64& rng) {
  if (o.path.empty()) return absl::InvalidArgumentError("--dataset sharegpt needs --dataset-path");
  ASSIGN_OR_RETURN(std::string text, ReadFile(o.path));
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(o.path, ": not a ShareGPT file (a JSON array of conversations)"));
  }
  std::vector<size_t> order(doc.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<Session> out;
  for (size_t i : order) {
    if (static_cast<int>(out.size()) >= o.num_prompts) break;
    const nlohmann::json& conv =
        doc[i].is_object() ? doc[i].value("conversations", nlohmann::json()) : nlohmann::json();
    if (!conv.is_array() || conv.size() < 2 || !conv[0].is_object() || !conv[1].is_object()) continue;
    const nlohmann::json& q = conv[0].value("value", nlohmann::json());
    const nlohmann::json& a = conv[1].value("value", nlohmann::json());
    if (!q.is_string() || !a.is_string()) continue;
    std::vector<int32_t> prompt = tok.Encode(q.get<std::string>(), /*add_special_tokens=*/false);
    const int answer = static_cast<int>(tok.Encode(a.get<std::string>(), false).size());
    if (prompt.size() < 4 || answer < 4) continue;
    const int max_tokens = o.sharegpt_output_len > 0 ? o.sharegpt_output_len : answer;
    out.push_back(Session{.turns = {Turn{.tokens = std::move(prompt), .max_tokens = max_tokens}}});
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(o.path, ": no usable conversation"));
  return out;
}

absl::StatusOr<std::vector<Session>> Trace(const DatasetOptions& o, const std::vector<int32_t>& alphabet) {
  if (o.path.empty()) return absl::InvalidArgumentError("--dataset trace needs --dataset-path");
  RETURN_IF_ERROR(CheckPositive("--trace-block-tokens", o.trace_block_tokens));
  if (!(o.trace_speedup > 0)) return absl::InvalidArgumentError("--trace-speedup must be > 0");
  std::ifstream in(o.path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", o.path));
  std::vector<Session> out;
  std::string line;
  int lineno = 0;
  double first_ms = -1;
  while (std::getline(in, line) && static_cast<int>(out.size()) < o.num_prompts) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrFormat("%s:%d: %s", o.path, lineno, why));
    };
    if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
    if (!j.contains("timestamp") || !j["timestamp"].is_number()) return bad("timestamp must be a number");
    // Lengths are whole token counts; a float such as 1e30 would not convert
    // to int (undefined behaviour), and a huge one would allocate its prompt.
    constexpr int64_t kMaxTraceTokens = 1 << 20;
    for (const char* key : {"input_length", "output_length"}) {
      if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 1 ||
          j[key].get<int64_t>() > kMaxTraceTokens) {
        return bad(absl::StrCat(key, " must be an integer from 1 to ", kMaxTraceTokens));
      }
    }
    const double ts = j["timestamp"].get<double>();
    const int input = static_cast<int>(j["input_length"].get<int64_t>());
    const int output = static_cast<int>(j["output_length"].get<int64_t>());
    std::vector<uint64_t> hashes;
    if (j.contains("hash_ids")) {
      if (!j["hash_ids"].is_array()) return bad("hash_ids must be an array");
      for (const nlohmann::json& h : j["hash_ids"]) {
        if (!h.is_number_integer()) return bad("hash_ids must hold integers");
        hashes.push_back(h.get<uint64_t>());
      }
    }
    // Block k of the prompt comes from hash_ids[k]'s generator; blocks past
    // the list come from the line's own.
    std::vector<int32_t> tokens;
    for (size_t k = 0; static_cast<int>(tokens.size()) < input; ++k) {
      const uint64_t seed =
          k < hashes.size() ? hashes[k] * 0x9E3779B97F4A7C15ull + 1 : (uint64_t{0x5EED} << 32) ^ (lineno * 131 + k);
      TokenSource block(alphabet, seed ^ o.seed);
      const int n = std::min(o.trace_block_tokens, input - static_cast<int>(tokens.size()));
      const std::vector<int32_t> b = block.Draw(n);
      tokens.insert(tokens.end(), b.begin(), b.end());
    }
    if (first_ms < 0) first_ms = ts;
    out.push_back(Session{.turns = {Turn{.tokens = std::move(tokens), .max_tokens = output}},
                          .arrival_s = (ts - first_ms) / 1000.0 / o.trace_speedup});
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(o.path, ": no request"));
  return out;
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> TextSafeIds(const Tokenizer& tokenizer) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (tokenizer.IsSpecial(id) || !tokenizer.IdToToken(id).has_value()) continue;
    const int32_t one[] = {id};
    const std::string text = tokenizer.Decode(one, /*skip_special_tokens=*/true);
    if (!PrintableUtf8(text)) continue;
    // A token that its own text does not encode back to (the built-in large
    // presets' fillers, which no text encodes to) would multiply the length of
    // a prompt sent as text.
    const std::vector<int32_t> back = tokenizer.Encode(text, /*add_special_tokens=*/false);
    if (back.size() == 1 && back[0] == id) ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError("the tokenizer has no text-safe token");
  return ids;
}

absl::StatusOr<std::vector<Session>> BuildDataset(const DatasetOptions& options, const Tokenizer& tokenizer) {
  RETURN_IF_ERROR(CheckPositive("--num-prompts", options.num_prompts));
  ASSIGN_OR_RETURN(const std::vector<int32_t> alphabet, TextSafeIds(tokenizer));
  TokenSource src(alphabet, options.seed);
  if (options.name == "random") return Random(options, src);
  if (options.name == "shared-prefix") return SharedPrefix(options, src);
  if (options.name == "multi-turn") return MultiTurn(options, src);
  if (options.name == "sharegpt") return ShareGpt(options, tokenizer, src.rng());
  if (options.name == "trace") return Trace(options, alphabet);
  return absl::InvalidArgumentError(absl::StrFormat(
      "--dataset must be random, shared-prefix, multi-turn, sharegpt or trace, got '%s'", options.name));
}

}  // namespace tandem::bench
