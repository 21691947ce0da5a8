#include "worker/server/worker_service.h"

#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "worker/server/generate_call.h"
#include "worker/server/kv_events_call.h"
#include "worker/server/unary_call.h"
#include "worker/server/unary_handlers.h"

namespace tandem::worker {
namespace {

std::string NewInstanceId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

}  // namespace

WorkerService::WorkerService(Engine* engine, WorkerRole role, grpc::ServerCompletionQueue* cq,
                             kvtransfer::Transport* transport, KvHandoffConfig kv, WorkerSecurity security)
    : engine_(engine),
      cq_(cq),
      role_(role),
      instance_id_(NewInstanceId()),
      kv_domain_(kv.domain),
      security_(std::move(security)),
      kv_handoff_(engine_, role_, transport, instance_id_, kv, cq_, security_.channels, security_.kv_peer_allow) {}

grpc::Status WorkerService::Authorize(const grpc::ServerContext& ctx, const char* method, Admits admits) {
  if (!security_.mutual_tls) return grpc::Status::OK;
  const tls::Peer peer = tls::PeerOf(ctx);
  const bool router = peer.role == tls::PeerRole::kRouter;
  const bool worker = peer.role == tls::PeerRole::kWorker;
  if (peer.authenticated && ((admits != Admits::kWorker && router) || (admits != Admits::kRouter && worker))) {
    return grpc::Status::OK;
  }
  const int64_t n = ++calls_denied_;
  const std::string wanted = admits == Admits::kRouter   ? absl::StrCat("the router role (", tls::kRouterIdentity, ")")
                             : admits == Admits::kWorker ? absl::StrCat("the worker role (", tls::kWorkerIdentity, ")")
                                                         : std::string("the router or worker role");
  const std::string why = peer.authenticated
                              ? absl::StrFormat("%s needs a certificate with %s; the caller's (CN '%s') has role %s",
                                                method, wanted, peer.name, tls::PeerRoleName(peer.role))
                              : absl::StrFormat("%s needs a client certificate of the cluster CA", method);
  if (n <= 10 || n % 1000 == 0) {
    LOG(WARNING) << "refused a call from " << ctx.peer() << ": " << why << " (" << n << " refused so far)";
  }
  return grpc::Status(peer.authenticated ? grpc::StatusCode::PERMISSION_DENIED : grpc::StatusCode::UNAUTHENTICATED,
                      why);
}

std::string WorkerService::CallerKey(const grpc::ServerContext& ctx) const {
  if (security_.mutual_tls) {
    const tls::Peer peer = tls::PeerOf(ctx);
    if (peer.authenticated) return absl::StrCat("cert:", peer.name);
  }
  // "ipv4:127.0.0.1:54321", "ipv6:[::1]:54321": the address without the port.
  std::string peer = ctx.peer();
  const size_t colon = peer.rfind(':');
  if (colon != std::string::npos && colon > 5) peer.resize(colon);
  return peer;
}

WorkerService::~WorkerService() = default;

void WorkerService::Serve() {
  AwaitGenerateCall(GenerateContext{.service = this, .cq = cq_, .engine = engine_, .kv = &kv_handoff_});
  AwaitKvEventsCall(this, cq_, engine_, instance_id_);
  // Who may call what, with mutual TLS (the header says why).
  AwaitUnaryCall(this, cq_, "Health", Admits::kRouterOrWorker, &WorkerService::RequestHealth, HandleHealth);
  AwaitUnaryCall(this, cq_, "GetModelInfo", Admits::kRouterOrWorker, &WorkerService::RequestGetModelInfo,
                 HandleGetModelInfo);
  AwaitUnaryCall(this, cq_, "GetLoad", Admits::kRouterOrWorker, &WorkerService::RequestGetLoad, HandleGetLoad);
  AwaitUnaryCall(this, cq_, "ClearKvCache", Admits::kRouter, &WorkerService::RequestClearKvCache, HandleClearKvCache);
  AwaitUnaryCall(this, cq_, "GetKvTransferInfo", Admits::kRouter, &WorkerService::RequestGetKvTransferInfo,
                 HandleGetKvTransferInfo);
  AwaitUnaryCall(this, cq_, "KvReady", Admits::kWorker, &WorkerService::RequestKvReady, HandleKvReady);
}

void WorkerService::Shutdown() {
  kv_handoff_.Stop();
  std::unique_lock<std::shared_mutex> lock(ops_mu_);
  ops_closed_ = true;
}

void WorkerService::StartDrain() {
  draining_.store(true);
  engine_->events().WakeListeners();  // the KV event streams announce it
}

bool WorkerService::serving() const { return engine_->running() && !draining(); }

KvHandoffStats WorkerService::kv_stats() const { return kv_handoff_.stats(); }

}  // namespace tandem::worker
