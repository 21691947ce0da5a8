// Router: the OpenAI-compatible front. It owns the HTTP server, the model's
// tokenizer and chat template, the Cluster (workers, health, KV events), the
// routing policies of each pool, admission limits and metrics, and serves:
//   POST /v1/chat/completions, POST /v1/completions   (JSON or SSE streams)
//   GET  /v1/models, GET /health, GET /metrics
//   POST /tokenize, POST /detokenize                  (vLLM's debugging aids)
// The life of a request is told in docs/architecture.md ("Life of a request
// through the router").
//
// Configuration: one RouterConfig. Reload() (SIGHUP in `tandem router`)
// re-reads the file; an invalid file keeps the running config and returns
// why. Pools, policies, disaggregation, timeouts, retries, limits, health and
// sessions apply to requests that start after the reload; the listener and
// the model (tokenizer, chat template) are fixed at startup, and a reload
// that changes them says so in the log.
//
// Thread safety: Start/Stop/Reload from one controlling thread; handlers run
// on the HTTP server's I/O threads and the GrpcPoller thread (worker streams).
#ifndef TANDEM_ORCHESTRATOR_SERVER_ROUTER_H_
#define TANDEM_ORCHESTRATOR_SERVER_ROUTER_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "orchestrator/config/router_config.h"

namespace tandem::router {

class Router {
 public:
  // Loads the model assets (tokenizer, chat template): a template the
  // interpreter cannot run fails here. `config_path` is what Reload reads;
  // empty: Reload fails.
  static absl::StatusOr<std::unique_ptr<Router>> Create(RouterConfig config, std::string config_path);
  ~Router();  // Stop()s

  // Starts health checks (one round runs before this returns, so workers
  // that are up serve at once) and the HTTP listener.
  absl::Status Start();
  // Stops accepting, lets streams finish for a short grace, cancels the
  // rest on the workers, stops background work. Idempotent.
  void Stop();
  // The bound HTTP port (the OS's choice for port 0).
  int port() const;
  // Re-reads the config file; see the file comment.
  absl::Status Reload();

  class Impl;

 private:
  explicit Router(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_ROUTER_H_
