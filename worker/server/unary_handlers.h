// The handlers of tandem.v1.Worker's unary methods (UnaryCall serves them;
// WorkerService::Serve says who may call each). A handler reads the worker
// through WorkerService, converts with proto_convert.h, fills the response
// and calls `finish` once: at once, or from the engine's or the KV
// transport's thread when the answer comes later (ClearKvCache, KvReady).
//
// Thread-safe; called on the poller thread.
#ifndef TANDEM_WORKER_SERVER_UNARY_HANDLERS_H_
#define TANDEM_WORKER_SERVER_UNARY_HANDLERS_H_

#include <grpcpp/grpcpp.h>

#include "tandem/v1/worker.pb.h"
#include "worker/server/unary_call.h"
#include "worker/server/worker_service.h"

namespace tandem::worker {

// SERVING while the worker takes new requests (WorkerService::serving), with
// its role and instance id.
void HandleHealth(WorkerService& worker, const grpc::ServerContext& ctx, const tandem::v1::HealthRequest& request,
                  tandem::v1::HealthResponse* response, UnaryFinish finish);
// The model, its KV geometry and what the router must agree on (block size,
// hash seed, tokenizer).
void HandleGetModelInfo(WorkerService& worker, const grpc::ServerContext& ctx,
                        const tandem::v1::ModelInfoRequest& request, tandem::v1::ModelInfo* response,
                        UnaryFinish finish);
// The engine's, the KV hand-off's and the service's counters.
void HandleGetLoad(WorkerService& worker, const grpc::ServerContext& ctx, const tandem::v1::LoadRequest& request,
                   tandem::v1::LoadReport* response, UnaryFinish finish);
// Empties the prefix cache at the engine's next step.
void HandleClearKvCache(WorkerService& worker, const grpc::ServerContext& ctx,
                        const tandem::v1::ClearKvCacheRequest& request, tandem::v1::ClearKvCacheResponse* response,
                        UnaryFinish finish);
// This worker's KV transport and pool (KvHandoff::LocalInfo).
void HandleGetKvTransferInfo(WorkerService& worker, const grpc::ServerContext& ctx,
                             const tandem::v1::KvTransferInfoRequest& request, tandem::v1::KvTransferInfo* response,
                             UnaryFinish finish);
// A prefill worker's hand-off (KvHandoff::KvReady), bounded by the caller's
// deadline.
void HandleKvReady(WorkerService& worker, const grpc::ServerContext& ctx, const tandem::v1::KvReadyRequest& request,
                   tandem::v1::KvReadyResponse* response, UnaryFinish finish);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_UNARY_HANDLERS_H_
