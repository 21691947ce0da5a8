#include "orchestrator/tokenizer/tokenizer.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"
#include "orchestrator/tokenizer/byte_level.h"
#include "orchestrator/tokenizer/json_steps.h"

namespace tandem::router {
namespace {

using nlohmann::json;

// The nesting depth of `j` (a scalar is 0), without recursion.
int JsonDepth(const json& j) {
  int max_depth = 0;
  std::vector<std::pair<const json*, int>> stack = {{&j, 0}};
  while (!stack.empty()) {
    const auto [node, depth] = stack.back();
    stack.pop_back();
    max_depth = std::max(max_depth, depth);
    if (node->is_structured()) {
      for (const json& child : *node) stack.emplace_back(&child, depth + 1);
    }
  }
  return max_depth;
}

std::string TypeOf(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& tokenizer_json_path,
                                                               std::string* json) {
  absl::StatusOr<std::string> text = ReadFile(tokenizer_json_path);
  if (!text.ok()) {
    return absl::NotFoundError(absl::StrCat("cannot read the tokenizer file: ", text.status().message()));
  }
  auto tokenizer = FromJson(*text);
  if (!tokenizer.ok()) {
    return absl::Status(tokenizer.status().code(),
                        absl::StrCat(tokenizer_json_path, ": ", tokenizer.status().message()));
  }
  if (json != nullptr) *json = *std::move(text);
  return tokenizer;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json_text) {
  auto tokenizer = std::unique_ptr<Tokenizer>(new Tokenizer());
  try {
    RETURN_IF_ERROR(tokenizer->Load(json_text));
  } catch (const json::exception& e) {  // a value of an unexpected JSON type
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", e.what()));
  }
  return tokenizer;
}

absl::Status Tokenizer::Load(std::string_view json_text) {
  const json root = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("tokenizer.json: not valid JSON");
  if (!root.is_object()) return InvalidTokenizerJson("(root)", "expected an object");
  if (JsonDepth(root) > kMaxTokenizerJsonDepth) {
    return InvalidTokenizerJson("(root)", absl::StrCat("nested deeper than ", kMaxTokenizerJsonDepth, " levels"));
  }
  for (const char* key : {"truncation", "padding"}) {
    if (root.contains(key) && !root[key].is_null()) {
      return InvalidTokenizerJson(key, "must be null: the router encodes whole texts without padding");
    }
  }

  // Model.
  const auto model = root.find("model");
  if (model == root.end() || !model->is_object()) return InvalidTokenizerJson("model", "missing");
  const std::string model_type = model->value("type", "BPE");  // old files omit it for BPE
  if (model_type != "BPE") {
    return InvalidTokenizerJson("model.type", absl::StrCat("unsupported model \"", model_type, "\" (supported: BPE)"));
  }
  ASSIGN_OR_RETURN(model_, BpeModel::Create(*model));

  ASSIGN_OR_RETURN(normalizer_, Normalizer::Create(root.value("normalizer", json())));
  ASSIGN_OR_RETURN(pre_tokenizer_, PreTokenizer::Create(root.value("pre_tokenizer", json())));

  // Added tokens.
  id_to_token_ = model_->id_to_token();
  const json added = root.value("added_tokens", json::array());
  if (!added.is_array()) return InvalidTokenizerJson("added_tokens", "expected an array");
  trie_.assign(1, TrieNode());
  for (size_t i = 0; i < added.size(); ++i) {
    const json& t = added[i];
    const std::string path = absl::StrCat("added_tokens[", i, "]");
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || t["id"].get<int64_t>() < 0 ||
        t["id"].get<int64_t>() > kMaxTokenId || !t.contains("content") || !t["content"].is_string()) {
      return InvalidTokenizerJson(
          path, absl::StrCat("expected {\"id\": int in [0, ", kMaxTokenId, "], \"content\": string, ...}"));
    }
    for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
      if (t.value(flag, false)) return InvalidTokenizerJson(absl::StrCat(path, ".", flag), "is not supported yet");
    }
    AddedToken token{t["content"].get<std::string>(), t["id"].get<int32_t>(), t.value("special", false)};
    // `tokenizers` matches normalized tokens (the default for non-special
    // ones) in the normalized text; only raw-text matching is implemented,
    // which is the same thing when the normalizer does nothing.
    if (t.value("normalized", !token.special) && !normalizer_.is_identity()) {
      return InvalidTokenizerJson(path + ".normalized", "normalized added tokens are not supported with a normalizer");
    }
    if (token.content.empty()) return InvalidTokenizerJson(path + ".content", "must not be empty");
    if (token.id >= static_cast<int32_t>(id_to_token_.size())) id_to_token_.resize(token.id + 1);
    id_to_token_[token.id] = token.content;
    added_ids_[token.content] = token.id;
    int32_t node = 0;
    for (unsigned char c : token.content) {
      auto it = trie_[node].children.find(c);
      if (it == trie_[node].children.end()) {
        trie_.emplace_back();
        it = trie_[node].children.emplace(c, static_cast<int32_t>(trie_.size() - 1)).first;
      }
      node = it->second;
    }
    trie_[node].added_index = static_cast<int32_t>(added_.size());
    added_.push_back(std::move(token));
  }
  special_.assign(id_to_token_.size(), false);
  for (const AddedToken& t : added_) special_[t.id] = t.special;

