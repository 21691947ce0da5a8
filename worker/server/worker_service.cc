#include "worker/server/worker_service.h"

#include <algorithm>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/block_hash.h"
#include "common/grpc_poller.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/server/proto_convert.h"

namespace tandem::worker {
namespace {

using tandem::v1::GenerateResponse;
using tandem::v1::KvEventBatch;

std::string NewInstanceId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

// How a Generate call takes part in disaggregation (KvTransferParams.mode).
struct GenerateContext {
  WorkerService* service;
  grpc::ServerCompletionQueue* cq;
  Engine* engine;
  KvHandoff* kv;
};

// One Generate stream. The engine thread pushes tokens through the Sink; the
// call writes whatever accumulated since the last write as one message.
// Lifetime: a call object waits for its call (RequestGenerate), then serves
// it; it deletes itself once its last operation (Finish, or the last write
// with the status) completed and gRPC said the call is done
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
class GenerateCall final {
 public:
  class Sink final : public OutputSink {
   public:
    Sink(GenerateCall* r, KvHandoff* kv) : reactor_(r), kv_(kv) {}
    void OnToken(const SampledToken& t) override {
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ != nullptr) reactor_->AddTokenLocked(t);
    }
    void OnFinish(const FinishInfo& info) override {
      ForgetReservation();
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ != nullptr) reactor_->FinishLocked(info);
    }
    void OnLocalPrefill(bool first_token_known) override {
      ForgetReservation();
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ != nullptr && !first_token_known) reactor_->pending_.set_includes_first_token(true);
    }
    // RECEIVE: the engine's answer to Reserve. The caller's charge passes
    // to the reservation, or back to the caller when there is none.
    void OnReserved(absl::StatusOr<Reservation> r, const KvReceiver::Waiting& waiting) {
      const KvReceiver::Handle handle = kv_->Reserved(r, waiting);
      if (handle.reservation_id != 0) reservation_id_ = handle.reservation_id;
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ != nullptr) reactor_->ReservedLocked(r, handle);
    }
    // SEND: the engine handed the prefilled blocks over (before OnFinish).
    void OnHandedOff() {
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ != nullptr) reactor_->awaiting_kv_ = true;
    }
    // SEND: the decode worker's answer ("" = it took the KV).
    void OnKvSent(const std::string& error, const tandem::v1::KvReadyResponse& answer) {
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ == nullptr) return;
      reactor_->kv_done_ = true;
      if (!error.empty()) reactor_->final_.set_kv_transfer_error(error);
      reactor_->final_.set_kv_transfer_bytes(answer.bytes_pulled());
      reactor_->final_.set_kv_transfer_seconds(answer.pull_seconds());
      reactor_->MaybeWriteLocked();
    }
    // Called when the call ends: no more output reaches it.
    void Detach() {
      ForgetReservation();
      std::lock_guard<std::mutex> lock(mu_);
      reactor_ = nullptr;
    }
    std::mutex& mu() ABSL_LOCK_RETURNED(mu_) { return mu_; }

   private:
    // The reservation takes no more KV once it ended or fell back.
    void ForgetReservation() {
      const uint64_t id = reservation_id_.exchange(0);
      if (id != 0) kv_->Forget(id);
    }

    std::mutex mu_;
    GenerateCall* reactor_ ABSL_GUARDED_BY(mu_);  // null once detached
    KvHandoff* const kv_;
    std::atomic<uint64_t> reservation_id_{0};
  };

  // Waits for the next Generate call.
  explicit GenerateCall(const GenerateContext& c) : c_(c), engine_(c.engine), writer_(&ctx_) {
    ctx_.AsyncNotifyWhenDone(&done_tag_);
    c.service->RequestGenerate(&ctx_, &req_, &writer_, c.cq, c.cq, &accept_tag_);
  }

 private:
  // The call came (ok), or the server is shutting down (a call that never
  // started gets no done notification).
  void OnAccepted(bool ok) {
    if (!ok) {
      delete this;
      return;
    }
    new GenerateCall(c_);  // the next one
    sink_ = std::make_shared<Sink>(this, c_.kv);
    Begin(c_, req_);
    if (notified_done_ && ctx_.IsCancelled()) OnCancel();
  }

  void Begin(const GenerateContext& c, const tandem::v1::GenerateRequest& req) {
    if (grpc::Status auth = c.service->Authorize(ctx_, "Generate", Admits::kRouter); !auth.ok()) {
      std::lock_guard<std::mutex> lock(sink_->mu());
      done_called_ = true;
      Finish(auth);
      return;
    }
    if (c.service->draining()) {
      std::lock_guard<std::mutex> lock(sink_->mu());
      done_called_ = true;
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "worker draining: shutting down, no new requests"));
      return;
    }
    GenerateSpec spec = FromProto(req);
    want_logprobs_ = spec.params.logprobs >= 0;
    const tandem::v1::KvTransferParams& kv = req.kv_transfer();
    if (spec.resume_output_tokens != 0 &&
        kv.mode() != tandem::v1::KvTransferParams::MODE_UNSPECIFIED) {
      FinishEarly(absl::InvalidArgumentError(
          "resume_output_tokens is for aggregated requests only (kv_transfer must be unset)"));
      return;
    }
    if (absl::Status bad = c.kv->CheckTransfer(kv, static_cast<int>(spec.prompt.size())); !bad.ok()) {
      FinishEarly(bad);
      return;
    }
    if (kv.mode() == tandem::v1::KvTransferParams::RECEIVE) {
      absl::StatusOr<KvHandoff::Receiving> receiving =
          c.kv->StartReceive(c.service->CallerKey(ctx_), spec.prompt, kv.timeout_ms());
      if (!receiving.ok()) {
        FinishEarly(receiving.status());
        return;
      }
      reserve_timeout_ms_ = receiving->timeout_ms;
      const Deadline deadline = receiving->waiting.deadline;
      engine_->Reserve(std::move(spec), sink_, deadline,
                       [sink = sink_, waiting = std::move(receiving->waiting)](absl::StatusOr<Reservation> r) {
                         sink->OnReserved(std::move(r), waiting);
                       });
      return;
    }
    if (kv.mode() == tandem::v1::KvTransferParams::SEND) {
      spec.hold_timeout = c.kv->engine_hold_timeout();
      spec.on_prefilled = [handoff = c.kv, sink = std::weak_ptr<Sink>(sink_), target = kv,
                           hash = HashTokens(spec.prompt)](const Prefilled& p) {
        // The sequence owns the sink; a weak reference avoids a cycle.
        std::shared_ptr<Sink> s = sink.lock();
        if (s) s->OnHandedOff();
        handoff->Send(target, hash, p, [s](const std::string& error, const tandem::v1::KvReadyResponse& answer) {
          if (s) s->OnKvSent(error, answer);
        });
      };
    }
    absl::StatusOr<uint64_t> id = engine_->Submit(std::move(spec), sink_);
    if (!id.ok()) {
      FinishEarly(id.status());
      return;
    }
    std::lock_guard<std::mutex> lock(sink_->mu());
    id_ = *id;
  }

  // A write completed, or the last operation did.
  void OnOpDone(bool ok) {
    {
      std::lock_guard<std::mutex> lock(sink_->mu());
      if (!done_called_) {
        writing_ = false;
        if (!ok) {
          // The client is gone: stop generating.
          done_called_ = true;
          if (id_ != 0) engine_->Cancel(id_);
          Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client stream closed"));
        } else {
          MaybeWriteLocked();
        }
        return;
      }
      last_op_done_ = true;
    }
    if (notified_done_) End();
  }

  // gRPC's word that the call is over (finished, or cancelled: the client
  // went away or its deadline passed).
  void OnCallDone(bool /*ok*/) {
    notified_done_ = true;
    if (sink_ == nullptr) return;  // not accepted yet: OnAccepted looks
    if (ctx_.IsCancelled()) OnCancel();
    {
      std::lock_guard<std::mutex> lock(sink_->mu());
      if (!last_op_done_) return;
    }
    End();
  }

  void OnCancel() {
    std::lock_guard<std::mutex> lock(sink_->mu());
    cancelled_ = true;
    if (id_ != 0) engine_->Cancel(id_);  // else: when the reservation is made
  }

  void End() {
    sink_->Detach();
    delete this;
  }

  void FinishEarly(const absl::Status& status) {
    std::lock_guard<std::mutex> lock(sink_->mu());
    done_called_ = true;
    Finish(ToGrpcStatus(status));
  }

  // The stream's operations, one at a time. REQUIRES: sink_->mu() held.
  void Finish(const grpc::Status& status) { writer_.Finish(status, &op_tag_); }
  void StartWrite(const GenerateResponse* msg) { writer_.Write(*msg, &op_tag_); }
  void StartWriteAndFinish(const GenerateResponse* msg, grpc::WriteOptions options,
                           const grpc::Status& status) {
    writer_.WriteAndFinish(*msg, options, status, &op_tag_);
  }

  // REQUIRES: sink_->mu() held (all below).
  void ReservedLocked(const absl::StatusOr<Reservation>& r, const KvReceiver::Handle& handle) {
    if (done_called_) return;
    if (!r.ok()) {
      done_called_ = true;
      Finish(ToGrpcStatus(r.status()));
      return;
    }
    id_ = r->id;
    if (cancelled_) engine_->Cancel(id_);
    tandem::v1::KvReservation* out = pending_.mutable_reservation();
    out->set_reservation_id(handle.reservation_id);
    out->set_reservation_token(handle.token);
    out->set_cached_tokens(r->cached_tokens);
    out->set_instance_id(c_.service->instance_id());
    out->set_timeout_ms(reserve_timeout_ms_);
    MaybeWriteLocked();
  }

  void AddTokenLocked(const SampledToken& t) {
    ToProto(t, want_logprobs_, pending_.add_tokens());
    MaybeWriteLocked();
  }

  void FinishLocked(const FinishInfo& info) {
    finished_ = true;
    if (info.reason == FinishReason::kAbort) {
      final_status_ = info.worker_stopping
                          ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is shutting down")
                          : grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled");
    }
    ToProto(info, &final_);
    MaybeWriteLocked();
  }

  void MaybeWriteLocked() {
    if (writing_ || done_called_) return;
    // A SEND stream's last message waits for the hand-off's answer.
    const bool final_ready = finished_ && (!awaiting_kv_ || kv_done_);
    if (final_ready && final_status_.ok()) {
      // The last message: whatever is pending, the finish reason and usage.
      pending_.MergeFrom(final_);
      done_called_ = true;
      StartWriteAndFinish(&pending_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    if (pending_.tokens_size() > 0 || pending_.has_reservation()) {
      current_.Clear();
      current_.Swap(&pending_);
      writing_ = true;
      StartWrite(&current_);
      return;
    }
    if (final_ready) {
      done_called_ = true;
      Finish(final_status_);
    }
  }

  const GenerateContext c_;
  Engine* const engine_;
  grpc::ServerContext ctx_;
  tandem::v1::GenerateRequest req_;
  grpc::ServerAsyncWriter<GenerateResponse> writer_;
  MemberTag<GenerateCall> accept_tag_{this, &GenerateCall::OnAccepted};
  MemberTag<GenerateCall> op_tag_{this, &GenerateCall::OnOpDone};
  MemberTag<GenerateCall> done_tag_{this, &GenerateCall::OnCallDone};
  bool notified_done_ = false;  // the poller thread's
  std::shared_ptr<Sink> sink_;  // from acceptance
  bool want_logprobs_ = false;
  uint32_t reserve_timeout_ms_ = 0;  // RECEIVE: the reservation's lifetime
  // The stream's state, shared with the engine thread through the Sink: its
  // mutex guards it, since the Sink outlives the call.
  uint64_t id_ ABSL_GUARDED_BY(sink_->mu()) = 0;            // the engine's id (0 until a reservation is made)
  GenerateResponse pending_ ABSL_GUARDED_BY(sink_->mu());   // not yet written
  GenerateResponse current_ ABSL_GUARDED_BY(sink_->mu());   // the message being written
  GenerateResponse final_ ABSL_GUARDED_BY(sink_->mu());     // finish reason and usage, once finished_
  grpc::Status final_status_ ABSL_GUARDED_BY(sink_->mu());  // OK, or why an aborted stream ends
  bool writing_ ABSL_GUARDED_BY(sink_->mu()) = false;
  bool finished_ ABSL_GUARDED_BY(sink_->mu()) = false;
  bool cancelled_ ABSL_GUARDED_BY(sink_->mu()) = false;     // OnCancel came
  bool awaiting_kv_ ABSL_GUARDED_BY(sink_->mu()) = false;   // SEND: handed off, the answer not yet in
  bool kv_done_ ABSL_GUARDED_BY(sink_->mu()) = false;
  bool done_called_ ABSL_GUARDED_BY(sink_->mu()) = false;   // Finish (or StartWriteAndFinish) was called
  bool last_op_done_ ABSL_GUARDED_BY(sink_->mu()) = false;  // ... and completed
};

// One KV event stream: a snapshot when needed (in chunks), then events as
// they come, each batch bounded in size so default gRPC clients (4 MiB
// messages) can read it.
// Lifetime as GenerateCall's: it waits for its call, serves it, and deletes
// itself when its Finish completed and gRPC said the call is done.
class KvEventsCall final {
 public:
  // Waits for the next StreamKvEvents call.
  KvEventsCall(WorkerService* service, grpc::ServerCompletionQueue* cq, Engine* engine,
               const std::string& instance_id)
      : service_(service),
        cq_(cq),
        engine_(engine),
        log_(engine->events()),
        instance_id_(instance_id),
        writer_(&ctx_) {
    ctx_.AsyncNotifyWhenDone(&done_tag_);
    service->RequestStreamKvEvents(&ctx_, &req_, &writer_, cq, cq, &accept_tag_);
  }

 private:
  void OnAccepted(bool ok) {
    if (!ok) {
      delete this;  // shutting down
      return;
    }
    new KvEventsCall(service_, cq_, engine_, instance_id_);  // the next one
    accepted_ = true;
    // Other users' prompts (token ids) flow here: the router's only.
    if (grpc::Status auth = service_->Authorize(ctx_, "StreamKvEvents", Admits::kRouter);
        !auth.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      FinishLocked(auth);
      return;
    }
    const tandem::v1::KvEventsRequest& req = req_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cursor_ = req.start_after_seq();
      need_snapshot_ = req.snapshot() || cursor_ > log_.last_seq();
    }
    // The listener may run as soon as it is added; it takes mu_ itself.
    listener_ = log_.AddListener([this] {
      std::lock_guard<std::mutex> l(mu_);
      MaybeWriteLocked();
    });
    std::lock_guard<std::mutex> lock(mu_);
    if (notified_done_) {
      cancelled_ = true;  // gone before it was served
      if (!writing_) FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      return;
    }
    MaybeWriteLocked();
  }

  // A write completed, or the Finish did.
  void OnOpDone(bool ok) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finished_) {
        writing_ = false;
        if (!ok || cancelled_) {
          FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "subscriber gone"));
        } else {
          MaybeWriteLocked();
        }
        return;
      }
      finish_done_ = true;
    }
    if (notified_done_) End();
  }

  // The call is over: the subscriber cancelled (the stream never ends by
  // itself), or it finished after a failed write.
  void OnCallDone(bool /*ok*/) {
    notified_done_ = true;
    if (!accepted_) return;  // OnAccepted finishes it
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      // With a write in flight, its completion finishes the stream.
      if (!writing_) FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      if (!finish_done_) return;
    }
    End();
  }

  void End() {
    if (listener_ >= 0) log_.RemoveListener(listener_);
    delete this;
  }

 private:
  // Per batch: 65536 snapshot blocks is ~1.3 MB on the wire; events are
  // capped by an estimate of their encoded size (5 bytes a token id at most).
  static constexpr size_t kSnapshotBlocksPerBatch = 65536;
  static constexpr size_t kMaxEventsPerBatch = 4096;
  static constexpr size_t kMaxBatchBytes = 1 << 20;

  void FinishLocked(const grpc::Status& s) {
    if (finished_) return;
    finished_ = true;
    writer_.Finish(s, &op_tag_);
  }

  // REQUIRES: mu_ held.
  void MaybeWriteLocked() {
    if (writing_ || finished_) return;
    batch_.Clear();
    batch_.set_instance_id(instance_id_);
    std::vector<KvEvent> events;
    if (!need_snapshot_ && !sending_snapshot_ &&
        !log_.ReadSince(cursor_, kMaxEventsPerBatch, &events)) {
      need_snapshot_ = true;  // fell behind the log: resync
    }
    if (need_snapshot_) {
      need_snapshot_ = false;
      snapshot_ = log_.TakeSnapshot();
      snapshot_sent_ = 0;
      cursor_ = snapshot_.seq;
      sending_snapshot_ = true;
    }
    if (sending_snapshot_) {
      auto* s = batch_.mutable_snapshot();
      s->set_seq(snapshot_.seq);
      const size_t end = std::min(snapshot_.blocks.size(), snapshot_sent_ + kSnapshotBlocksPerBatch);
      for (; snapshot_sent_ < end; ++snapshot_sent_) ToProto(snapshot_.blocks[snapshot_sent_], s->add_blocks());
      if (snapshot_sent_ < snapshot_.blocks.size()) {
        writing_ = true;
        writer_.Write(batch_, &op_tag_);
        return;
      }
      s->set_complete(true);
      sending_snapshot_ = false;
      snapshot_ = KvSnapshot{};
      events.clear();
      log_.ReadSince(cursor_, kMaxEventsPerBatch, &events);
    } else if (events.empty()) {
      return;
    }
    size_t bytes = 0;
    for (const KvEvent& e : events) {
      if (bytes > kMaxBatchBytes) break;  // the rest goes in the next batch
      bytes += 32 + 5 * e.token_ids.size();
      ToProto(e, batch_.add_events());
      cursor_ = e.seq;
    }
    writing_ = true;
    writer_.Write(batch_, &op_tag_);
  }

  WorkerService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  Engine* const engine_;
  KvEventLog& log_;
  const std::string instance_id_;
  grpc::ServerContext ctx_;
  tandem::v1::KvEventsRequest req_;
  grpc::ServerAsyncWriter<KvEventBatch> writer_;
  MemberTag<KvEventsCall> accept_tag_{this, &KvEventsCall::OnAccepted};
  MemberTag<KvEventsCall> op_tag_{this, &KvEventsCall::OnOpDone};
  MemberTag<KvEventsCall> done_tag_{this, &KvEventsCall::OnCallDone};
  bool accepted_ = false;       // the poller thread's
  bool notified_done_ = false;  // the poller thread's
  int listener_ = -1;           // the poller thread's
  // The log's listener (the engine thread) and the poller thread share these.
  std::mutex mu_;
  uint64_t cursor_ ABSL_GUARDED_BY(mu_) = 0;  // the last seq sent (or covered by the snapshot)
  bool need_snapshot_ ABSL_GUARDED_BY(mu_) = false;
  bool sending_snapshot_ ABSL_GUARDED_BY(mu_) = false;
  KvSnapshot snapshot_ ABSL_GUARDED_BY(mu_);  // being sent, in chunks
  size_t snapshot_sent_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;     // Finish was called
  bool finish_done_ ABSL_GUARDED_BY(mu_) = false;  // ... and completed
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;    // the call is over
  KvEventBatch batch_ ABSL_GUARDED_BY(mu_);        // the message being written
};

