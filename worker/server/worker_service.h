// WorkerService: the tandem.v1.Worker gRPC service over an Engine, on gRPC's
// callback API. The service only converts between protobuf and engine types
// and moves results between threads: each Generate stream is a write reactor
// fed by the engine thread through an OutputSink that coalesces tokens while
// a write is in flight; cancelling the call (client gone, deadline passed)
// cancels the request in the engine, which frees its blocks.
//
// Thread-safe; gRPC calls it from its own threads.
#ifndef TANDEM_WORKER_SERVER_WORKER_SERVICE_H_
#define TANDEM_WORKER_SERVER_WORKER_SERVICE_H_

#include <memory>
#include <string>

#include "kvtransfer/transport.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/engine/engine.h"
#include "worker/server/kv_handoff.h"

namespace tandem::worker {

class WorkerService final : public tandem::v1::Worker::CallbackService {
 public:
  // `role` is reported by Health and GetModelInfo ("prefill", "decode", "both")
  // and decides which disaggregation calls are served. `transport` (may be
  // null) is the worker's KV transport, its pool registered; it must outlive
  // the service.
  WorkerService(Engine* engine, std::string role, kvtransfer::Transport* transport = nullptr,
                KvHandoffConfig kv = {});
  ~WorkerService() override;

  grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* ctx, const tandem::v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* ctx,
                                   const tandem::v1::HealthRequest* request,
                                   tandem::v1::HealthResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx,
                                         const tandem::v1::ModelInfoRequest* request,
                                         tandem::v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* ctx,
                                    const tandem::v1::LoadRequest* request,
                                    tandem::v1::LoadReport* response) override;
  grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* StreamKvEvents(
      grpc::CallbackServerContext* ctx, const tandem::v1::KvEventsRequest* request) override;
  grpc::ServerUnaryReactor* ClearKvCache(grpc::CallbackServerContext* ctx,
                                         const tandem::v1::ClearKvCacheRequest* request,
                                         tandem::v1::ClearKvCacheResponse* response) override;

  grpc::ServerUnaryReactor* GetKvTransferInfo(grpc::CallbackServerContext* ctx,
                                              const tandem::v1::KvTransferInfoRequest* request,
                                              tandem::v1::KvTransferInfo* response) override;
  grpc::ServerUnaryReactor* KvReady(grpc::CallbackServerContext* ctx,
                                    const tandem::v1::KvReadyRequest* request,
                                    tandem::v1::KvReadyResponse* response) override;

  const std::string& instance_id() const { return instance_id_; }

 private:
  Engine* const engine_;
  kvtransfer::Transport* const transport_;
  const std::string role_;
  const std::string instance_id_;
  const KvHandoffConfig kv_;
  std::unique_ptr<KvReceiver> receiver_;  // with a transport
  std::unique_ptr<KvSender> sender_;      // with a transport
};

// Converts the wire sampling parameters to the engine's (defaults applied).
SamplingParams FromProto(const tandem::v1::SamplingParams& p);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_WORKER_SERVICE_H_
