#include "orchestrator/tokenizer/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"
#include "orchestrator/tokenizer/byte_level.h"
#include "orchestrator/tokenizer/json_steps.h"

namespace tandem::router {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenization regex, used by ByteLevel when use_regex is set.
constexpr char kGpt2Pattern[] = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

absl::StatusOr<Regex> Regex::Compile(const std::string& pattern, bool literal) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  // PCRE2_LITERAL admits PCRE2_UTF but not PCRE2_UCP (which only affects
  // character classes anyway).
  const uint32_t options = literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(
        absl::StrCat("regex \"", pattern, "\" at offset ", offset, ": ", reinterpret_cast<const char*>(message)));
  }
  // JIT is an optimization only: without it pcre2_match interprets.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  Regex r;
  auto c = std::make_shared<Code>();
  c->code = code;
  r.code_ = std::move(c);
  return r;
}

void* Regex::NewMatchData() const { return pcre2_match_data_create_from_pattern(code_->code, nullptr); }
void Regex::FreeMatchData(void* md) { pcre2_match_data_free(static_cast<pcre2_match_data*>(md)); }

bool Regex::Next(std::string_view text, size_t start, void* md, size_t* begin, size_t* end) const {
  auto* data = static_cast<pcre2_match_data*>(md);
  // An empty match at `start` is followed by start + 1, which may fall inside
  // a character; move to the next character boundary first.
  while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
  if (start > text.size()) return false;
  int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start, PCRE2_NO_UTF_CHECK,
                       data, nullptr);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                     PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, data, nullptr);
  }
  if (rc < 0) {
    if (rc != PCRE2_ERROR_NOMATCH) LOG(WARNING) << "tokenizer regex match failed: error " << rc;
    return false;
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data);
  *begin = ov[0];
  *end = ov[1];
  return true;
}

