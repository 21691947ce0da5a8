// Prometheus metrics: a registry of counter, gauge and histogram families,
// rendered in the text exposition format 0.0.4 for a /metrics endpoint.
//
//   MetricsRegistry registry;
//   CounterFamily& requests = registry.AddCounter(
//       "tandem_router_requests_total", "Requests received.", {"route", "code"});
//   Counter& ok_chat = requests.WithLabels({"chat", "200"});  // cache this
//   ok_chat.Inc();                                           // lock-free
//
// Contract:
// - A family has a name, help text and a fixed list of label names. Its
//   children (one per set of label values) are created on first WithLabels and
//   live as long as the registry, so hot paths look a child up once, keep the
//   reference, and then update it with a few relaxed atomics and no lock.
// - Registration mistakes (a bad or duplicate name, a counter not ending in
//   `_total`, empty help, bad bucket bounds, the wrong number of label values)
//   are programming errors and CHECK-fail: families are registered at start-up
//   with literals. Label *values* may come from anywhere: they are escaped and
//   invalid UTF-8 in them becomes U+FFFD.
// - Render() lists families in registration order and each family's children
//   sorted by label values; a family with no children is left out. Each value
//   is read atomically, but a render is not a snapshot of the whole registry
//   (a histogram's _sum may miss an observation its buckets have); a
//   histogram's _count always equals its +Inf bucket.
//
// Thread safety: everything is thread-safe. Registration, WithLabels, Remove
// and Render take short internal locks; Counter/Gauge/Histogram updates are
// lock-free. Callbacks of callback families run inside Render, on the
// rendering thread, with no registry lock held (they may be called by two
// renders at once).
#ifndef TANDEM_COMMON_METRICS_H_
#define TANDEM_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/types/span.h"

namespace tandem {

// The Content-Type of MetricsRegistry::Render()'s output.
inline constexpr std::string_view kPrometheusTextContentType = "text/plain; version=0.0.4; charset=utf-8";

// Label values of one child, in the order of its family's label names:
// `family.WithLabels({"chat", "200"})`, `WithLabels({worker_id})` (a braced
// list of strings or string_views; a std::vector<std::string_view> works too).
using LabelValues = absl::Span<const std::string_view>;

// A monotonically increasing value (requests, bytes, errors).
class Counter {
 public:
  // Adds `v`. A counter never goes down: a negative or NaN `v` is dropped.
  // Integral increments (the common Inc()) are a single atomic add; others a
  // compare-and-swap loop on a double.
  void Inc(double v = 1);
  double Value() const;

 private:
  template <typename T>
  friend class MetricFamily;
  Counter() = default;
  void Reset();

  std::atomic<uint64_t> whole_{0};   // sum of the integral increments
  std::atomic<double> fraction_{0};  // sum of the others
};

// A value that goes up and down (queue depth, in-flight requests).
class Gauge {
 public:
  void Set(double v);
  void Inc(double v = 1);
  void Dec(double v = 1) { Inc(-v); }
  double Value() const;

 private:
  template <typename T>
  friend class MetricFamily;
  Gauge() = default;
  void Reset() { Set(0); }

  std::atomic<double> value_{0};
};

// A distribution over fixed buckets (latencies in seconds, sizes in tokens).
class Histogram {
 public:
  // Counts `v` in the first bucket whose upper bound is >= v (the +Inf bucket
  // when none is, or when v is NaN) and adds it to the sum: two atomics.
  void Observe(double v);

  struct Snapshot {
    std::vector<uint64_t> cumulative;  // per bound, then +Inf; non-decreasing
    double sum = 0;
    uint64_t count() const { return cumulative.empty() ? 0 : cumulative.back(); }
  };
  Snapshot Read() const;
  // The finite upper bounds, strictly increasing (+Inf is implied).
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  template <typename T>
  friend class MetricFamily;
  explicit Histogram(const std::vector<double>& bounds);
  void Reset();

  const std::vector<double>& bounds_;                // owned by the family
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, not cumulative; last is +Inf
  std::atomic<double> sum_{0};
};

// OK when `bounds` can be a histogram's bucket upper bounds: at least one,
// none NaN or -Inf, strictly increasing. A trailing +Inf is allowed (and
// dropped: the +Inf bucket is always there).
absl::Status ValidateBucketBounds(absl::Span<const double> bounds);
// `count` bounds: start, start*factor, start*factor^2, ...
// REQUIRES: start > 0, factor > 1, count >= 1.
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// `count` bounds: start, start+width, start+2*width, ...
// REQUIRES: width > 0, count >= 1.
std::vector<double> LinearBuckets(double start, double width, int count);

namespace metrics_internal {

enum class MetricType { kCounter, kGauge, kHistogram };

// What the registry holds: a named, typed family that renders itself.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, std::vector<std::string> label_names, MetricType type);
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  MetricType type() const { return type_; }

  // Appends the family's # HELP, # TYPE and sample lines to `out`; nothing
  // when it has no children.
  virtual void AppendTo(std::string* out) const = 0;