  // Post-processor: only the template for a single sequence matters here.
  std::function<absl::Status(const json&, const std::string&)> add_post;
  add_post = [&](const json& pp, const std::string& path) -> absl::Status {
    if (pp.is_null()) return absl::OkStatus();
    const std::string type = TypeOf(pp);
    if (type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets
    if (type == "Sequence") {
      const json procs = pp.value("processors", json());
      if (!procs.is_array()) return InvalidTokenizerJson(path + ".processors", "expected an array");
      for (size_t i = 0; i < procs.size(); ++i) {
        RETURN_IF_ERROR(add_post(procs[i], absl::StrCat(path, ".processors[", i, "]")));
      }
      return absl::OkStatus();
    }
    if (type != "TemplateProcessing") {
      return InvalidTokenizerJson(path + ".type", absl::StrCat("unsupported post-processor \"", type, "\""));
    }
    const json single = pp.value("single", json());
    if (!single.is_array()) return InvalidTokenizerJson(path + ".single", "expected an array");
    const json specials = pp.value("special_tokens", json::object());
    bool seen_sequence = false;
    prefix_ids_.clear();
    suffix_ids_.clear();
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string item_path = absl::StrCat(path, ".single[", i, "]");
      const json& item = single[i];
      if (item.contains("Sequence")) {
        if (seen_sequence) return InvalidTokenizerJson(item_path, "more than one sequence in the single template");
        seen_sequence = true;
        continue;
      }
      if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id")) {
        return InvalidTokenizerJson(item_path, "expected a Sequence or a SpecialToken");
      }
      const std::string name = item["SpecialToken"]["id"].get<std::string>();
      if (!specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array()) {
        return InvalidTokenizerJson(absl::StrCat(path, ".special_tokens[\"", name, "\"]"), "missing or without ids");
      }
      const json& ids = specials[name]["ids"];
      for (size_t k = 0; k < ids.size(); ++k) {
        // The template's ids go to the workers as they are: each must be a
        // token of this vocabulary (a stray id once reached Encode's output).
        if (!ids[k].is_number_integer() || ids[k].get<int64_t>() < 0 ||
            ids[k].get<int64_t>() >= static_cast<int64_t>(id_to_token_.size())) {
          return InvalidTokenizerJson(
              absl::StrCat(path, ".special_tokens[\"", name, "\"].ids[", k, "]"),
              absl::StrCat("expected an id in the vocabulary [0, ", id_to_token_.size(), "), got ", ids[k].dump()));
        }
        (seen_sequence ? suffix_ids_ : prefix_ids_).push_back(ids[k].get<int32_t>());
      }
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(add_post(root.value("post_processor", json()), "post_processor"));

  // Decoder: precompute the bytes each id decodes to.
  const json decoder = root.value("decoder", json());
  const std::string decoder_type = TypeOf(decoder);
  if (decoder_type == "ByteLevel" && !pre_tokenizer_.byte_level()) {
    return InvalidTokenizerJson("decoder", "a ByteLevel decoder needs a ByteLevel pre-tokenizer");
  }
  if (!decoder.is_null() && decoder_type != "ByteLevel") {
    ASSIGN_OR_RETURN(Decoder d, Decoder::Create(decoder));
    decoder_ = std::move(d);
    if (decoder_->first_token_differs()) {
      id_to_first_bytes_.assign(id_to_token_.size(), std::string());
      for (size_t id = 0; id < id_to_token_.size(); ++id) {
        id_to_first_bytes_[id] = decoder_->TokenBytes(id_to_token_[id], /*first=*/true);
      }
    }
  }
  id_to_bytes_.assign(id_to_token_.size(), std::string());
  for (size_t id = 0; id < id_to_token_.size(); ++id) {
    if (decoder_) {
      id_to_bytes_[id] = decoder_->TokenBytes(id_to_token_[id], /*first=*/false);  // added tokens too, as in HF
    } else if (decoder_type == "ByteLevel" && added_ids_.find(id_to_token_[id]) == added_ids_.end()) {
      ByteLevelDecode(id_to_token_[id], &id_to_bytes_[id]);
    } else {
      id_to_bytes_[id] = id_to_token_[id];  // added tokens decode verbatim
    }
  }
  return absl::OkStatus();
}

size_t Tokenizer::MatchAddedToken(std::string_view text, size_t pos, int32_t* id) const {
  int32_t node = 0;
  size_t best = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto& children = trie_[node].children;
    auto it = children.find(static_cast<unsigned char>(text[i]));
    if (it == children.end()) break;
    node = it->second;
    if (trie_[node].added_index >= 0) {
      best = i + 1 - pos;
      *id = added_[trie_[node].added_index].id;
    }
  }
  return best;
}

