// Internal helpers of the model I/O library: JSON parsing that turns
// nlohmann_json's exceptions into Status at this edge, and path joining. Not for use outside
// worker/model/.
//
// Thread safety: all functions are thread-compatible (no shared state).
#ifndef TANDEM_WORKER_MODEL_IO_UTIL_H_
#define TANDEM_WORKER_MODEL_IO_UTIL_H_

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/file_util.h"

namespace tandem::worker::model_internal {

// Whole-file reads and writes (common/file_util.h), as this library spells them.
using ::tandem::ReadFile;
using ::tandem::WriteFile;

// Parses `text` as JSON; `what` names the text (a file path) in the error,
// which carries nlohmann's byte position.
absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, const std::string& what);

// Serializes with `indent` spaces (-1: compact); invalid UTF-8 is replaced
// rather than thrown on.
std::string DumpJson(const nlohmann::json& value, int indent);
std::string DumpJson(const nlohmann::ordered_json& value, int indent);

// `dir` + "/" + `name`.
std::string JoinPath(const std::string& dir, const std::string& name);

}  // namespace tandem::worker::model_internal

#endif  // TANDEM_WORKER_MODEL_IO_UTIL_H_
