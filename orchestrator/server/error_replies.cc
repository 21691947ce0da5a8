#include "orchestrator/server/error_replies.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "common/logging.h"
#include "orchestrator/server/redact.h"

namespace tandem::router {

ApiError ErrorReplies::ForClient(const absl::Status& status, bool show_workers) const {
  ApiError e = ApiErrorFromStatus(status);
  if (!show_workers) e.message = RedactWorkers(e.message, worker_addresses_());
  return e;
}

void ErrorReplies::Send(const std::string& endpoint, const std::string& request_id, http::ResponseWriter& w,
                        const absl::Status& status, http::HeaderList headers, bool show_workers) const {
  const ApiError e = ForClient(status, show_workers);
  http::HeaderList h = headers.empty() ? http::HeaderList{{"x-request-id", request_id}} : std::move(headers);
  const bool has_retry =
      std::any_of(h.begin(), h.end(), [](const auto& kv) { return absl::AsciiStrToLower(kv.first) == "retry-after"; });
  if ((e.http_status == 429 || e.http_status == 503) && !has_retry) h.emplace_back("Retry-After", "1");
  metrics_.requests.WithLabels({endpoint, std::to_string(e.http_status)}).Inc();
  if (e.http_status >= 500) {
    LOG(WARNING) << "request " << request_id << " " << endpoint << ": " << status.ToString();
  }
  w.Send(e.http_status, http::kJsonContentType, ApiErrorJson(e), h);
}

}  // namespace tandem::router