void Tokenizer::EncodeSegment(std::string_view segment, bool at_text_start, std::vector<int32_t>* ids) const {
  if (segment.empty()) return;
  std::string text(segment);
  normalizer_.Normalize(&text);
  std::vector<std::string> words;
  pre_tokenizer_.PreTokenize(text, at_text_start, &words);
  for (const std::string& word : words) model_->Tokenize(word, ids);
}

namespace {

// `segment` without single escape marks; a doubled mark becomes one.
std::string Unescape(std::string_view segment) {
  constexpr std::string_view kMark = Tokenizer::kEscapeMark;
  std::string out;
  out.reserve(segment.size());
  size_t pos = 0;
  while (pos < segment.size()) {
    const size_t mark = segment.find(kMark, pos);
    if (mark == std::string_view::npos) {
      out.append(segment.substr(pos));
      break;
    }
    out.append(segment.substr(pos, mark - pos));
    pos = mark + kMark.size();
    if (segment.substr(pos, kMark.size()) == kMark) {
      out.append(kMark);
      pos += kMark.size();
    }
  }
  return out;
}

}  // namespace

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  return EncodeImpl(text, add_special_tokens, /*escaped=*/false);
}

std::vector<int32_t> Tokenizer::EncodeEscaped(std::string_view text, bool add_special_tokens) const {
  return EncodeImpl(text, add_special_tokens, /*escaped=*/true);
}

std::string Tokenizer::EscapeSpecialTokens(std::string_view text) const {
  std::string out;
  out.reserve(text.size() + 16);
  size_t pos = 0;
  while (pos < text.size()) {
    if (text.substr(pos, kEscapeMark.size()) == kEscapeMark) {
      out.append(kEscapeMark);
      out.append(kEscapeMark);
      pos += kEscapeMark.size();
      continue;
    }
    int32_t id = -1;
    const size_t len = trie_[0].children.empty() ? 0 : MatchAddedToken(text, pos, &id);
    if (len == 0) {
      out.push_back(text[pos++]);
      continue;
    }
    const std::string_view token = text.substr(pos, len);
    pos += len;
    if (!special_[id]) {
      out.append(token);  // a non-special added token keeps its meaning, as in HF
      continue;
    }
    for (size_t i = 0; i < token.size(); ++i) {
      out.push_back(token[i]);
      const bool next_starts_char = i + 1 < token.size() && (static_cast<unsigned char>(token[i + 1]) & 0xC0) != 0x80;
      if (next_starts_char) out.append(kEscapeMark);
    }
  }
  return out;
}

