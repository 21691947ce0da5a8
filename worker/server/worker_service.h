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
// This class is the wiring: construction, Serve/Shutdown, authorization, and
// the list of calls it serves. Each call type lives in its own file:
// generate_call.h (Generate), kv_events_call.h (StreamKvEvents), and the
// unary methods' handlers (unary_handlers.h) served by one generic
// UnaryCall (unary_call.h). They convert with proto_convert.h and reach the
// disaggregation machinery only through KvHandoff (kv_handoff.h).
//
// Use: construct with the server's completion queue, register with the
// ServerBuilder, start the server and a GrpcPoller on the queue, then
// Serve(). To stop: stop the engine, shut the server down, Shutdown() this
// service, then destroy the poller (which drains the queue) before the
// service.
//
// Trust (docs/architecture.md, "Security"): with mutual TLS every caller
// holds a certificate of the cluster CA, and each method admits only the
// roles that need it (WorkerService::Serve lists them): Generate, StreamKvEvents,
// ClearKvCache and GetKvTransferInfo the router; KvReady a worker; Health,
// GetModelInfo and GetLoad either. Others get PERMISSION_DENIED, counted
// (LoadReport.calls_denied) and logged. Insecure (--insecure) trusts every
// caller.
//
// Thread-safe; handlers run on the poller thread.
#ifndef TANDEM_WORKER_SERVER_WORKER_SERVICE_H_
#define TANDEM_WORKER_SERVER_WORKER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>

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
                kvtransfer::Transport* transport = nullptr, KvHandoffConfig kv = {}, WorkerSecurity security = {});
  ~WorkerService() override;

  // Starts accepting calls (once the server has started).
  void Serve();
  // Stops the KvReady calls this worker makes (cancels those in flight and
  // waits for their answers, which need the poller running), then closes
  // StartOp: after the server's Shutdown, before the queue is shut down.
  void Shutdown();
  // Runs `start` (which starts an operation on the completion queue) unless
  // Shutdown has returned; false then. A call whose streams outlive the
  // server's Shutdown deadline (StreamKvEvents: cancelled by it) starts its
  // operations through this, so none starts on a queue shut down after it
  // (gRPC aborts the process on that).
  template <typename F>
  bool StartOp(F&& start) {
    std::shared_lock<std::shared_mutex> lock(ops_mu_);
    if (ops_closed_) return false;
    start();
    return true;
  }
  // Starts draining (SIGTERM): Health answers NOT_SERVING, the KV event
  // streams say so at once (KvEventBatch.draining), and new Generate calls
  // get UNAVAILABLE (the router retries them on another worker), while calls
  // in flight, and the KV hand-offs they wait for, go on.
  void StartDrain();
  bool draining() const { return draining_.load(); }
  // Generate streams accepted and not yet ended (their last message or
  // status may still be on its way after the engine is done with them): a
  // drain waits for these too, since the server's shutdown cancels them.
  void GenerateStreamOpened() { open_generate_streams_.fetch_add(1); }
  void GenerateStreamEnded() { open_generate_streams_.fetch_sub(1); }
  int64_t open_generate_streams() const { return open_generate_streams_.load(); }
  // Takes new requests: the engine runs and the worker is not draining
  // (Health, grpc.health.v1, and the metrics port's /readyz say the same).
  bool serving() const;
  // The KV hand-off counters of both sides (zero without a KV transport).
  KvHandoffStats kv_stats() const;

  // What the calls read and act on.
  Engine* engine() const { return engine_; }
  WorkerRole role() const { return role_; }
  const std::string& instance_id() const { return instance_id_; }
  const std::string& kv_domain() const { return kv_domain_; }
  KvHandoff& kv_handoff() { return kv_handoff_; }
  // Calls refused by Authorize so far (LoadReport.calls_denied).
  int64_t calls_denied() const { return calls_denied_.load(); }

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
  std::shared_mutex ops_mu_;
  bool ops_closed_ = false;  // guarded by ops_mu_ (StartOp)
  std::atomic<int64_t> open_generate_streams_{0};
  const std::string instance_id_;
  const std::string kv_domain_;
  const WorkerSecurity security_;
  std::atomic<int64_t> calls_denied_{0};
  KvHandoff kv_handoff_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_WORKER_SERVICE_H_