 protected:
  // The # HELP and # TYPE lines.
  void AppendHeader(std::string* out) const;

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const MetricType type_;
};

// Orders children by their label values, looked up without copying them.
struct LabelValuesLess {
  using is_transparent = void;
  bool operator()(const std::vector<std::string>& a, const std::vector<std::string>& b) const { return a < b; }
  bool operator()(const std::vector<std::string>& a, LabelValues b) const;
  bool operator()(LabelValues a, const std::vector<std::string>& b) const;
};

// Prometheus text-format pieces, exposed for tests.
// `v` as Prometheus reads it: integers below 2^53 without exponent or point
// ("3"), others in the shortest form that reads back exactly ("0.25",
// "1e-05"), and "+Inf", "-Inf", "NaN".
std::string FormatValue(double v);
bool IsValidMetricName(std::string_view name);  // [a-zA-Z_:][a-zA-Z0-9_:]*
bool IsValidLabelName(std::string_view name);   // [a-zA-Z_][a-zA-Z0-9_]*

}  // namespace metrics_internal

// A family of counters, gauges or histograms: T is Counter, Gauge or Histogram.
template <typename T>
class MetricFamily final : public metrics_internal::FamilyBase {
 public:
  // The child with these label values, created on first use; the reference
  // stays valid as long as the registry. REQUIRES: as many values as the
  // family has label names (CHECKed).
  T& WithLabels(LabelValues values);
  // The only child of a family with no label names; it exists (at zero) from
  // registration on, so it is rendered before its first update.
  T& Get();
  // Drops the child with these label values from the output (a worker left
  // the pool); no-op when there is none. References to it stay valid, but
  // their updates are not rendered until WithLabels brings the child back,
  // reset to zero.
  void Remove(LabelValues values);

  void AppendTo(std::string* out) const override;

 private:
  friend class MetricsRegistry;
  MetricFamily(std::string name, std::string help, std::vector<std::string> label_names,
               metrics_internal::MetricType type, std::vector<double> bucket_bounds);
  std::unique_ptr<T> NewChild() const;
  void AppendChild(const std::vector<std::string>& values, const T& child, std::string* out) const;

  struct Entry {
    std::unique_ptr<T> child;
    bool removed = false;  // hidden by Remove; kept so cached references stay valid
  };
  const std::vector<double> bucket_bounds_;  // histograms only
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, Entry, metrics_internal::LabelValuesLess> children_ ABSL_GUARDED_BY(mu_);
};

using CounterFamily = MetricFamily<Counter>;
using GaugeFamily = MetricFamily<Gauge>;
using HistogramFamily = MetricFamily<Histogram>;

extern template class MetricFamily<Counter>;
extern template class MetricFamily<Gauge>;
extern template class MetricFamily<Histogram>;

// Collects the samples of a callback family at render time.
class MetricEmitter {
 public:
  // One sample. REQUIRES: as many values as the family has label names
  // (CHECKed). Samples are rendered sorted by label values; of several with
  // the same label values only the first emitted is kept.
  void Emit(LabelValues label_values, double value);

 private:
  friend class CallbackFamily;
  explicit MetricEmitter(size_t num_labels) : num_labels_(num_labels) {}

  size_t num_labels_;
  std::vector<std::pair<std::vector<std::string>, double>> samples_;
};

// Computes a family's samples when it is rendered (per-worker in-flight
// requests, KV index size): emits (label values, value) pairs. Must be
// thread-safe: two renders may run it at once. It runs with no registry lock
// held, so it may take its own locks.
using MetricCallback = std::function<void(MetricEmitter&)>;

class CallbackFamily final : public metrics_internal::FamilyBase {
 public:
  void AppendTo(std::string* out) const override;

 private:
  friend class MetricsRegistry;
  CallbackFamily(std::string name, std::string help, std::vector<std::string> label_names,
                 metrics_internal::MetricType type, MetricCallback callback);

  const MetricCallback callback_;
};

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Registration. The returned family lives as long as the registry.
  // REQUIRES (CHECKed): `name` is a valid metric name not used by another
  // family's samples (a histogram "x" also takes x_bucket, x_sum, x_count);
  // counter names end in `_total`; `help` is not empty; label names are
  // valid, distinct, do not start with "__", and are not "le" in a histogram;
  // ValidateBucketBounds(bucket_bounds) is OK.
  CounterFamily& AddCounter(std::string_view name, std::string_view help, std::vector<std::string> label_names = {});
  GaugeFamily& AddGauge(std::string_view name, std::string_view help, std::vector<std::string> label_names = {});
  HistogramFamily& AddHistogram(std::string_view name, std::string_view help, std::vector<std::string> label_names,
                                std::vector<double> bucket_bounds);
  // Families whose samples `callback` emits at each Render().
  void AddCallbackCounter(std::string_view name, std::string_view help, std::vector<std::string> label_names,
                          MetricCallback callback);
  void AddCallbackGauge(std::string_view name, std::string_view help, std::vector<std::string> label_names,
                        MetricCallback callback);

  // The Prometheus text exposition (format 0.0.4) of every family.
  std::string Render() const;

 private:
  // CHECKs the name, help and label names, claims the sample names.
  void CheckNewFamily(std::string_view name, std::string_view help, const std::vector<std::string>& label_names,
                      metrics_internal::MetricType type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable std::mutex mu_;
  // Never shrinks: families' addresses are stable.
  std::vector<std::unique_ptr<metrics_internal::FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  std::set<std::string, std::less<>> sample_names_ ABSL_GUARDED_BY(mu_);  // names taken so far
};

}  // namespace tandem

#endif  // TANDEM_COMMON_METRICS_H_
