#include "worker/sampling/sampling_params.h"

#include <cmath>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace tandem::worker {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view allowed, float value) {
  return absl::InvalidArgumentError(absl::StrCat("sampling parameter ", field, " must be ", allowed, "; got ", value));
}

absl::Status Invalid(absl::string_view field, absl::string_view allowed, int value) {
  return absl::InvalidArgumentError(absl::StrCat("sampling parameter ", field, " must be ", allowed, "; got ", value));
}

// Every comparison below is written so that NaN fails it.
bool InClosedRange(float value, float low, float high) { return value >= low && value <= high; }

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& params, int vocab_size) {
  if (vocab_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("vocab_size must be > 0; got ", vocab_size));
  }
  if (!(std::isfinite(params.temperature) && params.temperature >= 0.0f)) {
    return Invalid("temperature", "a finite number >= 0 (0 = greedy)", params.temperature);
  }
  if (params.top_k < -1) {
    return Invalid("top_k", "-1 or 0 (off), or >= 1", params.top_k);
  }
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    return Invalid("top_p", "in (0, 1] (1 = off)", params.top_p);
  }
  if (!InClosedRange(params.min_p, 0.0f, 1.0f)) {
    return Invalid("min_p", "in [0, 1] (0 = off)", params.min_p);
  }
  if (!(std::isfinite(params.repetition_penalty) && params.repetition_penalty > 0.0f)) {
    return Invalid("repetition_penalty", "a finite number > 0 (1 = off)", params.repetition_penalty);
  }
  if (!InClosedRange(params.presence_penalty, -2.0f, 2.0f)) {
    return Invalid("presence_penalty", "in [-2, 2]", params.presence_penalty);
  }
  if (!InClosedRange(params.frequency_penalty, -2.0f, 2.0f)) {
    return Invalid("frequency_penalty", "in [-2, 2]", params.frequency_penalty);
  }
  if (params.max_tokens != -1 && params.max_tokens < 1) {
    return Invalid("max_tokens", "-1 (up to the context length) or >= 1", params.max_tokens);
  }
  if (params.min_tokens < 0) {
    return Invalid("min_tokens", ">= 0", params.min_tokens);
  }
  if (params.max_tokens != -1 && params.min_tokens > params.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("sampling parameter min_tokens must be <= max_tokens (",
                                                   params.max_tokens, "); got ", params.min_tokens));
  }
  for (size_t i = 0; i < params.stop_token_ids.size(); ++i) {
    const int id = params.stop_token_ids[i];
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("sampling parameter stop_token_ids[", i, "] must be in [0, ",
                                                     vocab_size, ") (the vocabulary); got ", id));
    }
  }
  if (params.logprobs < -1 || params.logprobs > kMaxLogprobs) {
    return Invalid("logprobs", absl::StrCat("-1 (none) or in [0, ", kMaxLogprobs, "]"), params.logprobs);
  }
  return absl::OkStatus();
}

}  // namespace tandem::worker
