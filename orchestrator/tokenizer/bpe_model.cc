#include "orchestrator/tokenizer/bpe_model.h"

#include <algorithm>
#include <functional>
#include <queue>

#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"
#include "orchestrator/tokenizer/json_steps.h"

namespace tandem::router {
namespace {

using nlohmann::json;

bool IsUnset(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() || (it->is_string() && it->get_ref<const std::string&>().empty()) ||
         (it->is_boolean() && !it->get<bool>());
}

// Splits one entry of "merges": "a b" or ["a", "b"].
absl::StatusOr<std::pair<std::string, std::string>> ParseMerge(const json& m, size_t index) {
  if (m.is_string()) {
    const auto& s = m.get_ref<const std::string&>();
    const size_t space = s.find(' ');
    if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
      return InvalidTokenizerJson(absl::StrCat("model.merges[", index, "]"),
                                  absl::StrCat("expected \"left right\", got \"", s, "\""));
    }
    return std::make_pair(s.substr(0, space), s.substr(space + 1));
  }
  if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
    return std::make_pair(m[0].get<std::string>(), m[1].get<std::string>());
  }
  return InvalidTokenizerJson(absl::StrCat("model.merges[", index, "]"),
                              "expected a \"left right\" string or a [left, right] pair");
}

}  // namespace

std::string ByteFallbackToken(unsigned char byte) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  return std::string{'<', '0', 'x', kHex[byte >> 4], kHex[byte & 15], '>'};
}

