#include "common/grpc_poller.h"

#include "common/thread_util.h"

namespace tandem {

GrpcPoller::GrpcPoller()
    : owned_(std::make_unique<grpc::CompletionQueue>()),
      cq_(owned_.get()),
      thread_([this] { Run(); }) {}

GrpcPoller::GrpcPoller(grpc::CompletionQueue* cq) : cq_(cq), thread_([this] { Run(); }) {}

GrpcPoller::~GrpcPoller() {
  cq_->Shutdown();
  thread_.join();
}

GrpcPoller& GrpcPoller::Shared() {
  static GrpcPoller* const poller = new GrpcPoller();
  return *poller;
}

void GrpcPoller::Run() {
  SetThreadName("grpc_poller");
  void* tag = nullptr;
  bool ok = false;
  while (cq_->Next(&tag, &ok)) static_cast<GrpcTag*>(tag)->Done(ok);
}

}  // namespace tandem
