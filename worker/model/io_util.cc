#include "worker/model/io_util.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace tandem::worker::model_internal {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) {
    return absl::NotFoundError(absl::StrCat(path, " does not exist"));
  }
  if (!std::filesystem::is_regular_file(status)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::UnavailableError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    return absl::DataLossError(absl::StrCat("error reading ", path));
  }
  return std::move(contents).str();
}

absl::Status WriteFile(const std::string& path, std::string_view contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  if (!out) {
    return absl::DataLossError(absl::StrCat("error writing ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, const std::string& what) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": invalid JSON: ", e.what()));
  }
}

std::string DumpJson(const nlohmann::json& value, int indent) {
  return value.dump(indent, ' ', /*ensure_ascii=*/false,
                    nlohmann::json::error_handler_t::replace);
}

std::string DumpJson(const nlohmann::ordered_json& value, int indent) {
  return value.dump(indent, ' ', /*ensure_ascii=*/false,
                    nlohmann::ordered_json::error_handler_t::replace);
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

}  // namespace tandem::worker::model_internal
