#include "tests/testing/router_test.h"

#include <signal.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tandem::testing {
namespace {

std::string List(const std::vector<std::string>& addresses) {
  std::vector<std::string> quoted;
  for (const std::string& a : addresses) quoted.push_back(absl::StrCat("\"", a, "\""));
  return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
}

const std::vector<std::string> kSplitFlags = {"--kv-transport", "ucx", "--kv-transport-tls", "shm"};

}  // namespace

std::string RouterYaml::Text() const {
  std::string policy_yaml = absl::StrCat("    policy:\n      name: ", policy, "\n");
  if (!policy_params.empty()) absl::StrAppend(&policy_yaml, "      params:\n", policy_params);
  std::string y = absl::StrCat(
      "listener:\n  host: 127.0.0.1\n  port: 0\nmodel:\n  served_name: tiny\n"
      "  tokenizer: \"",
      tokenizer, "\"\n", model_extra, "pools:\n");
  if (!prefill.empty()) absl::StrAppend(&y, "  prefill:\n    workers: ", List(prefill), "\n", policy_yaml);
  absl::StrAppend(&y, "  decode:\n    workers: ", List(decode), "\n", policy_yaml);
  absl::StrAppend(&y, "disaggregation:\n  mode: ", prefill.empty() ? "never" : mode, "\n");
  if (auto_threshold_tokens > 0) {
    absl::StrAppend(&y, "  auto_threshold_tokens: ", auto_threshold_tokens, "\n");
  }
  absl::StrAppend(&y, "health:\n  interval_s: ", health_interval_s, "\n  timeout_s: ", health_interval_s, "\n");
  if (tls.has_value()) {
    absl::StrAppend(&y, "tls:\n  ca: \"", tls->ca, "\"\n  cert: \"", tls->cert, "\"\n  key: \"", tls->key, "\"\n");
  } else {
    absl::StrAppend(&y, "tls:\n  mode: insecure\n");
  }
  if (worker_details) absl::StrAppend(&y, "debug:\n  worker_details: true\n");
  absl::StrAppend(&y, extra);
  return y;
}

bool WaitHealthy(const std::string& url, std::chrono::milliseconds timeout) {
  return WaitUntil([&] { return HttpGet(url, "/health").status == 200; }, timeout, std::chrono::milliseconds(50));
}

RouterProcess* RouterTest::StartRouter(const RouterYaml& yaml, bool wait_healthy) {
  absl::StatusOr<std::unique_ptr<RouterProcess>> r = RouterProcess::Start(yaml.Text());
  if (!r.ok()) {
    ADD_FAILURE() << "cannot start the router: " << r.status() << "\n" << yaml.Text();
    return nullptr;
  }
  router_ = *std::move(r);
  if (wait_healthy && !WaitHealthy(router_->url(), std::chrono::seconds(30))) {
    ADD_FAILURE() << "the router at " << router_->url() << " never became healthy";
  }
  return router_.get();
}

void RouterTest::TearDown() {
  if (router_ != nullptr) {
    const int status = router_->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "the router did not exit cleanly (wait status " << status << "): see its log above";
    router_.reset();
  }
  WorkerTest::TearDown();
}

WorkerProcess* RouterTest::StartPrefill(std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--role", "prefill"};
  flags.insert(flags.end(), kSplitFlags.begin(), kSplitFlags.end());
  flags.insert(flags.end(), extra.begin(), extra.end());
  return StartWorker(flags);
}

WorkerProcess* RouterTest::StartDecode(std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--role", "decode"};
  flags.insert(flags.end(), kSplitFlags.begin(), kSplitFlags.end());
  flags.insert(flags.end(), extra.begin(), extra.end());
  return StartWorker(flags);
}

WorkerProcess* RouterTest::StartBoth(std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--role", "both"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return StartWorker(flags);
}

RouterTest::Reply RouterTest::Post(const std::string& target, const nlohmann::json& body, const Headers& headers) {
  Reply r;
  r.http = HttpPost(router_->url(), target, body.dump(), headers);
  r.json = nlohmann::json::parse(r.http.body, nullptr, false);
  if (r.json.is_discarded()) r.json = nullptr;
  return r;
}

RouterTest::Reply RouterTest::Get(const std::string& target, const Headers& headers) {
  Reply r;
  r.http = HttpCall(router_->url(), "GET", target, "", headers);
  r.json = nlohmann::json::parse(r.http.body, nullptr, false);
  if (r.json.is_discarded()) r.json = nullptr;
  return r;
}

std::future<RouterTest::Reply> RouterTest::PostAsync(const std::string& target, const nlohmann::json& body,
                                                     const Headers& headers) {
  return std::async(std::launch::async, [this, target, body, headers] { return Post(target, body, headers); });
}

std::optional<double> RouterTest::Metric(const std::string& series) {
  return ScrapeMetric(router_->url(), series, metrics_headers_);
}

bool RouterTest::WaitForMetric(const std::string& series, const std::function<bool(double)>& pred,
                               std::chrono::milliseconds timeout) {
  return WaitUntil([&] { return pred(Metric(series).value_or(0)); }, timeout);
}

PausedWorker::PausedWorker(WorkerProcess* w) : worker_(w) {
  ::kill(w->pid(), SIGSTOP);
  // The stop is asynchronous: wait until every thread of the worker is
  // stopped, so no request sent from now on gets an answer.
  const std::string tasks = absl::StrCat("/proc/", w->pid(), "/task");
  const bool stopped = WaitUntil(
      [&] {
        std::error_code ec;
        for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
          const std::optional<ProcStat> st = ReadProcStat(w->pid(), std::atoi(task.path().filename().c_str()));
          if (!st.has_value() || (st->state != 'T' && st->state != 't')) return false;
        }
        return !ec;
      },
      std::chrono::seconds(10), std::chrono::milliseconds(1));
  if (!stopped) ADD_FAILURE() << "worker " << w->pid() << " did not stop";
}

void PausedWorker::Resume() {
  if (worker_ != nullptr) ::kill(worker_->pid(), SIGCONT);
  worker_ = nullptr;
}

}  // namespace tandem::testing
