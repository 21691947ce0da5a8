#include "worker/server/generate_call.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/block_hash.h"
#include "common/grpc_poller.h"
#include "worker/server/proto_convert.h"
#include "worker/server/worker_service.h"

namespace tandem::worker {
namespace {

using tandem::v1::GenerateResponse;

// One Generate stream (the header says how it lives and ends).
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
    c_.service->GenerateStreamOpened();
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
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker draining: shutting down, no new requests"));
      return;
    }
    GenerateSpec spec = FromProto(req);
    want_logprobs_ = spec.params.logprobs >= 0;
    const tandem::v1::KvTransferParams& kv = req.kv_transfer();
    if (spec.resume_output_tokens != 0 && kv.mode() != tandem::v1::KvTransferParams::MODE_UNSPECIFIED) {
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
    c_.service->GenerateStreamEnded();
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
  void StartWriteAndFinish(const GenerateResponse* msg, grpc::WriteOptions options, const grpc::Status& status) {
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
    out->mutable_block_ids()->Assign(r->blocks.begin(), r->blocks.end());
    // Push delivery: the pool offered to the sender (its JOIN then asks).
    if (absl::StatusOr<kvtransfer::PeerInfo> pool = c_.kv->PushDestination(); pool.ok()) {
      ToProto(*pool, out->mutable_destination());
    }
    MaybeWriteLocked();
  }

  void AddTokenLocked(const SampledToken& t) {
    ToProto(t, want_logprobs_, pending_.add_tokens());
    MaybeWriteLocked();
  }

  void FinishLocked(const FinishInfo& info) {
    finished_ = true;
    if (info.reason == FinishReason::kAbort) {
      final_status_ = info.worker_stopping ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is shutting down")
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
  bool cancelled_ ABSL_GUARDED_BY(sink_->mu()) = false;    // OnCancel came
  bool awaiting_kv_ ABSL_GUARDED_BY(sink_->mu()) = false;  // SEND: handed off, the answer not yet in
  bool kv_done_ ABSL_GUARDED_BY(sink_->mu()) = false;
  bool done_called_ ABSL_GUARDED_BY(sink_->mu()) = false;   // Finish (or StartWriteAndFinish) was called
  bool last_op_done_ ABSL_GUARDED_BY(sink_->mu()) = false;  // ... and completed
};

}  // namespace

void AwaitGenerateCall(const GenerateContext& c) { new GenerateCall(c); }

}  // namespace tandem::worker
