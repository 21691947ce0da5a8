#include "orchestrator/tokenizer/normalizer.h"

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "orchestrator/tokenizer/utf8.h"

namespace tandem::router {
namespace {

using nlohmann::json;

absl::Status AddForms(const json& config, const std::string& path, std::vector<Normalizer::Form>* forms) {
  if (config.is_null()) return absl::OkStatus();
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json ", path, ": expected an object with a \"type\""));
  }
  const std::string type = config["type"].get<std::string>();
  if (type == "NFC") {
    forms->push_back(Normalizer::Form::kNfc);
  } else if (type == "NFKC") {
    forms->push_back(Normalizer::Form::kNfkc);
  } else if (type == "NFD") {
    forms->push_back(Normalizer::Form::kNfd);
  } else if (type == "NFKD") {
    forms->push_back(Normalizer::Form::kNfkd);
  } else if (type == "Sequence") {
    const auto it = config.find("normalizers");
    if (it == config.end() || !it->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json ", path, ".normalizers: expected an array"));
    }
    for (size_t i = 0; i < it->size(); ++i) {
      if (auto s = AddForms((*it)[i], absl::StrCat(path, ".normalizers[", i, "]"), forms); !s.ok()) return s;
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json ", path, ".type: unsupported normalizer \"", type, "\""));
  }
  return absl::OkStatus();
}

const icu::Normalizer2* IcuInstance(Normalizer::Form form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (form) {
    case Normalizer::Form::kNfc: n = icu::Normalizer2::getNFCInstance(status); break;
    case Normalizer::Form::kNfkc: n = icu::Normalizer2::getNFKCInstance(status); break;
    case Normalizer::Form::kNfd: n = icu::Normalizer2::getNFDInstance(status); break;
    case Normalizer::Form::kNfkd: n = icu::Normalizer2::getNFKDInstance(status); break;
  }
  return U_SUCCESS(status) ? n : nullptr;
}

}  // namespace

absl::StatusOr<Normalizer> Normalizer::Create(const json& config) {
  Normalizer n;
  if (auto s = AddForms(config, "normalizer", &n.forms_); !s.ok()) return s;
  for (Form f : n.forms_) {
    if (IcuInstance(f) == nullptr) return absl::InternalError("ICU normalizer data unavailable");
  }
  return n;
}

void Normalizer::Normalize(std::string* text) const {
  if (forms_.empty()) return;
  // ASCII is invariant under every normalization form.
  bool ascii = true;
  for (char c : *text) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return;
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(text->data(), text->size()));
  for (Form f : forms_) {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* n = IcuInstance(f);
    if (n->isNormalized(u, status) && U_SUCCESS(status)) continue;
    status = U_ZERO_ERROR;
    icu::UnicodeString out = n->normalize(u, status);
    if (U_SUCCESS(status)) u = std::move(out);
  }
  text->clear();
  u.toUTF8String(*text);
}

}  // namespace tandem::router
