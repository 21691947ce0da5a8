#include "common/process_info.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace tandem {
namespace {

std::optional<uint64_t> StartTimeAt(const std::string& proc_dir) {
  const std::string path = proc_dir + "/stat";
  FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) {
    if (errno == ENOENT || errno == ESRCH) return uint64_t{0};
    return std::nullopt;
  }
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  const bool failed = std::ferror(f) != 0;
  const int read_errno = errno;
  std::fclose(f);
  if (failed) return read_errno == ESRCH ? std::optional<uint64_t>(0) : std::nullopt;  // exited while read
  const absl::string_view stat(buf, n);
  const size_t comm_end = stat.rfind(')');  // the command may hold spaces and parentheses
  if (comm_end == absl::string_view::npos) return std::nullopt;
  std::vector<absl::string_view> fields = absl::StrSplit(stat.substr(comm_end + 1), ' ', absl::SkipEmpty());
  uint64_t start = 0;
  // fields[0] is field 3 (the state): field 22 is fields[19].
  if (fields.size() < 20 || !absl::SimpleAtoi(fields[19], &start)) return std::nullopt;
  if (fields[0] == "Z" || fields[0] == "X") return uint64_t{0};  // exited, not yet reaped
  return start;
}

}  // namespace

std::optional<uint64_t> ProcessStartTime(int64_t pid) {
  if (pid <= 0) return uint64_t{0};
  return StartTimeAt(absl::StrCat("/proc/", pid));
}

uint64_t OwnStartTime() {
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self", ec).string();
  if (ec || self != absl::StrCat(getpid())) return 0;
  return StartTimeAt("/proc/" + self).value_or(0);
}

std::string HostBootId() {
  FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "re");
  if (f == nullptr) return "";
  char buf[64] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string id(buf, n);
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

const std::string& PidNamespace() {
  static const std::string ns = [] {
    std::error_code ec;
    std::string link = std::filesystem::read_symlink("/proc/self/ns/pid", ec).string();
    return ec ? std::string() : link;
  }();
  return ns;
}

}  // namespace tandem
