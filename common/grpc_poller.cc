#include "common/grpc_poller.h"

#include <vector>

#include "common/thread_util.h"

namespace tandem {

namespace {
// The running poller thread's queue of RunAfterThisCompletion tasks.
thread_local std::vector<std::function<void()>>* t_after_completion = nullptr;
}  // namespace

GrpcPoller::GrpcPoller()
    : owned_(std::make_unique<grpc::CompletionQueue>()), cq_(owned_.get()), thread_([this] { Run(); }) {}

GrpcPoller::GrpcPoller(grpc::CompletionQueue* cq) : cq_(cq), thread_([this] { Run(); }) {}

GrpcPoller::~GrpcPoller() {
  cq_->Shutdown();
  thread_.join();
}

GrpcPoller& GrpcPoller::Shared() {
  static GrpcPoller* const poller = new GrpcPoller();
  return *poller;
}

bool GrpcPoller::RunAfterThisCompletion(std::function<void()>& task) {
  if (t_after_completion == nullptr) return false;
  t_after_completion->push_back(std::move(task));
  task = nullptr;
  return true;
}

void GrpcPoller::Run() {
  SetThreadName("grpc_poller");
  std::vector<std::function<void()>> after;
  std::vector<std::function<void()>> running;
  t_after_completion = &after;
  void* tag = nullptr;
  bool ok = false;
  while (cq_->Next(&tag, &ok)) {
    static_cast<GrpcTag*>(tag)->Done(ok);
    // Tasks may queue more: those run in this loop too.
    while (!after.empty()) {
      running.swap(after);
      for (auto& task : running) task();
      running.clear();
    }
  }
  t_after_completion = nullptr;
}

}  // namespace tandem
