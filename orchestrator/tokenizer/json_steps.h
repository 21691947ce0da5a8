// Helpers shared by the tokenizer.json readers (normalizer, pre-tokenizer,
// decoder, tokenizer): the error every load failure uses, and the pieces of
// configuration more than one step parses. Internal to the tokenizer;
// pure functions, thread-safe.
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_JSON_STEPS_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_JSON_STEPS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"

namespace tandem::router {

// The largest token id a tokenizer.json may use. Ids index dense tables
// (about 100 bytes per id across them), so one stray huge id would allocate
// gigabytes at load; real vocabularies stay under 300k ids (Gemma 3's is
// 262,144), far below this 2^21.
// Fuzz builds (FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION, libFuzzer's
// convention) take 2^16: the same checks, but an input with one large id
// no longer fills a 64 MB table, whose page faults were most of
// tokenizer_json_fuzzer's time in a VM.
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
inline constexpr int64_t kMaxTokenId = (1 << 16) - 1;
#else
inline constexpr int64_t kMaxTokenId = (1 << 21) - 1;
#endif

// How deep a tokenizer.json may nest. Real files nest 8 levels at most; the
// steps' readers recurse into Sequence steps and copy subtrees recursively,
// so a hostile file nested 100k deep would overflow the stack.
inline constexpr int kMaxTokenizerJsonDepth = 64;

// InvalidArgument "tokenizer.json <path>: <why>".
absl::Status InvalidTokenizerJson(absl::string_view path, absl::string_view why);

// The optional count `key` of `object`: `fallback` when absent, else an
// integer in [0, max]. A fraction, a float such as 1e30 (converting it to an
// integer would be undefined behaviour), a negative number or a non-number
// is refused, naming `path`.`key`.
absl::StatusOr<size_t> OptionalCount(const nlohmann::json& object, absl::string_view key, size_t fallback, size_t max,
                                     absl::string_view path);

// True when `s` is exactly one UTF-8 character.
bool IsOneCharacter(std::string_view s);

// `text` with every occurrence of `from` (non-empty) replaced by `to`.
std::string ReplaceAll(std::string_view text, std::string_view from, std::string_view to);

// Where a Metaspace step (pre-tokenizer or decoder) puts its replacement
// character before the text: "always", "first" (the first word only) or
// "never". Read from `prepend_scheme`, or from the older `add_prefix_space`
// (true: always, the default; false: never). `path` names the step.
enum class PrependScheme { kAlways, kFirst, kNever };
absl::StatusOr<PrependScheme> ParsePrependScheme(const nlohmann::json& metaspace, const std::string& path);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_JSON_STEPS_H_
