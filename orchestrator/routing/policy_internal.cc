#include "orchestrator/routing/policy_internal.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace tandem::router::routing_internal {

size_t CountHealthy(std::span<const WorkerView> workers) {
  size_t n = 0;
  for (const WorkerView& w : workers) n += w.healthy ? 1 : 0;
  return n;
}

size_t NthHealthy(std::span<const WorkerView> workers, size_t k) {
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!workers[i].healthy) continue;
    if (k == 0) return i;
    --k;
  }
  CHECK(false) << "NthHealthy: k out of range";
  return 0;
}

double LoadBound(std::span<const WorkerView> workers, double load_factor) {
  size_t healthy = 0;
  int64_t total = 0;
  for (const WorkerView& w : workers) {
    if (!w.healthy) continue;
    ++healthy;
    total += w.in_flight;
  }
  CHECK(healthy > 0) << "LoadBound: no healthy worker";
  return load_factor * static_cast<double>(total + 1) / static_cast<double>(healthy);
}

absl::Status NoHealthyWorker(absl::string_view policy, size_t num_workers) {
  return absl::UnavailableError(absl::StrCat(policy, ": no healthy worker among ", num_workers));
}

ParamReader::ParamReader(absl::string_view policy, const PolicyParams& params) : policy_(policy), params_(params) {}

const std::string* ParamReader::Find(absl::string_view key) {
  auto it = params_.find(std::string(key));
  if (it == params_.end()) return nullptr;
  used_.insert(it->first);
  return &it->second;
}

absl::Status ParamReader::Bad(absl::string_view key, const std::string& value, absl::string_view why) const {
  return absl::InvalidArgumentError(
      absl::StrCat("routing policy '", policy_, "': parameter '", key, "' = '", value, "': ", why));
}

absl::Status ParamReader::Uint64(absl::string_view key, uint64_t* out) {
  const std::string* value = Find(key);
  if (value == nullptr) return absl::OkStatus();
  uint64_t v = 0;
  if (!absl::SimpleAtoi(*value, &v)) return Bad(key, *value, "not an unsigned 64-bit integer");
  *out = v;
  return absl::OkStatus();
}

absl::Status ParamReader::Int64(absl::string_view key, int64_t min, int64_t max, int64_t* out) {
  const std::string* value = Find(key);
  if (value == nullptr) return absl::OkStatus();
  int64_t v = 0;
  if (!absl::SimpleAtoi(*value, &v)) return Bad(key, *value, "not an integer");
  if (v < min || v > max) {
    return Bad(key, *value, absl::StrCat("must be in [", min, ", ", max, "]"));
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ParamReader::Double(absl::string_view key, double min, double* out) {
  const std::string* value = Find(key);
  if (value == nullptr) return absl::OkStatus();
  double v = 0;
  if (!absl::SimpleAtod(*value, &v) || !std::isfinite(v)) return Bad(key, *value, "not a number");
  if (v < min) return Bad(key, *value, absl::StrCat("must be >= ", min));
  *out = v;
  return absl::OkStatus();
}

absl::Status ParamReader::Finish() const {
  for (const auto& [key, value] : params_) {
    if (!used_.contains(key)) return Bad(key, value, "unknown parameter");
  }
  return absl::OkStatus();
}

}  // namespace tandem::router::routing_internal
