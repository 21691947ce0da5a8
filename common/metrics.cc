#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/utf8.h"

namespace tandem {
namespace {

using metrics_internal::FamilyBase;
using metrics_internal::FormatValue;
using metrics_internal::MetricType;

// Integers up to 2^53 are exact in a double.
constexpr double kMaxExactInteger = 9007199254740992.0;
constexpr double kInf = std::numeric_limits<double>::infinity();

void AtomicAdd(std::atomic<double>& a, double v) {
  double current = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(current, current + v, std::memory_order_relaxed)) {
  }
}

std::string_view TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// Appends `text` with invalid UTF-8 replaced by U+FFFD and `\` and newline
// escaped, and `"` too when `quote` (label values; help text leaves it).
void AppendEscaped(std::string_view text, bool quote, std::string* out) {
  std::string repaired;
  if (!IsValidUtf8(text)) {
    AppendValidUtf8(text, /*final=*/true, &repaired);
    text = repaired;
  }
  for (char c : text) {
    if (c == '\\') {
      out->append("\\\\");
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '"' && quote) {
      out->append("\\\"");
    } else {
      out->push_back(c);
    }
  }
}

void AppendValue(double v, std::string* out) {
  if (std::isnan(v)) {
    out->append("NaN");
    return;
  }
  if (std::isinf(v)) {
    out->append(v > 0 ? "+Inf" : "-Inf");
    return;
  }
  char buf[32];
  std::to_chars_result r;
  if (std::fabs(v) <= kMaxExactInteger && v == std::trunc(v)) {
    r = std::to_chars(buf, buf + sizeof(buf), static_cast<int64_t>(v));
  } else {
    r = std::to_chars(buf, buf + sizeof(buf), v);  // shortest round-trip form
  }
  out->append(buf, r.ptr);
}

// `{a="x",b="y"}`, with `le="<le>"` last when `le` is set; nothing when there
// are no labels at all.
void AppendLabels(const std::vector<std::string>& names, const std::vector<std::string>& values, const std::string* le,
                  std::string* out) {
  if (names.empty() && le == nullptr) return;
  out->push_back('{');
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out->push_back(',');
    out->append(names[i]);
    out->append("=\"");
    AppendEscaped(values[i], /*quote=*/true, out);
    out->push_back('"');
  }
  if (le != nullptr) {
    if (!names.empty()) out->push_back(',');
    out->append("le=\"");
    out->append(*le);
    out->push_back('"');
  }
  out->push_back('}');
}

// One sample line: name{labels} value.
void AppendSample(std::string_view name, std::string_view suffix, const std::vector<std::string>& label_names,
                  const std::vector<std::string>& label_values, const std::string* le, double value, std::string* out) {
  out->append(name);
  out->append(suffix);
  AppendLabels(label_names, label_values, le, out);
  out->push_back(' ');
  AppendValue(value, out);
  out->push_back('\n');
}

std::vector<std::string> ToStrings(LabelValues values) {
  return std::vector<std::string>(values.begin(), values.end());
}

}  // namespace

// ---------------------------------------------------------------------------
// Children.

void Counter::Inc(double v) {
  if (v >= 0 && v <= kMaxExactInteger) {
    const auto n = static_cast<uint64_t>(v);
    if (static_cast<double>(n) == v) {
      whole_.fetch_add(n, std::memory_order_relaxed);
      return;
    }
  }
  if (!(v >= 0)) return;  // negative or NaN
  AtomicAdd(fraction_, v);
}

double Counter::Value() const {
  return static_cast<double>(whole_.load(std::memory_order_relaxed)) + fraction_.load(std::memory_order_relaxed);
}

void Counter::Reset() {
  whole_.store(0, std::memory_order_relaxed);
  fraction_.store(0, std::memory_order_relaxed);
}