// One unary call of a method: waits for it (the service's Request<Method>),
// then runs the handler, whose `finish` sends the answer; deletes itself when
// the answer went out (or at once when the server shuts down first).
template <class Req, class Resp>
class UnaryCall final : public GrpcTag {
 public:
  using RequestFn = void (tandem::v1::Worker::AsyncService::*)(
      grpc::ServerContext*, Req*, grpc::ServerAsyncResponseWriter<Resp>*, grpc::CompletionQueue*,
      grpc::ServerCompletionQueue*, void*);
  using HandleFn = void (WorkerService::*)(const grpc::ServerContext&, const Req&, Resp*,
                                           WorkerService::Finish);

  UnaryCall(WorkerService* service, grpc::ServerCompletionQueue* cq, RequestFn request,
            HandleFn handle, const char* method, Admits admits)
      : service_(service),
        cq_(cq),
        request_(request),
        handle_(handle),
        method_(method),
        admits_(admits),
        writer_(&ctx_) {
    (service_->*request_)(&ctx_, &req_, &writer_, cq_, cq_, this);
  }

  void Done(bool ok) override {
    if (accepted_ || !ok) {
      delete this;  // answered, or the server is shutting down
      return;
    }
    accepted_ = true;
    new UnaryCall(service_, cq_, request_, handle_, method_, admits_);  // the next one
    if (grpc::Status auth = service_->Authorize(ctx_, method_, admits_); !auth.ok()) {
      writer_.FinishWithError(auth, this);
      return;
    }
    (service_->*handle_)(ctx_, req_, &resp_,
                         [this](const grpc::Status& status) { writer_.Finish(resp_, status, this); });
  }

