#include "worker/cli/python_helper.h"

#include <cstdio>
#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/str_format.h"

namespace tandem::worker {

std::string FindHelperScript(const std::string& flag, const std::string& name) {
  if (!flag.empty()) return flag;
  const std::string relative = "scripts/" + name;
  std::vector<std::filesystem::path> candidates = {relative};
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path() / name);
    for (std::filesystem::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path();
         dir = dir.parent_path()) {
      candidates.push_back(dir / relative);
    }
  }
  for (const auto& c : candidates) {
    if (std::filesystem::exists(c, ec)) return c.string();
  }
  return relative;
}

std::string ShellQuote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

nlohmann::json RunJsonHelper(const std::string& command) {
  std::fflush(stderr);
  FILE* p = popen(command.c_str(), "r");
  std::string text;
  if (p != nullptr) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) text.append(buf, n);
  }
  const int rc = p != nullptr ? pclose(p) : -1;
  // The answer is the last line that parses as a JSON object.
  size_t end = text.size();
  while (end > 0) {
    size_t start = text.rfind('\n', end - 1);
    start = start == std::string::npos ? 0 : start + 1;
    nlohmann::json j = nlohmann::json::parse(text.substr(start, end - start), nullptr, false);
    if (!j.is_discarded() && j.is_object()) return j;
    if (start == 0) break;
    end = start - 1;
  }
  return {{"available", false},
          {"why", absl::StrFormat("`%s` exited with status %d and printed no JSON", command, rc)}};
}

}  // namespace tandem::worker
