// The StreamKvEvents call: the router's subscription to this worker's KV
// cache events (worker.proto, KvEventsRequest), read from the engine's
// KvEventLog (worker_service.h has the wiring).
//
// KvEventsCall (in the .cc) sends a snapshot when needed (in chunks), then
// events as they come, each batch bounded in size so default gRPC clients
// (4 MiB messages) can read it; and, once, that the worker drains (in the
// next batch, alone if no events are due; the only batch of a status_only
// stream). Lifetime as a Generate call's: it waits for
// its call, serves it, and deletes itself when its Finish completed and gRPC
// said the call is done.
//
// Thread-safe: the log's listener (engine thread) and the poller thread
// share the stream's state under its mutex.
#ifndef TANDEM_WORKER_SERVER_KV_EVENTS_CALL_H_
#define TANDEM_WORKER_SERVER_KV_EVENTS_CALL_H_

#include <grpcpp/grpcpp.h>

#include <string>

#include "worker/engine/engine.h"

namespace tandem::worker {

class WorkerService;

// Waits for the next StreamKvEvents call on `cq`; each call, once it comes,
// waits for the one after. `instance_id` names this worker in every batch.
void AwaitKvEventsCall(WorkerService* service, grpc::ServerCompletionQueue* cq, Engine* engine,
                       const std::string& instance_id);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_KV_EVENTS_CALL_H_