 private:
  WorkerService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  const RequestFn request_;
  const HandleFn handle_;
  const char* const method_;
  const Admits admits_;
  grpc::ServerContext ctx_;
  Req req_;
  Resp resp_;
  grpc::ServerAsyncResponseWriter<Resp> writer_;
  bool accepted_ = false;
};

}  // namespace

WorkerService::WorkerService(Engine* engine, WorkerRole role, grpc::ServerCompletionQueue* cq,
                             kvtransfer::Transport* transport, KvHandoffConfig kv,
                             WorkerSecurity security)
    : engine_(engine),
      cq_(cq),
      role_(role),
      instance_id_(NewInstanceId()),
      security_(std::move(security)),
      kv_handoff_(engine_, role_, transport, instance_id_, kv, cq_, security_.channels, security_.kv_peer_allow) {}

grpc::Status WorkerService::Authorize(const grpc::ServerContext& ctx, const char* method,
                                      Admits admits) {
  if (!security_.mutual_tls) return grpc::Status::OK;
  const tls::Peer peer = tls::PeerOf(ctx);
  const bool router = peer.role == tls::PeerRole::kRouter;
  const bool worker = peer.role == tls::PeerRole::kWorker;
  if (peer.authenticated && ((admits != Admits::kWorker && router) ||
                             (admits != Admits::kRouter && worker))) {
    return grpc::Status::OK;
  }
  const int64_t n = ++calls_denied_;
  const std::string wanted =
      admits == Admits::kRouter   ? absl::StrCat("the router role (", tls::kRouterIdentity, ")")
      : admits == Admits::kWorker ? absl::StrCat("the worker role (", tls::kWorkerIdentity, ")")
                                  : std::string("the router or worker role");
  const std::string why =
      peer.authenticated
          ? absl::StrFormat("%s needs a certificate with %s; the caller's (CN '%s') has role %s",
                            method, wanted, peer.name, tls::PeerRoleName(peer.role))
          : absl::StrFormat("%s needs a client certificate of the cluster CA", method);
  if (n <= 10 || n % 1000 == 0) {
    LOG(WARNING) << "refused a call from " << ctx.peer() << ": " << why << " (" << n
                 << " refused so far)";
  }
  return grpc::Status(peer.authenticated ? grpc::StatusCode::PERMISSION_DENIED
                                         : grpc::StatusCode::UNAUTHENTICATED,
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
  new GenerateCall(GenerateContext{.service = this, .cq = cq_, .engine = engine_, .kv = &kv_handoff_});
  new KvEventsCall(this, cq_, engine_, instance_id_);
  using namespace tandem::v1;  // NOLINT(build/namespaces): the message types below
  // Who may call what, with mutual TLS (the header says why).
  new UnaryCall<HealthRequest, HealthResponse>(this, cq_, &WorkerService::RequestHealth,
                                               &WorkerService::HandleHealth, "Health",
                                               Admits::kRouterOrWorker);
  new UnaryCall<ModelInfoRequest, ModelInfo>(this, cq_, &WorkerService::RequestGetModelInfo,
                                             &WorkerService::HandleGetModelInfo, "GetModelInfo",
                                             Admits::kRouterOrWorker);
  new UnaryCall<LoadRequest, LoadReport>(this, cq_, &WorkerService::RequestGetLoad,
                                         &WorkerService::HandleGetLoad, "GetLoad",
                                         Admits::kRouterOrWorker);
  new UnaryCall<ClearKvCacheRequest, ClearKvCacheResponse>(
      this, cq_, &WorkerService::RequestClearKvCache, &WorkerService::HandleClearKvCache,
      "ClearKvCache", Admits::kRouter);
  new UnaryCall<KvTransferInfoRequest, KvTransferInfo>(
      this, cq_, &WorkerService::RequestGetKvTransferInfo, &WorkerService::HandleGetKvTransferInfo,
      "GetKvTransferInfo", Admits::kRouter);
  new UnaryCall<KvReadyRequest, KvReadyResponse>(this, cq_, &WorkerService::RequestKvReady,
                                                 &WorkerService::HandleKvReady, "KvReady",
                                                 Admits::kWorker);
}

void WorkerService::Shutdown() { kv_handoff_.Stop(); }

bool WorkerService::serving() const { return engine_->running() && !draining(); }

KvHandoffStats WorkerService::kv_stats() const { return kv_handoff_.stats(); }

void WorkerService::HandleKvReady(const grpc::ServerContext& ctx, const tandem::v1::KvReadyRequest& request,
    tandem::v1::KvReadyResponse* response, Finish finish) {
  // The caller's deadline, on this machine's steady clock (none: an hour).
  const auto now_sys = std::chrono::system_clock::now();
  const auto left = ctx.deadline() > now_sys + std::chrono::hours(1)
                        ? std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::hours(1))
                        : std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              ctx.deadline() - now_sys);
  kv_handoff_.KvReady(request, std::chrono::steady_clock::now() + left, response,
                      [finish = std::move(finish)](grpc::Status s) { finish(s); });
}