std::vector<int32_t> Tokenizer::EncodeImpl(std::string_view text, bool add_special_tokens, bool escaped) const {
  std::string repaired;
  if (!IsValidUtf8(text)) {
    AppendValidUtf8(text, /*final=*/true, &repaired);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + prefix_ids_.size() + suffix_ids_.size() + 1);
  if (add_special_tokens) ids.insert(ids.end(), prefix_ids_.begin(), prefix_ids_.end());
  auto segment = [&](size_t start, size_t end) {
    std::string_view seg = text.substr(start, end - start);
    if (!escaped || seg.find(kEscapeMark) == std::string_view::npos) {
      EncodeSegment(seg, start == 0, &ids);
    } else {
      EncodeSegment(Unescape(seg), start == 0, &ids);
    }
  };
  size_t segment_start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    int32_t id = -1;
    const size_t len = trie_[0].children.empty() ? 0 : MatchAddedToken(text, pos, &id);
    if (len == 0) {
      ++pos;
      continue;
    }
    segment(segment_start, pos);
    ids.push_back(id);
    pos += len;
    segment_start = pos;
  }
  segment(segment_start, text.size());
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

void Tokenizer::AppendTokenBytes(int32_t id, bool skip_special_tokens, std::string* out) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_bytes_.size()) return;
  if (skip_special_tokens && special_[id]) return;
  out->append(id_to_bytes_[id]);
}

bool Tokenizer::Decodes(int32_t id, bool skip_special_tokens) const {
  return id >= 0 && static_cast<size_t>(id) < id_to_token_.size() && !id_to_token_[id].empty() &&
         !(skip_special_tokens && special_[id]);
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  if (decoder_) {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      if (Decodes(id, skip_special_tokens)) tokens.push_back(id_to_token_[id]);
    }
    std::string text = decoder_->Decode(std::move(tokens));
    if (IsValidUtf8(text)) return text;
    std::string repaired;
    AppendValidUtf8(text, /*final=*/true, &repaired);
    return repaired;
  }
  std::string bytes;
  for (int32_t id : ids) AppendTokenBytes(id, skip_special_tokens, &bytes);
  if (IsValidUtf8(bytes)) return bytes;
  std::string text;
  AppendValidUtf8(bytes, /*final=*/true, &text);
  return text;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  auto it = added_ids_.find(absl::string_view(token.data(), token.size()));
  if (it != added_ids_.end()) return it->second;
  return model_->TokenToId(token);
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || id_to_token_[id].empty()) return std::nullopt;
  return id_to_token_[id];
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < special_.size() && special_[id];
}

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer),
      skip_special_tokens_(skip_special_tokens),
      strip_left_(tokenizer.decoder_ ? tokenizer.decoder_->stream_strip().count : 0) {}

std::string IncrementalDetokenizer::Add(int32_t id) {
  if (first_ && !tokenizer_.id_to_first_bytes_.empty()) {
    if (tokenizer_.Decodes(id, skip_special_tokens_)) {
      pending_ += tokenizer_.id_to_first_bytes_[id];
      first_ = false;
    }
  } else {
    if (tokenizer_.Decodes(id, skip_special_tokens_)) first_ = false;
    tokenizer_.AppendTokenBytes(id, skip_special_tokens_, &pending_);
  }
  std::string out;
  const size_t consumed = AppendValidUtf8(pending_, /*final=*/false, &out);
  pending_.erase(0, consumed);
  StripStart(&out);
  return out;
}

std::string IncrementalDetokenizer::Flush() {
  std::string out;
  AppendValidUtf8(pending_, /*final=*/true, &out);
  pending_.clear();
  StripStart(&out);
  return out;
}

void IncrementalDetokenizer::StripStart(std::string* out) {
  if (strip_left_ == 0 || out->empty()) return;
  const std::string& c = tokenizer_.decoder_->stream_strip().content;
  size_t begin = 0;
  while (strip_left_ > 0 && begin < out->size()) {
    if (out->compare(begin, c.size(), c) != 0) {
      strip_left_ = 0;  // the text has started
      break;
    }
    begin += c.size();
    --strip_left_;
  }
  out->erase(0, begin);
}

}  // namespace tandem::router
