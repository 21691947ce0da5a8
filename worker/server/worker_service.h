// WorkerService: the tandem.v1.Worker gRPC service over an Engine, on gRPC's
// asynchronous (completion-queue) API: the worker process drains the
// server's completion queue with one GrpcPoller thread, which also carries
// the KvReady calls this worker makes (see common/grpc_poller.h for why not
// the callback API). The service only converts between protobuf and engine
// types and moves results between threads: each Generate stream is fed by
// the engine thread through an OutputSink that coalesces tokens while a
// write is in flight; cancelling the call (client gone, deadline passed)
// cancels the request in the engine, which frees its blocks.
//
// Use: construct with the server's completion queue, register with the
// ServerBuilder, start the server and a GrpcPoller on the queue, then
// Serve(). To stop: stop the engine, shut the server down, Shutdown() this
// service, then destroy the poller (which drains the queue) before the
// service.
//
// Trust (docs/architecture.md, "Security"): with mutual TLS every caller
// holds a certificate of the cluster CA, and each method admits only the
// roles that need it (kMethodRoles in the .cc): Generate, StreamKvEvents,
// ClearKvCache and GetKvTransferInfo the router; KvReady a worker; Health,
// GetModelInfo and GetLoad either. Others get PERMISSION_DENIED, counted
// (LoadReport.calls_denied) and logged. Insecure (--insecure) trusts every
// caller.
//
// Thread-safe; handlers run on the poller thread.
#ifndef TANDEM_WORKER_SERVER_WORKER_SERVICE_H_
#define TANDEM_WORKER_SERVER_WORKER_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/tls.h"
#include "kvtransfer/transport.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/engine/engine.h"
#include "worker/server/kv_handoff.h"
#include "worker/server/worker_role.h"

namespace tandem::worker {

// Who may call this worker and whom it calls.
struct WorkerSecurity {
  // Callers are authenticated by mutual TLS (the server's credentials
  // require a client certificate of the cluster CA) and methods check their
  // role. false: --insecure, every caller is trusted.
  bool mutual_tls = false;
  // The channels of this worker's KvReady calls to decode workers.
  std::shared_ptr<const tls::ChannelFactory> channels = tls::ChannelFactory::Insecure();
  // Where a SEND request may make this worker connect (peer_policy.h).
  PeerAllowList kv_peer_allow = PeerAllowList::Loopback();
};

// Which certificate roles a method admits (with mutual TLS).
enum class Admits { kRouter, kWorker, kRouterOrWorker };

class WorkerService final : public tandem::v1::Worker::AsyncService {
 public:
  // `role` is reported by Health and GetModelInfo (WorkerRoleName) and
  // decides which disaggregation calls are served. `transport` (may be
  // null) is the worker's KV transport, its pool registered; it must outlive
  // the service. `cq` is the server's completion queue.
  WorkerService(Engine* engine, WorkerRole role, grpc::ServerCompletionQueue* cq,
                kvtransfer::Transport* transport = nullptr, KvHandoffConfig kv = {},
                WorkerSecurity security = {});
  ~WorkerService() override;

  // Starts accepting calls (once the server has started).
  void Serve();
  // Stops the KvReady calls this worker makes (cancels those in flight and
  // waits for their answers, which need the poller running).
  void Shutdown();
  // Starts draining (SIGTERM): Health answers NOT_SERVING and new Generate
  // calls get UNAVAILABLE (the router retries them on another worker), while
  // calls in flight, and the KV hand-offs they wait for, go on.
  void StartDrain() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Takes new requests: the engine runs and the worker is not draining
  // (Health, grpc.health.v1, and the metrics port's /readyz say the same).
  bool serving() const;
  // The KV hand-off counters of both sides (zero without a KV transport).
  KvHandoffStats kv_stats() const;

  // The handlers of the unary methods: fill the response, then call
  // `finish` exactly once (from any thread).
  using Finish = std::function<void(const grpc::Status&)>;
  void HandleHealth(const grpc::ServerContext& ctx, const tandem::v1::HealthRequest& request,
              tandem::v1::HealthResponse* response, Finish finish);
  void HandleGetModelInfo(const grpc::ServerContext& ctx, const tandem::v1::ModelInfoRequest& request,
                    tandem::v1::ModelInfo* response, Finish finish);
  void HandleGetLoad(const grpc::ServerContext& ctx, const tandem::v1::LoadRequest& request,
               tandem::v1::LoadReport* response, Finish finish);
  void HandleClearKvCache(const grpc::ServerContext& ctx, const tandem::v1::ClearKvCacheRequest& request,
                    tandem::v1::ClearKvCacheResponse* response, Finish finish);
  void HandleGetKvTransferInfo(const grpc::ServerContext& ctx,
                         const tandem::v1::KvTransferInfoRequest& request,
                         tandem::v1::KvTransferInfo* response, Finish finish);
  void HandleKvReady(const grpc::ServerContext& ctx, const tandem::v1::KvReadyRequest& request,
               tandem::v1::KvReadyResponse* response, Finish finish);

  const std::string& instance_id() const { return instance_id_; }

  // OK when the call's caller may call `method` (always without TLS);
  // otherwise the status to end the call with, counted and logged.
  grpc::Status Authorize(const grpc::ServerContext& ctx, const char* method, Admits admits);
  // Whom per-caller limits count: the certificate's common name with TLS,
  // the peer's IP address without.
  std::string CallerKey(const grpc::ServerContext& ctx) const;

 private:
  Engine* const engine_;
  grpc::ServerCompletionQueue* const cq_;
  const WorkerRole role_;
  std::atomic<bool> draining_{false};
  const std::string instance_id_;
  const WorkerSecurity security_;
  std::atomic<int64_t> calls_denied_{0};
  KvHandoff kv_handoff_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_WORKER_SERVICE_H_
