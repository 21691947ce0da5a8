// The Generate call: one server stream per request, fed by the engine
// thread and written on the poller thread (worker_service.h has the wiring).
//
// GenerateCall (in the .cc): the engine thread pushes tokens through the
// call's Sink; the call writes whatever accumulated since the last write as
// one message. Lifetime: a call object waits for its call (RequestGenerate),
// then serves it; it deletes itself once its last operation (Finish, or the
// last write with the status) completed and gRPC said the call is done
// (AsyncNotifyWhenDone). The Sink (shared with the engine) outlives it and
// drops output once the call is gone.
//
// How a stream ends: a normal finish sends the pending tokens with the finish
// reason and usage, status OK. An abort sends what is pending, then ends with
// CANCELLED (the client cancelled) or UNAVAILABLE (the worker is stopping, so
// the caller may retry elsewhere). A failed write (client gone) cancels the
// request in the engine and ends with CANCELLED.
//
// Disaggregation: a RECEIVE stream reserves instead of submitting and opens
// with the reservation; a SEND stream holds its last message until the KV
// hand-off has an answer (kv_transfer_error).
//
// Thread-safe: the call's state is guarded by its Sink's mutex.
#ifndef TANDEM_WORKER_SERVER_GENERATE_CALL_H_
#define TANDEM_WORKER_SERVER_GENERATE_CALL_H_

#include <grpcpp/grpcpp.h>

#include "worker/engine/engine.h"
#include "worker/server/kv_handoff.h"

namespace tandem::worker {

class WorkerService;

// What every Generate call shares; all outlive the calls.
struct GenerateContext {
  WorkerService* service;  // accepts, authorizes, drains
  grpc::ServerCompletionQueue* cq;
  Engine* engine;
  KvHandoff* kv;  // RECEIVE and SEND (KvTransferParams.mode)
};

// Waits for the next Generate call on `c.cq`. Each call, once it comes, waits
// for the one after, so that one is always waiting until the server shuts
// down.
void AwaitGenerateCall(const GenerateContext& c);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_GENERATE_CALL_H_