void WorkerService::HandleGetKvTransferInfo(const grpc::ServerContext& ctx, const tandem::v1::KvTransferInfoRequest& /*request*/,
    tandem::v1::KvTransferInfo* response, Finish finish) {
  absl::StatusOr<kvtransfer::PeerInfo> info = kv_handoff_.LocalInfo();
  if (info.ok()) ToProto(*info, response);
  finish(ToGrpcStatus(info.status()));
}

void WorkerService::HandleHealth(const grpc::ServerContext& ctx, const tandem::v1::HealthRequest& /*request*/,
    tandem::v1::HealthResponse* response, Finish finish) {
  response->set_status(serving() ? tandem::v1::HealthResponse::SERVING
                                 : tandem::v1::HealthResponse::NOT_SERVING);
  response->set_role(WorkerRoleName(role_));
  response->set_instance_id(instance_id_);
  finish(grpc::Status::OK);
}

void WorkerService::HandleGetModelInfo(const grpc::ServerContext& ctx, const tandem::v1::ModelInfoRequest& /*request*/,
    tandem::v1::ModelInfo* r, Finish finish) {
  const ModelConfig& c = engine_->model_config();
  r->set_model(engine_->model_name());
  r->set_architecture(c.architecture);
  r->set_vocab_size(c.vocab_size);
  r->set_max_context_length(engine_->max_model_len());
  r->set_engine(engine_->simulated() ? "sim" : "real");
  r->mutable_eos_token_ids()->Add(c.eos_token_ids.begin(), c.eos_token_ids.end());
  r->set_bos_token_id(c.bos_token_id);
  r->set_num_layers(c.num_layers);
  r->set_num_kv_heads(c.num_kv_heads);
  r->set_head_dim(c.head_dim);
  r->set_block_size(engine_->config().block_size);
  r->set_total_blocks(engine_->total_blocks());
  r->set_kv_dtype("float32");
  r->set_role(WorkerRoleName(role_));
  r->set_instance_id(instance_id_);
  r->set_block_hash_seed(engine_->config().block_hash_seed);
  r->set_max_batched_tokens(engine_->config().max_batched_tokens);
  r->set_tokenizer_sha256(engine_->tokenizer_sha256());
  finish(grpc::Status::OK);
}

void WorkerService::HandleGetLoad(const grpc::ServerContext& ctx, const tandem::v1::LoadRequest& /*request*/,
    tandem::v1::LoadReport* r, Finish finish) {
  ToProto(engine_->GetLoad(), r);
  ToProto(kv_stats(), r);
  r->set_calls_denied(calls_denied_.load());
  finish(grpc::Status::OK);
}

void WorkerService::HandleClearKvCache(const grpc::ServerContext& ctx, const tandem::v1::ClearKvCacheRequest& /*request*/,
    tandem::v1::ClearKvCacheResponse* r, Finish finish) {
  // Completed on the engine thread at its next step; no gRPC thread waits.
  engine_->ClearPrefixCache([finish = std::move(finish), r](absl::StatusOr<int64_t> cleared) {
    if (cleared.ok()) r->set_blocks_cleared(*cleared);
    finish(cleared.ok() ? grpc::Status::OK : ToGrpcStatus(cleared.status()));
  });
}

}  // namespace tandem::worker
