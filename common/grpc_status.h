// absl::Status <-> grpc::Status. Canonical codes pass through gRPC unchanged
// (STYLE.md, "Errors"): both enums number the same 17 codes alike, so each
// conversion keeps the code and the message. The router (FromGrpcStatus, on
// a worker's answer) and the worker (ToGrpcStatus, on its own) share them.
//
// Pure functions; thread-safe.
#ifndef TANDEM_COMMON_GRPC_STATUS_H_
#define TANDEM_COMMON_GRPC_STATUS_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace tandem {

// The gRPC status for an absl::Status: same code, same message.
grpc::Status ToGrpcStatus(const absl::Status& status);
// The absl::Status for a gRPC status: same code, same message (OK drops the
// message, as absl::Status does).
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tandem

#endif  // TANDEM_COMMON_GRPC_STATUS_H_
