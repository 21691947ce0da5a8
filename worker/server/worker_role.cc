#include "worker/server/worker_role.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::worker {

const char* WorkerRoleName(WorkerRole role) {
  switch (role) {
    case WorkerRole::kPrefill:
      return "prefill";
    case WorkerRole::kDecode:
      return "decode";
    case WorkerRole::kBoth:
      return "both";
  }
  return "both";
}

absl::StatusOr<WorkerRole> ParseWorkerRole(std::string_view name) {
  for (WorkerRole r : {WorkerRole::kPrefill, WorkerRole::kDecode, WorkerRole::kBoth}) {
    if (name == WorkerRoleName(r)) return r;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--role must be prefill, decode or both, got '", std::string(name), "'"));
}

}  // namespace tandem::worker