absl::Status PreTokenizer::AddSteps(const json& config, const std::string& path, PreTokenizer* out) {
  if (config.is_null()) return absl::OkStatus();
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string()) {
    return InvalidTokenizerJson(path, "expected an object with a \"type\"");
  }
  const std::string type = config["type"].get<std::string>();
  if (type == "Sequence") {
    const auto it = config.find("pretokenizers");
    if (it == config.end() || !it->is_array())
      return InvalidTokenizerJson(path + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(AddSteps((*it)[i], absl::StrCat(path, ".pretokenizers[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  if (type == "Split") {
    if (config.value("invert", false))
      return InvalidTokenizerJson(path + ".invert", "inverted splits are not supported");
    const std::string behavior = config.value("behavior", "");
    if (behavior != "Isolated" && behavior != "Removed") {
      return InvalidTokenizerJson(path + ".behavior", absl::StrCat("unsupported split behavior \"", behavior, "\""));
    }
    const auto pattern = config.find("pattern");
    if (pattern == config.end() || !pattern->is_object())
      return InvalidTokenizerJson(path + ".pattern", "expected an object");
    bool literal;
    std::string text;
    if (pattern->contains("Regex") && (*pattern)["Regex"].is_string()) {
      literal = false;
      text = (*pattern)["Regex"].get<std::string>();
    } else if (pattern->contains("String") && (*pattern)["String"].is_string()) {
      literal = true;
      text = (*pattern)["String"].get<std::string>();
    } else {
      return InvalidTokenizerJson(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    auto regex = Regex::Compile(text, literal);
    if (!regex.ok()) return InvalidTokenizerJson(path + ".pattern", regex.status().message());
    out->steps_.push_back(SplitStep{*std::move(regex), behavior == "Removed"});
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    ByteLevelStep step{config.value("add_prefix_space", false), nullptr};
    if (config.value("use_regex", true)) {
      ASSIGN_OR_RETURN(Regex regex, Regex::Compile(kGpt2Pattern, false));
      step.regex = std::make_shared<const Regex>(std::move(regex));
    }
    out->steps_.push_back(std::move(step));
    out->byte_level_ = true;
    return absl::OkStatus();
  }
  if (type == "Metaspace") {
    MetaspaceStep step{config.value("replacement", "\xE2\x96\x81"), PrependScheme::kAlways,
                       config.value("split", true)};
    if (!IsOneCharacter(step.replacement)) {
      return InvalidTokenizerJson(path + ".replacement", "expected one character");
    }
    ASSIGN_OR_RETURN(step.prepend, ParsePrependScheme(config, path));
    out->steps_.push_back(std::move(step));
    return absl::OkStatus();
  }
  return InvalidTokenizerJson(path + ".type", absl::StrCat("unsupported pre-tokenizer \"", type, "\""));
}

absl::StatusOr<PreTokenizer> PreTokenizer::Create(const json& config) {
  PreTokenizer p;
  RETURN_IF_ERROR(AddSteps(config, "pre_tokenizer", &p));
  return p;
}

namespace {

// Appends to `out` the pieces of `text` that `regex` isolates: each match and
// each gap between matches (Isolated), or only the gaps (Removed). Returns
// whether the first piece appended starts at text[0].
bool SplitPieces(const Regex& regex, bool remove_matches, std::string_view text, std::vector<std::string>* out) {
  size_t last = 0;
  bool removed_start = false;
  regex.ForEachMatch(text, [&](size_t begin, size_t end) {
    if (begin > last) out->emplace_back(text.substr(last, begin - last));
    if (!remove_matches) out->emplace_back(text.substr(begin, end - begin));
    if (remove_matches && begin == 0) removed_start = true;
    last = end;
  });
  if (last < text.size()) out->emplace_back(text.substr(last));
  return !removed_start;
}

}  // namespace

void PreTokenizer::PreTokenize(std::string_view text, bool at_text_start, std::vector<std::string>* words) const {
  std::vector<std::string> pieces{std::string(text)};
  std::vector<std::string> next;
  // Whether pieces[0] starts at the beginning of the whole input, which is
  // what `tokenizers` checks (offsets_original().0 == 0) for Metaspace "first".
  bool first_at_start = at_text_start;
  for (const Step& step : steps_) {
    next.clear();
    if (const auto* split = std::get_if<SplitStep>(&step)) {
      for (size_t i = 0; i < pieces.size(); ++i) {
        const size_t before = next.size();
        const bool starts = SplitPieces(split->regex, split->remove_matches, pieces[i], &next);
        if (i == 0) first_at_start = first_at_start && starts && next.size() > before;
      }
    } else if (const auto* ms = std::get_if<MetaspaceStep>(&step)) {
      for (size_t i = 0; i < pieces.size(); ++i) {
        std::string p = ReplaceAll(pieces[i], " ", ms->replacement);
        const bool prepend =
            ms->prepend == PrependScheme::kAlways || (ms->prepend == PrependScheme::kFirst && i == 0 && first_at_start);
        if (prepend && !p.empty() && p.compare(0, ms->replacement.size(), ms->replacement) != 0) {
          p.insert(0, ms->replacement);
        }
        if (!ms->split) {
          next.push_back(std::move(p));
          continue;
        }
        // MergedWithNext: a word starts at each replacement that does not
        // follow another one ("a▁▁b" -> "a", "▁▁b").
        const std::string_view r = ms->replacement;
        size_t word_start = 0;
        size_t pos = 0;
        bool previous_was_replacement = false;
        while (pos < p.size()) {
          const bool is_replacement = p.compare(pos, r.size(), r) == 0;
          if (is_replacement && !previous_was_replacement && pos > word_start) {
            next.push_back(p.substr(word_start, pos - word_start));
            word_start = pos;
          }
          previous_was_replacement = is_replacement;
          int len = is_replacement ? static_cast<int>(r.size()) : Utf8SequenceLength(std::string_view(p).substr(pos));
          pos += len > 0 ? len : 1;
        }
        if (word_start < p.size()) next.push_back(p.substr(word_start));
      }
    } else {
      const auto& bl = std::get<ByteLevelStep>(step);
      std::vector<std::string> split_pieces;
      for (std::string& p : pieces) {
        if (bl.add_prefix_space && (p.empty() || p[0] != ' ')) p.insert(p.begin(), ' ');
        split_pieces.clear();
        if (bl.regex) {
          SplitPieces(*bl.regex, false, p, &split_pieces);
        } else {
          split_pieces.push_back(std::move(p));
        }
        for (const std::string& s : split_pieces) {
          std::string encoded;
          encoded.reserve(s.size() * 2);
          ByteLevelEncode(s, &encoded);
          next.push_back(std::move(encoded));
        }
      }
    }
    pieces.swap(next);
  }
  for (std::string& p : pieces) {
    if (!p.empty()) words->push_back(std::move(p));
  }
}

}  // namespace tandem::router
