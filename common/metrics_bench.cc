// metrics_bench: tandem's metrics registry (common/metrics.h) against
// prometheus-cpp's core (Debian's prometheus-cpp-dev, 1.0) on what the
// router's request path does with metrics, and on a scrape. Each case runs
// both implementations in the same process, one after the other, for about
// 0.3 s each, and prints nanoseconds per operation and the ratio
// prometheus-cpp / tandem (above 1: prometheus-cpp is slower). Issue 23 asks
// for prometheus-cpp unless it costs the request path more than today's
// code; docs/benchmarks.md has the numbers and the decision.
//
//   build/common/metrics_bench
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics.h"

namespace {

using Clock = std::chrono::steady_clock;

// Nanoseconds per call of `op` (which does `batch` operations per call),
// over about 0.3 s after a warm-up.
double NsPerOp(const std::function<void()>& op, int batch) {
  for (int i = 0; i < 1000; ++i) op();
  int64_t calls = 0;
  const Clock::time_point start = Clock::now();
  Clock::time_point now = start;
  while (now - start < std::chrono::milliseconds(300)) {
    for (int i = 0; i < 100; ++i) op();
    calls += 100;
    now = Clock::now();
  }
  return std::chrono::duration<double, std::nano>(now - start).count() / static_cast<double>(calls * batch);
}

// Both implementations of one case, in two threads at once (contention).
double NsPerOpThreads(const std::function<void()>& op, int threads) {
  std::vector<double> ns(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { ns[t] = NsPerOp(op, 1); });
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double v : ns) sum += v;
  return sum / threads;
}

void Row(const char* what, double tandem_ns, double prom_ns) {
  std::printf("| %-58s | %10.1f | %10.1f | %6.2fx |\n", what, tandem_ns, prom_ns, prom_ns / tandem_ns);
}

volatile double sink = 0;

}  // namespace

int main() {
  // tandem: the router's request counter, TTFT histogram (17 buckets) and
  // inter-token histogram (15 buckets), as router_metrics.cc declares them.
  tandem::MetricsRegistry ours;
  tandem::CounterFamily& our_requests =
      ours.AddCounter("tandem_router_requests_total", "Requests.", {"endpoint", "code"});
  tandem::HistogramFamily& our_ttft =
      ours.AddHistogram("tandem_router_ttft_seconds", "TTFT.", {"mode"}, tandem::ExponentialBuckets(0.001, 2, 17));
  tandem::HistogramFamily& our_itl =
      ours.AddHistogram("tandem_router_itl_seconds", "ITL.", {"mode"}, tandem::ExponentialBuckets(0.0005, 2, 15));

  prometheus::Registry theirs;
  auto& their_requests =
      prometheus::BuildCounter().Name("tandem_router_requests_total").Help("Requests.").Register(theirs);
  auto& their_ttft = prometheus::BuildHistogram().Name("tandem_router_ttft_seconds").Help("TTFT.").Register(theirs);
  auto& their_itl = prometheus::BuildHistogram().Name("tandem_router_itl_seconds").Help("ITL.").Register(theirs);
  std::vector<double> ttft_bounds, itl_bounds;
  for (double b : tandem::ExponentialBuckets(0.001, 2, 17)) ttft_bounds.push_back(b);
  for (double b : tandem::ExponentialBuckets(0.0005, 2, 15)) itl_bounds.push_back(b);
  const prometheus::Histogram::BucketBoundaries ttft_b(ttft_bounds.begin(), ttft_bounds.end());
  const prometheus::Histogram::BucketBoundaries itl_b(itl_bounds.begin(), itl_bounds.end());

  std::printf("| operation | tandem ns/op | prometheus-cpp ns/op | ratio |\n|---|---|---|---|\n");

  // Per request: a labelled counter looked up and incremented (requests{endpoint, code}).
  Row("labelled counter: look up {endpoint, code} and increment",
      NsPerOp(
          [&] {
            our_requests.WithLabels({"chat", "200"}).Inc();
          },
          1),
      NsPerOp(
          [&] {
            their_requests.Add({{"endpoint", "chat"}, {"code", "200"}}).Increment();
          },
          1));
  // Per request: a labelled histogram observation (ttft{mode}).
  double x = 0;
  Row("labelled histogram (17 buckets): look up {mode} and observe",
      NsPerOp([&] { our_ttft.WithLabels({"disaggregated"}).Observe(x += 1e-4); }, 1),
      NsPerOp(
          [&] {
            their_ttft.Add({{"mode", "disaggregated"}}, ttft_b).Observe(x += 1e-4);
          },
          1));
  // Per token: the inter-token histogram, its child held (how a hot path should use either).
  tandem::Histogram& our_itl_child = our_itl.WithLabels({"disaggregated"});
  prometheus::Histogram& their_itl_child = their_itl.Add({{"mode", "disaggregated"}}, itl_b);
  Row("held histogram child (15 buckets): observe", NsPerOp([&] { our_itl_child.Observe(x += 1e-5); }, 1),
      NsPerOp([&] { their_itl_child.Observe(x += 1e-5); }, 1));
  tandem::Counter& our_child = our_requests.WithLabels({"chat", "200"});
  prometheus::Counter& their_child = their_requests.Add({{"endpoint", "chat"}, {"code", "200"}});
  Row("held counter child: increment", NsPerOp([&] { our_child.Inc(); }, 1),
      NsPerOp([&] { their_child.Increment(); }, 1));
  Row("held counter child: increment, 2 threads at once", NsPerOpThreads([&] { our_child.Inc(); }, 2),
      NsPerOpThreads([&] { their_child.Increment(); }, 2));
  Row("held histogram child: observe, 2 threads at once", NsPerOpThreads([&] { our_itl_child.Observe(0.01); }, 2),
      NsPerOpThreads([&] { their_itl_child.Observe(0.01); }, 2));

  // A scrape: 1,000 series (the per-worker families of a large cluster).
  for (int i = 0; i < 500; ++i) {
    const std::string worker = "10.0.0." + std::to_string(i) + ":9000";
    our_requests.WithLabels({worker, "200"}).Inc();
    our_ttft.WithLabels({worker}).Observe(0.1);
    their_requests.Add({{"endpoint", worker}, {"code", "200"}}).Increment();
    their_ttft.Add({{"mode", worker}}, ttft_b).Observe(0.1);
  }
  const prometheus::TextSerializer serializer;
  Row("scrape: render 1,000 series (500 counters, 500 histograms)",
      NsPerOp([&] { sink = sink + static_cast<double>(ours.Render().size()); }, 1),
      NsPerOp([&] { sink = sink + static_cast<double>(serializer.Serialize(theirs.Collect()).size()); }, 1));
  return 0;
}
