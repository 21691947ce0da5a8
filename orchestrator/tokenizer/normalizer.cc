#include "orchestrator/tokenizer/normalizer.h"

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"
#include "orchestrator/tokenizer/json_steps.h"

namespace tandem::router {
namespace {

using nlohmann::json;

absl::Status AddSteps(const json& config, const std::string& path, std::vector<Normalizer::Step>* steps) {
  if (config.is_null()) return absl::OkStatus();
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string()) {
    return InvalidTokenizerJson(path, "expected an object with a \"type\"");
  }
  const std::string type = config["type"].get<std::string>();
  if (type == "NFC") {
    steps->push_back(Normalizer::Form::kNfc);
  } else if (type == "NFKC") {
    steps->push_back(Normalizer::Form::kNfkc);
  } else if (type == "NFD") {
    steps->push_back(Normalizer::Form::kNfd);
  } else if (type == "NFKD") {
    steps->push_back(Normalizer::Form::kNfkd);
  } else if (type == "Prepend") {
    const auto it = config.find("prepend");
    if (it == config.end() || !it->is_string()) return InvalidTokenizerJson(path + ".prepend", "expected a string");
    steps->push_back(Normalizer::Prepend{it->get<std::string>()});
  } else if (type == "Replace") {
    const auto pattern = config.find("pattern");
    const auto content = config.find("content");
    if (content == config.end() || !content->is_string())
      return InvalidTokenizerJson(path + ".content", "expected a string");
    if (pattern == config.end() || !pattern->is_object())
      return InvalidTokenizerJson(path + ".pattern", "expected an object");
    const bool literal = pattern->contains("String") && (*pattern)["String"].is_string();
    if (!literal && !(pattern->contains("Regex") && (*pattern)["Regex"].is_string())) {
      return InvalidTokenizerJson(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    const std::string text = (*pattern)[literal ? "String" : "Regex"].get<std::string>();
    if (text.empty()) return InvalidTokenizerJson(path + ".pattern", "must not be empty");
    auto regex = Regex::Compile(text, literal);
    if (!regex.ok()) return InvalidTokenizerJson(path + ".pattern", regex.status().message());
    steps->push_back(Normalizer::Replace{*std::move(regex), content->get<std::string>()});
  } else if (type == "Sequence") {
    const auto it = config.find("normalizers");
    if (it == config.end() || !it->is_array()) {
      return InvalidTokenizerJson(path + ".normalizers", "expected an array");
    }
    for (size_t i = 0; i < it->size(); ++i) {
      if (auto s = AddSteps((*it)[i], absl::StrCat(path, ".normalizers[", i, "]"), steps); !s.ok()) return s;
    }
  } else {
    return InvalidTokenizerJson(path + ".type", absl::StrCat("unsupported normalizer \"", type, "\""));
  }
  return absl::OkStatus();
}

const icu::Normalizer2* IcuInstance(Normalizer::Form form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (form) {
    case Normalizer::Form::kNfc:
      n = icu::Normalizer2::getNFCInstance(status);
      break;
    case Normalizer::Form::kNfkc:
      n = icu::Normalizer2::getNFKCInstance(status);
      break;
    case Normalizer::Form::kNfd:
      n = icu::Normalizer2::getNFDInstance(status);
      break;
    case Normalizer::Form::kNfkd:
      n = icu::Normalizer2::getNFKDInstance(status);
      break;
  }
  return U_SUCCESS(status) ? n : nullptr;
}

void ApplyForm(Normalizer::Form form, std::string* text) {
  // ASCII is invariant under every normalization form.
  bool ascii = true;
  for (char c : *text) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return;
  const icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(text->data(), text->size()));
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = IcuInstance(form);
  if (n->isNormalized(u, status) && U_SUCCESS(status)) return;
  status = U_ZERO_ERROR;
  const icu::UnicodeString out = n->normalize(u, status);
  if (!U_SUCCESS(status)) return;
  text->clear();
  out.toUTF8String(*text);
}

}  // namespace

absl::StatusOr<Normalizer> Normalizer::Create(const json& config) {
  Normalizer n;
  if (auto s = AddSteps(config, "normalizer", &n.steps_); !s.ok()) return s;
  for (const Step& step : n.steps_) {
    if (const Form* f = std::get_if<Form>(&step); f != nullptr && IcuInstance(*f) == nullptr) {
      return absl::InternalError("ICU normalizer data unavailable");
    }
  }
  return n;
}

void Normalizer::Normalize(std::string* text) const {
  for (const Step& step : steps_) {
    if (const Form* form = std::get_if<Form>(&step)) {
      ApplyForm(*form, text);
    } else if (const Prepend* prepend = std::get_if<Prepend>(&step)) {
      if (!text->empty()) text->insert(0, prepend->prefix);
    } else {
      const Replace& replace = std::get<Replace>(step);
      std::string out;
      size_t last = 0;
      replace.pattern.ForEachMatch(*text, [&](size_t begin, size_t end) {
        out.append(*text, last, begin - last);
        out.append(replace.content);
        last = end;
      });
      if (last == 0) continue;  // no match (matches are never empty)
      out.append(*text, last, std::string::npos);
      text->swap(out);
    }
  }
}

}  // namespace tandem::router
