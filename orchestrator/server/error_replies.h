// ErrorReplies: how the router answers a request with an error: the OpenAI
// error body for a Status (ApiErrorFromStatus), worker addresses redacted
// from the message unless the caller may see them, the x-request-id header,
// Retry-After on 429 and 503, the request counted by endpoint and status,
// and a WARNING for server-side (5xx) failures.
//
// Thread safety: any thread.
#ifndef TANDEM_ORCHESTRATOR_SERVER_ERROR_REPLIES_H_
#define TANDEM_ORCHESTRATOR_SERVER_ERROR_REPLIES_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "orchestrator/http/http_server.h"
#include "orchestrator/openai/openai_api.h"
#include "orchestrator/server/router_metrics.h"

namespace tandem::router {

class ErrorReplies {
 public:
  // `worker_addresses`: every address a message could name (to redact).
  ErrorReplies(RouterMetrics& metrics, std::function<std::vector<std::string>()> worker_addresses)
      : metrics_(metrics), worker_addresses_(std::move(worker_addresses)) {}

  // Sends the error for `status` (counted under `endpoint`). `headers`, when
  // given, replace the x-request-id header (they carry it); a Retry-After
  // among them replaces the default one.
  void Send(const std::string& endpoint, const std::string& request_id, http::ResponseWriter& w,
            const absl::Status& status, http::HeaderList headers = {}, bool show_workers = false) const;

  // The error a client reads for `status`, its worker addresses redacted
  // unless `show_workers`.
  ApiError ForClient(const absl::Status& status, bool show_workers) const;

 private:
  RouterMetrics& metrics_;
  const std::function<std::vector<std::string>()> worker_addresses_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_ERROR_REPLIES_H_
