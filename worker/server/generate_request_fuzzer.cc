// libFuzzer target: a Generate call as a worker receives it. An input is the
// bytes of a GenerateRequest on the wire; one that protobuf parses is sent
// to a real WorkerService over an in-process gRPC channel, on a real Engine
// running builtin:tiny (role "both", loopback KV transport), so the request
// meets every check a worker makes on arrival: the KV transfer parameters,
// the prompt's ids and length, the sampling values. The stream is read up to
// its first message (an error, the first token, or a RECEIVE reservation)
// and then cancelled.
//
// Checks beyond ASan/UBSan: a refusal is INVALID_ARGUMENT,
// FAILED_PRECONDITION or RESOURCE_EXHAUSTED (never INTERNAL or UNKNOWN), no
// call outlives its 10 s deadline, and every 256 inputs (and at exit) the
// engine is idle again within 5 s with no KV block used, reserved or held
// (no request leaks its blocks, however it ended).
//
// A SEND request's decode_address is replaced by 127.0.0.1:1 (a closed port)
// so that the fuzzer never dials a host it made up; the address's own checks
// are not fuzzed here.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "common/grpc_poller.h"
#include "kvtransfer/loopback/loopback_transport.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/engine/engine.h"
#include "worker/model/model_loader.h"
#include "worker/server/worker_service.h"

namespace tandem::worker {
namespace {

struct Worker {
  std::shared_ptr<kvtransfer::LoopbackFabric> fabric = std::make_shared<kvtransfer::LoopbackFabric>();
  std::unique_ptr<kvtransfer::LoopbackTransport> transport;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  std::unique_ptr<WorkerService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<GrpcPoller> poller;
  std::unique_ptr<tandem::v1::Worker::Stub> stub;
};

Worker* Start() {
  auto* w = new Worker();
  absl::StatusOr<LoadedModel> model = LoadModel("builtin:tiny");
  if (!model.ok()) std::abort();
  EngineConfig config;
  config.kv_cache_bytes = 8 << 20;
  config.max_model_len = 64;  // bounds the prefill an input can ask for (4 KV blocks: every
                              // multi-block path, at a quarter of the prefill cost of 256)
  config.threads = 1;
  config.log_stats_interval_s = 0;
  config.transfer_quarantine_s = 0;  // blocks come back at once
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(config, *std::move(model));
  if (!engine.ok()) std::abort();
  w->engine = *std::move(engine);
  w->transport = std::make_unique<kvtransfer::LoopbackTransport>(w->fabric);
  if (!w->transport->RegisterPool(w->engine->pool_layout(), w->engine->kv_data()).ok()) std::abort();
  w->engine->Start();
  grpc::ServerBuilder builder;
  w->cq = builder.AddCompletionQueue();
  const KvHandoffConfig kv{.receive_timeout = std::chrono::milliseconds(200),
                           .hold_timeout = std::chrono::milliseconds(200)};
  w->service = std::make_unique<WorkerService>(w->engine.get(), WorkerRole::kBoth, w->cq.get(), w->transport.get(), kv);
  builder.RegisterService(w->service.get());
  w->server = builder.BuildAndStart();
  if (w->server == nullptr) std::abort();
  w->poller = std::make_unique<GrpcPoller>(w->cq.get());
  w->service->Serve();
  w->stub = tandem::v1::Worker::NewStub(w->server->InProcessChannel(grpc::ChannelArguments()));
  return w;
}

Worker& TheWorker() {
  static Worker* const w = Start();
  return *w;
}

void CheckIdle() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    const LoadSnapshot s = TheWorker().engine->GetLoad();
    if (s.running == 0 && s.waiting == 0 && s.reserved == 0 && s.prefilled == 0 && s.used_blocks == 0 &&
        s.quarantined_blocks == 0) {
      return;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr,
                   "the engine is not idle 5 s after the last call: running %d waiting %d reserved %d "
                   "prefilled %d used blocks %lld quarantined %lld\n",
                   s.running, s.waiting, s.reserved, s.prefilled, static_cast<long long>(s.used_blocks),
                   static_cast<long long>(s.quarantined_blocks));
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Call(tandem::v1::GenerateRequest& req) {
  if (req.kv_transfer().mode() == tandem::v1::KvTransferParams::SEND && !req.kv_transfer().decode_address().empty()) {
    req.mutable_kv_transfer()->set_decode_address("127.0.0.1:1");
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  std::unique_ptr<grpc::ClientReader<tandem::v1::GenerateResponse>> reader = TheWorker().stub->Generate(&ctx, req);
  tandem::v1::GenerateResponse response;
  const bool got = reader->Read(&response);
  if (got) {
    ctx.TryCancel();  // accepted: enough; a cancel racing the error status would hide it
    while (reader->Read(&response)) {
    }
  }
  const grpc::Status status = reader->Finish();
  if (got) return;  // accepted, then cancelled by us
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::OK:  // finished at once (e.g. stopped on a stop id)
      return;
    default:
      std::fprintf(stderr, "Generate refused with %d: %s\n", static_cast<int>(status.error_code()),
                   status.error_message().c_str());
      std::abort();
  }
}

}  // namespace
}  // namespace tandem::worker

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tandem::worker::TheWorker();
  std::atexit(tandem::worker::CheckIdle);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static int calls = 0;
  tandem::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  tandem::worker::Call(req);
  if (++calls % 256 == 0) tandem::worker::CheckIdle();
  return 0;
}
