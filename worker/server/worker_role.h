// WorkerRole: what a worker does in a disaggregated cluster, and its name on
// the command line (--role) and on the wire (Health, ModelInfo).
//
// Pure functions; thread-safe.
#ifndef TANDEM_WORKER_SERVER_WORKER_ROLE_H_
#define TANDEM_WORKER_SERVER_WORKER_ROLE_H_

#include <string_view>

#include "absl/status/statusor.h"

namespace tandem::worker {

// Prefill for others (SEND), decode what others prefilled (RECEIVE), or both
// (and whole requests).
enum class WorkerRole { kPrefill, kDecode, kBoth };
// "prefill", "decode", "both": the --role flag's values and ModelInfo.role.
const char* WorkerRoleName(WorkerRole role);
// InvalidArgument "--role must be prefill, decode or both, got 'x'" otherwise.
absl::StatusOr<WorkerRole> ParseWorkerRole(std::string_view name);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_WORKER_ROLE_H_