std::optional<unsigned char> ParseByteFallbackToken(std::string_view token) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return std::nullopt;
  const int hi = hex(token[3]), lo = hex(token[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<unsigned char>(hi * 16 + lo);
}

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::Create(const json& model) {
  auto m = std::unique_ptr<BpeModel>(new BpeModel());
  if (!IsUnset(model, "dropout") && !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0)) {
    return InvalidTokenizerJson("model.dropout", "BPE dropout is not supported");
  }
  if (!IsUnset(model, "continuing_subword_prefix")) {
    return InvalidTokenizerJson("model.continuing_subword_prefix", "subword prefixes are not supported");
  }
  if (!IsUnset(model, "end_of_word_suffix")) {
    return InvalidTokenizerJson("model.end_of_word_suffix", "end-of-word suffixes are not supported");
  }
  m->ignore_merges_ = model.value("ignore_merges", false);
  m->fuse_unk_ = model.value("fuse_unk", false);

  const auto vocab = model.find("vocab");
  if (vocab == model.end() || !vocab->is_object()) {
    return InvalidTokenizerJson("model.vocab", "expected an object of token -> id");
  }
  m->vocab_.reserve(vocab->size());
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kMaxTokenId) {
      return InvalidTokenizerJson(absl::StrCat("model.vocab[\"", token, "\"]"),
                                  absl::StrCat("expected an id in [0, ", kMaxTokenId, "]"));
    }
    const auto i = id.get<int32_t>();
    m->vocab_.emplace(token, i);
    max_id = std::max(max_id, i);
  }
  m->id_to_token_.resize(max_id + 1);
  for (const auto& [token, id] : m->vocab_) m->id_to_token_[id] = token;

  const auto merges = model.find("merges");
  if (merges == model.end() || !merges->is_array()) {
    return InvalidTokenizerJson("model.merges", "expected an array");
  }
  m->merges_.reserve(merges->size());
  for (size_t i = 0; i < merges->size(); ++i) {
    auto pair = ParseMerge((*merges)[i], i);
    if (!pair.ok()) return pair.status();
    const auto& [left, right] = *pair;
    auto l = m->vocab_.find(left), r = m->vocab_.find(right), n = m->vocab_.find(left + right);
    if (l == m->vocab_.end() || r == m->vocab_.end() || n == m->vocab_.end()) {
      return InvalidTokenizerJson(
          absl::StrCat("model.merges[", i, "]"),
          absl::StrCat("\"", left, "\", \"", right, "\" or their concatenation is not in the vocab"));
    }
    // The first occurrence of a pair wins, as in the Rust crate.
    m->merges_.try_emplace(PairKey(l->second, r->second), Merge{static_cast<int32_t>(i), n->second});
  }

  if (!IsUnset(model, "unk_token")) {
    if (!model["unk_token"].is_string()) return InvalidTokenizerJson("model.unk_token", "expected a string");
    auto it = m->vocab_.find(model["unk_token"].get<std::string>());
    if (it == m->vocab_.end()) return InvalidTokenizerJson("model.unk_token", "not in the vocab");
    m->unk_id_ = it->second;
  }

  if (model.contains("byte_fallback") && !model["byte_fallback"].is_null()) {
    if (!model["byte_fallback"].is_boolean()) return InvalidTokenizerJson("model.byte_fallback", "expected a boolean");
    m->byte_fallback_ = model["byte_fallback"].get<bool>();
  }
  m->byte_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    if (auto id = m->TokenToId(ByteFallbackToken(static_cast<unsigned char>(b)))) m->byte_ids_[b] = *id;
  }
  return m;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = vocab_.find(absl::string_view(token.data(), token.size()));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto id = TokenToId(word)) {
      ids->push_back(*id);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  const absl::string_view key(word.data(), word.size());
  CacheShard& shard = cache_[absl::Hash<absl::string_view>()(key) % kCacheShards];
  if (cacheable) {
    absl::MutexLock lock(&shard.mu);
    auto it = shard.words.find(key);
    if (it != shard.words.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = ids->size();
  MergeWord(word, ids);
  if (cacheable) {
    absl::MutexLock lock(&shard.mu);
    if (shard.words.size() < kCacheCapacity / kCacheShards) {
      shard.words.try_emplace(key, ids->begin() + start, ids->end());
    }
  }
}

void BpeModel::MergeWord(std::string_view word, std::vector<int32_t>* ids) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&symbols](int32_t id) {
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back(Symbol{id, n - 1, n + 1, true});
  };
  // As in the Rust crate's merge_word: an unk is held back so that the next
  // unknown character can fuse into it (fuse_unk); a known character flushes
  // it, byte-fallback tokens do not (so they land before it).
  bool pending_unk = false;
  size_t i = 0;
  while (i < word.size()) {
    int len = Utf8SequenceLength(word.substr(i));
    if (len <= 0) len = 1;  // input is sanitized upstream; be safe anyway
    const std::string_view ch = word.substr(i, len);
    i += len;
    auto it = vocab_.find(absl::string_view(ch.data(), ch.size()));
    if (it != vocab_.end()) {
      if (pending_unk) add(*unk_id_);
      pending_unk = false;
      add(it->second);
      continue;
    }
    if (byte_fallback_ &&
        std::all_of(ch.begin(), ch.end(), [&](char c) { return byte_ids_[static_cast<unsigned char>(c)] >= 0; })) {
      for (char c : ch) add(byte_ids_[static_cast<unsigned char>(c)]);
      continue;
    }
    if (!unk_id_) continue;  // dropped, as the Rust crate does without an unk token
    if (pending_unk && !fuse_unk_) add(*unk_id_);
    pending_unk = true;
  }
  if (pending_unk) add(*unk_id_);
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    auto it = merges_.find(PairKey(symbols[pos].id, symbols[next].id));
    if (it != merges_.end()) queue.push(Candidate{it->second.rank, pos, it->second.new_id});
  };
  for (int32_t p = 0; p + 1 < static_cast<int32_t>(symbols.size()); ++p) push_pair(p);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    // Skip stale candidates: the pair at `pos` changed since it was queued.
    auto it = merges_.find(PairKey(left.id, right.id));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  for (const Symbol& s : symbols) {
    if (s.alive) ids->push_back(s.id);
  }
}

}  // namespace tandem::router
