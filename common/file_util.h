// Whole-file reads and writes that report failures as absl::Status naming the
// path, for model files, router configs and templates, and the ready files
// that long-running commands write once they serve.
//
// Thread safety: thread-compatible (no shared state); concurrent writers of
// one path must coordinate.
#ifndef TANDEM_COMMON_FILE_UTIL_H_
#define TANDEM_COMMON_FILE_UTIL_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem {

// The contents of the regular file `path`. NotFound when it does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Replaces `path` with `contents`.
absl::Status WriteFile(const std::string& path, std::string_view contents);

// Writes `contents` to `path` + ".tmp", then renames it to `path`: a reader
// that polls for `path` never sees it half written.
absl::Status WriteFileAtomically(const std::string& path, std::string_view contents);

}  // namespace tandem

#endif  // TANDEM_COMMON_FILE_UTIL_H_