void Gauge::Set(double v) { value_.store(v, std::memory_order_relaxed); }
void Gauge::Inc(double v) { AtomicAdd(value_, v); }
double Gauge::Value() const { return value_.load(std::memory_order_relaxed); }

Histogram::Histogram(const std::vector<double>& bounds)
    : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds.size() + 1]) {
  Reset();
}

void Histogram::Observe(double v) {
  // Bucket i counts bounds_[i-1] < v <= bounds_[i]. NaN compares false with
  // every bound, so it lands in the +Inf bucket (as in Prometheus' Go client).
  size_t i = bounds_.size();
  if (!std::isnan(v)) i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.cumulative.resize(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = total;
  }
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

void Histogram::Reset() {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
  sum_.store(0, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------
// Buckets.

absl::Status ValidateBucketBounds(absl::Span<const double> bounds) {
  if (!bounds.empty() && bounds.back() == kInf) bounds.remove_suffix(1);
  if (bounds.empty()) return absl::InvalidArgumentError("histogram needs at least one finite bucket bound");
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      return absl::InvalidArgumentError(absl::StrCat("bucket bound ", i, " is ", FormatValue(bounds[i]),
                                                     "; bounds must be finite (only a trailing +Inf is allowed)"));
    }
    if (i > 0 && !(bounds[i - 1] < bounds[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bucket bounds must be strictly increasing: ", FormatValue(bounds[i - 1]), " then ", FormatValue(bounds[i])));
    }
  }
  return absl::OkStatus();
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  CHECK(start > 0 && factor > 1 && count >= 1)
      << "ExponentialBuckets(" << start << ", " << factor << ", " << count << ")";
  std::vector<double> bounds(count);
  double b = start;
  for (double& bound : bounds) {
    bound = b;
    b *= factor;
  }
  return bounds;
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  CHECK(width > 0 && count >= 1) << "LinearBuckets(" << start << ", " << width << ", " << count << ")";
  std::vector<double> bounds(count);
  for (int i = 0; i < count; ++i) bounds[i] = start + i * width;
  return bounds;
}

// ---------------------------------------------------------------------------
// Text-format helpers.

namespace metrics_internal {

std::string FormatValue(double v) {
  std::string s;
  AppendValue(v, &s);
  return s;
}

bool IsValidMetricName(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool IsValidLabelName(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (i > 0 && c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

bool LabelValuesLess::operator()(const std::vector<std::string>& a, LabelValues b) const {
  return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(),
                                      [](std::string_view x, std::string_view y) { return x < y; });
}

bool LabelValuesLess::operator()(LabelValues a, const std::vector<std::string>& b) const {
  return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(),
                                      [](std::string_view x, std::string_view y) { return x < y; });
}

FamilyBase::FamilyBase(std::string name, std::string help, std::vector<std::string> label_names, MetricType type)
    : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)), type_(type) {}

void FamilyBase::AppendHeader(std::string* out) const {
  out->append("# HELP ");
  out->append(name_);
  out->push_back(' ');
  AppendEscaped(help_, /*quote=*/false, out);
  out->append("\n# TYPE ");
  out->append(name_);
  out->push_back(' ');
  out->append(TypeName(type_));
  out->push_back('\n');
}

}  // namespace metrics_internal

// ---------------------------------------------------------------------------
// Families.

template <typename T>
MetricFamily<T>::MetricFamily(std::string name, std::string help, std::vector<std::string> label_names, MetricType type,
                              std::vector<double> bucket_bounds)
    : FamilyBase(std::move(name), std::move(help), std::move(label_names), type),
      bucket_bounds_(std::move(bucket_bounds)) {
  if (this->label_names().empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    children_[{}].child = NewChild();
  }
}

template <typename T>
std::unique_ptr<T> MetricFamily<T>::NewChild() const {
  if constexpr (std::is_same_v<T, Histogram>) {
    return std::unique_ptr<T>(new Histogram(bucket_bounds_));
  } else {
    return std::unique_ptr<T>(new T());
  }
}

template <typename T>
T& MetricFamily<T>::WithLabels(LabelValues values) {
  CHECK(values.size() == label_names().size())
      << name() << ": " << values.size() << " label values for " << label_names().size() << " label names";
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(values);
  if (it == children_.end()) {
    it = children_.emplace(ToStrings(values), Entry{NewChild(), false}).first;
  } else if (it->second.removed) {
    it->second.child->Reset();
    it->second.removed = false;
  }
  return *it->second.child;
}

template <typename T>
T& MetricFamily<T>::Get() {
  CHECK(label_names().empty()) << name() << " has labels: use WithLabels";
  return WithLabels({});
}

template <typename T>
void MetricFamily<T>::Remove(LabelValues values) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(values);
  if (it != children_.end()) it->second.removed = true;
}

template <typename T>
void MetricFamily<T>::AppendTo(std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  bool header = false;
  for (const auto& [values, entry] : children_) {
    if (entry.removed) continue;
    if (!header) {
      AppendHeader(out);
      header = true;
    }
    AppendChild(values, *entry.child, out);
  }
}

template <typename T>
void MetricFamily<T>::AppendChild(const std::vector<std::string>& values, const T& child, std::string* out) const {
  if constexpr (std::is_same_v<T, Histogram>) {
    // _count is the +Inf bucket of the same read, so the two always agree.
    const Histogram::Snapshot s = child.Read();
    std::string le;
    for (size_t i = 0; i < bucket_bounds_.size(); ++i) {
      le = FormatValue(bucket_bounds_[i]);
      AppendSample(name(), "_bucket", label_names(), values, &le, static_cast<double>(s.cumulative[i]), out);
    }
    le = "+Inf";
    AppendSample(name(), "_bucket", label_names(), values, &le, static_cast<double>(s.count()), out);
    AppendSample(name(), "_sum", label_names(), values, nullptr, s.sum, out);
    AppendSample(name(), "_count", label_names(), values, nullptr, static_cast<double>(s.count()), out);
  } else {
    AppendSample(name(), "", label_names(), values, nullptr, child.Value(), out);
  }
}

template class MetricFamily<Counter>;
template class MetricFamily<Gauge>;
template class MetricFamily<Histogram>;

void MetricEmitter::Emit(LabelValues label_values, double value) {
  CHECK(label_values.size() == num_labels_)
      << label_values.size() << " label values emitted for " << num_labels_ << " label names";
  samples_.emplace_back(ToStrings(label_values), value);
}

CallbackFamily::CallbackFamily(std::string name, std::string help, std::vector<std::string> label_names,
                               MetricType type, MetricCallback callback)
    : FamilyBase(std::move(name), std::move(help), std::move(label_names), type), callback_(std::move(callback)) {}

void CallbackFamily::AppendTo(std::string* out) const {
  MetricEmitter emitter(label_names().size());
  callback_(emitter);
  auto& samples = emitter.samples_;
  if (samples.empty()) return;
  std::stable_sort(samples.begin(), samples.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  AppendHeader(out);
  for (size_t i = 0; i < samples.size(); ++i) {
    if (i > 0 && samples[i].first == samples[i - 1].first) continue;  // keep the first emitted
    AppendSample(name(), "", label_names(), samples[i].first, nullptr, samples[i].second, out);
  }
}

// ---------------------------------------------------------------------------
// Registry.

void MetricsRegistry::CheckNewFamily(std::string_view name, std::string_view help,
                                     const std::vector<std::string>& label_names, MetricType type) {
  CHECK(metrics_internal::IsValidMetricName(name)) << "invalid metric name \"" << name << "\"";
  CHECK(!help.empty()) << name << ": help text is empty";
  if (type == MetricType::kCounter) {
    CHECK(name.size() > 6 && name.substr(name.size() - 6) == "_total")
        << "counter name " << name << " must end in _total";
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    const std::string& label = label_names[i];
    CHECK(metrics_internal::IsValidLabelName(label)) << name << ": invalid label name \"" << label << "\"";
    CHECK(label.substr(0, 2) != "__") << name << ": label name " << label << " is reserved";
    CHECK(type != MetricType::kHistogram || label != "le") << name << ": label name le is reserved in histograms";
    CHECK(std::find(label_names.begin(), label_names.begin() + i, label) == label_names.begin() + i)
        << name << ": label name " << label << " repeated";
  }
  std::vector<std::string> claimed = {std::string(name)};
  if (type == MetricType::kHistogram) {
    for (std::string_view suffix : {"_bucket", "_sum", "_count"}) {
      claimed.push_back(std::string(name) + std::string(suffix));
    }
  }
  for (const std::string& n : claimed) {
    CHECK(!sample_names_.contains(n)) << "metric name " << n << " registered twice";
  }
  sample_names_.insert(claimed.begin(), claimed.end());
}

CounterFamily& MetricsRegistry::AddCounter(std::string_view name, std::string_view help,
                                           std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckNewFamily(name, help, label_names, MetricType::kCounter);
  auto* family =
      new CounterFamily(std::string(name), std::string(help), std::move(label_names), MetricType::kCounter, {});
  families_.emplace_back(family);
  return *family;
}

GaugeFamily& MetricsRegistry::AddGauge(std::string_view name, std::string_view help,
                                       std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckNewFamily(name, help, label_names, MetricType::kGauge);
  auto* family = new GaugeFamily(std::string(name), std::string(help), std::move(label_names), MetricType::kGauge, {});
  families_.emplace_back(family);
  return *family;
}

HistogramFamily& MetricsRegistry::AddHistogram(std::string_view name, std::string_view help,
                                               std::vector<std::string> label_names,
                                               std::vector<double> bucket_bounds) {
  const absl::Status valid = ValidateBucketBounds(bucket_bounds);
  CHECK(valid.ok()) << name << ": " << valid.message();
  if (bucket_bounds.back() == kInf) bucket_bounds.pop_back();
  std::lock_guard<std::mutex> lock(mu_);
  CheckNewFamily(name, help, label_names, MetricType::kHistogram);
  auto* family = new HistogramFamily(std::string(name), std::string(help), std::move(label_names),
                                     MetricType::kHistogram, std::move(bucket_bounds));
  families_.emplace_back(family);
  return *family;
}

void MetricsRegistry::AddCallbackCounter(std::string_view name, std::string_view help,
                                         std::vector<std::string> label_names, MetricCallback callback) {
  CHECK(callback != nullptr) << name << ": no callback";
  std::lock_guard<std::mutex> lock(mu_);
  CheckNewFamily(name, help, label_names, MetricType::kCounter);
  families_.emplace_back(new CallbackFamily(std::string(name), std::string(help), std::move(label_names),
                                            MetricType::kCounter, std::move(callback)));
}

void MetricsRegistry::AddCallbackGauge(std::string_view name, std::string_view help,
                                       std::vector<std::string> label_names, MetricCallback callback) {
  CHECK(callback != nullptr) << name << ": no callback";
  std::lock_guard<std::mutex> lock(mu_);
  CheckNewFamily(name, help, label_names, MetricType::kGauge);
  families_.emplace_back(new CallbackFamily(std::string(name), std::string(help), std::move(label_names),
                                            MetricType::kGauge, std::move(callback)));
}

std::string MetricsRegistry::Render() const {
  // Families are never removed, so their pointers outlive the lock; rendering
  // without it lets callbacks take their own locks freely.
  std::vector<const FamilyBase*> families;
  {
    std::lock_guard<std::mutex> lock(mu_);
    families.reserve(families_.size());
    for (const auto& f : families_) families.push_back(f.get());
  }
  std::string out;
  for (const FamilyBase* f : families) f->AppendTo(&out);
  return out;
}

}  // namespace tandem
