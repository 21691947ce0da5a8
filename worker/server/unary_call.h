// UnaryCall: the one generic server of a unary tandem.v1.Worker method on
// gRPC's completion-queue API. It waits for the method's call (the service's
// Request<Method>), checks the caller's role (WorkerService::Authorize), runs
// the method's handler and sends the answer; each call, once it comes, waits
// for the one after. Adding a unary method is writing its handler
// (unary_handlers.h) and one AwaitUnaryCall line in WorkerService::Serve.
//
// Lifetime: a call deletes itself when its answer went out, or at once when
// the server shuts down before the call came. Runs on the poller thread; a
// handler may finish from any thread.
#ifndef TANDEM_WORKER_SERVER_UNARY_CALL_H_
#define TANDEM_WORKER_SERVER_UNARY_CALL_H_

#include <grpcpp/grpcpp.h>

#include <functional>

#include "common/grpc_poller.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/server/worker_service.h"

namespace tandem::worker {

// How a handler answers: with the status to finish the call with, after it
// filled the response. Called exactly once, from any thread.
using UnaryFinish = std::function<void(const grpc::Status&)>;
// A unary method's handler.
template <class Req, class Resp>
using UnaryHandler = void (*)(WorkerService& worker, const grpc::ServerContext& ctx, const Req& request, Resp* response,
                              UnaryFinish finish);

// A unary method as UnaryCall serves it.
template <class Req, class Resp>
struct UnaryMethod {
  using RequestFn = void (tandem::v1::Worker::AsyncService::*)(grpc::ServerContext*, Req*,
                                                               grpc::ServerAsyncResponseWriter<Resp>*,
                                                               grpc::CompletionQueue*, grpc::ServerCompletionQueue*,
                                                               void*);
  const char* name;  // for Authorize's refusals and logs
  Admits admits;     // who may call it, with mutual TLS
  RequestFn request;
  UnaryHandler<Req, Resp> handle;
};

template <class Req, class Resp>
class UnaryCall final : public GrpcTag {
 public:
  // Waits for the next call of `method` on `cq`.
  UnaryCall(WorkerService* service, grpc::ServerCompletionQueue* cq, const UnaryMethod<Req, Resp>& method)
      : service_(service), cq_(cq), method_(method), writer_(&ctx_) {
    (service_->*method_.request)(&ctx_, &req_, &writer_, cq_, cq_, this);
  }

  void Done(bool ok) override {
    if (accepted_ || !ok) {
      delete this;  // answered, or the server is shutting down
      return;
    }
    accepted_ = true;
    new UnaryCall(service_, cq_, method_);  // the next one
    if (grpc::Status auth = service_->Authorize(ctx_, method_.name, method_.admits); !auth.ok()) {
      writer_.FinishWithError(auth, this);
      return;
    }
    method_.handle(*service_, ctx_, req_, &resp_,
                   [this](const grpc::Status& status) { writer_.Finish(resp_, status, this); });
  }

 private:
  WorkerService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  const UnaryMethod<Req, Resp> method_;
  grpc::ServerContext ctx_;
  Req req_;
  Resp resp_;
  grpc::ServerAsyncResponseWriter<Resp> writer_;
  bool accepted_ = false;  // the poller thread's
};

// Serves a unary method from now until the server shuts down: `request` is
// the service's Request<Method>, `handle` its handler (the request and
// response types are the handler's).
template <class Req, class Resp>
void AwaitUnaryCall(WorkerService* service, grpc::ServerCompletionQueue* cq, const char* name, Admits admits,
                    typename UnaryMethod<Req, Resp>::RequestFn request, UnaryHandler<Req, Resp> handle) {
  new UnaryCall<Req, Resp>(service, cq, UnaryMethod<Req, Resp>{name, admits, request, handle});
}

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_UNARY_CALL_H_
