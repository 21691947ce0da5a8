// RouterTest: a gtest fixture for end-to-end tests of the router: real worker
// processes (WorkerTest) behind a real `tandem router` process, driven over
// HTTP. At teardown the router stops first and must exit 0, then the workers.
#ifndef TANDEM_TESTS_TESTING_ROUTER_TEST_H_
#define TANDEM_TESTS_TESTING_ROUTER_TEST_H_

#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/testing/http_client.h"
#include "tests/testing/worker_test.h"

namespace tandem::testing {

// The YAML of a router config. `prefill` empty: mode never (aggregated on the
// decode pool); otherwise `mode` ("always" or "auto").
struct RouterYaml {
  std::vector<std::string> prefill;
  std::vector<std::string> decode;
  std::string mode = "never";
  int auto_threshold_tokens = 0;  // 0: the default
  std::string policy = "round_robin";
  std::string policy_params;          // YAML lines under params, e.g. "seed: \"1\""
  std::string extra;                  // appended top-level YAML (limits, timeouts...)
  std::string tokenizer = "builtin";  // model.tokenizer
  std::string model_extra;            // YAML lines appended under model:, e.g. "  key: value\n"
  double health_interval_s = 0.5;
  // The router's identity for mutual TLS with its workers; unset: `tls:
  // {mode: insecure}`.
  std::optional<tls::TlsFiles> tls;
  // debug.worker_details: the x-tandem-*-worker headers that many tests
  // read (off by default in a router).
  bool worker_details = true;
  std::string Text() const;
};

class RouterTest : public WorkerTest {
 protected:
  // Starts a router; null and a failure if it does not come up. With
  // `wait_healthy`, returns once /health answers 200.
  RouterProcess* StartRouter(const RouterYaml& yaml, bool wait_healthy = true);
  void TearDown() override;

  // Workers with the disaggregation flags (UCX over shared memory).
  WorkerProcess* StartPrefill(std::vector<std::string> extra = {});
  WorkerProcess* StartDecode(std::vector<std::string> extra = {});
  WorkerProcess* StartBoth(std::vector<std::string> extra = {});

  // POSTs JSON to the router; parses the body when it is JSON.
  struct Reply {
    HttpResponse http;
    nlohmann::json json;  // null unless the body parsed
  };
  Reply Post(const std::string& target, const nlohmann::json& body, const Headers& headers = {});
  Reply Get(const std::string& target, const Headers& headers = {});

  // Post on another thread (the reply's future).
  std::future<Reply> PostAsync(const std::string& target, const nlohmann::json& body, const Headers& headers = {});
  // The value of one series on the router's /metrics, e.g.
  // `tandem_router_retries_total` or `tandem_router_worker_healthy{pool="decode",worker="h:p"}`
  // (labels in the order the metric declares them); nullopt if absent.
  std::optional<double> Metric(const std::string& series);
  // Polls Metric(series) until `pred` holds for it (absent reads as 0);
  // false after `timeout`.
  bool WaitForMetric(const std::string& series, const std::function<bool(double)>& pred,
                     std::chrono::milliseconds timeout = std::chrono::seconds(20));

  RouterProcess* router() { return router_.get(); }

  // Sent with Metric's /metrics requests (an admin key, when the router
  // has keys).
  Headers metrics_headers_;

 private:
  std::unique_ptr<RouterProcess> router_;
};

// SIGSTOPs a worker for its lifetime (SIGCONT at the end): a hung worker
// whose connections stay open, so requests the router sends it wait.
class PausedWorker {
 public:
  explicit PausedWorker(WorkerProcess* w);
  ~PausedWorker() { Resume(); }
  PausedWorker(const PausedWorker&) = delete;
  PausedWorker& operator=(const PausedWorker&) = delete;
  void Resume();

 private:
  WorkerProcess* worker_;
};

// Polls `url`/health until it answers 200 or `timeout` passes.
bool WaitHealthy(const std::string& url, std::chrono::milliseconds timeout);

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_ROUTER_TEST_H_
