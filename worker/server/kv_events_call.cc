#include "worker/server/kv_events_call.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/grpc_poller.h"
#include "worker/kv_cache/kv_event_log.h"
#include "worker/server/proto_convert.h"
#include "worker/server/worker_service.h"

namespace tandem::worker {
namespace {

using tandem::v1::KvEventBatch;

// One KV event stream (the header says what it sends and how it lives).
class KvEventsCall final {
 public:
  // Waits for the next StreamKvEvents call.
  KvEventsCall(WorkerService* service, grpc::ServerCompletionQueue* cq, Engine* engine, const std::string& instance_id)
      : service_(service), cq_(cq), engine_(engine), log_(engine->events()), instance_id_(instance_id), writer_(&ctx_) {
    ctx_.AsyncNotifyWhenDone(&done_tag_);
    service->RequestStreamKvEvents(&ctx_, &req_, &writer_, cq, cq, &accept_tag_);
  }

 private:
  void OnAccepted(bool ok) {
    if (!ok) {
      delete this;  // shutting down
      return;
    }
    service_->StartOp([this] { new KvEventsCall(service_, cq_, engine_, instance_id_); });  // the next one
    accepted_ = true;
    // Other users' prompts (token ids) flow here: the router's only.
    if (grpc::Status auth = service_->Authorize(ctx_, "StreamKvEvents", Admits::kRouter); !auth.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      FinishLocked(auth);
      return;
    }
    const tandem::v1::KvEventsRequest& req = req_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_only_ = req.status_only();
      cursor_ = req.start_after_seq();
      need_snapshot_ = !status_only_ && (req.snapshot() || cursor_ > log_.last_seq());
    }
    // The listener may run as soon as it is added; it takes mu_ itself.
    listener_ = log_.AddListener([this] {
      std::lock_guard<std::mutex> l(mu_);
      MaybeWriteLocked();
    });
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!notified_done_) {
        MaybeWriteLocked();
        return;
      }
      cancelled_ = true;  // gone before it was served
      if (!writing_) FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      if (!finish_done_) return;  // its completion ends the call
    }
    End();
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
        if (!finish_done_) return;  // streaming on, or the Finish's completion comes here
      } else {
        finish_done_ = true;
      }
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

  // Past the service's Shutdown no operation starts (StartOp): the call
  // counts as finished at once.
  void FinishLocked(const grpc::Status& s) {
    if (finished_) return;
    finished_ = true;
    if (!service_->StartOp([&] { writer_.Finish(s, &op_tag_); })) finish_done_ = true;
  }

  // Writes batch_. REQUIRES: mu_ held, no write in flight.
  void WriteBatchLocked() {
    service_->StartOp([this] {
      writing_ = true;
      writer_.Write(batch_, &op_tag_);
    });
  }

  // REQUIRES: mu_ held.
  void MaybeWriteLocked() {
    if (writing_ || finished_) return;
    batch_.Clear();
    batch_.set_instance_id(instance_id_);
    // The drain, once, in the next batch (alone if no events are due).
    const bool announce = !drain_announced_ && service_->draining();
    if (announce) {
      drain_announced_ = true;
      batch_.set_draining(true);
    }
    if (status_only_) {
      if (!announce) return;
      WriteBatchLocked();
      return;
    }
    std::vector<KvEvent> events;
    if (!need_snapshot_ && !sending_snapshot_ && !log_.ReadSince(cursor_, kMaxEventsPerBatch, &events)) {
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
        WriteBatchLocked();
        return;
      }
      s->set_complete(true);
      sending_snapshot_ = false;
      snapshot_ = KvSnapshot{};
      events.clear();
      log_.ReadSince(cursor_, kMaxEventsPerBatch, &events);
    } else if (events.empty() && !announce) {
      return;
    }
    size_t bytes = 0;
    for (const KvEvent& e : events) {
      if (bytes > kMaxBatchBytes) break;  // the rest goes in the next batch
      bytes += 32 + 5 * e.token_ids.size();
      ToProto(e, batch_.add_events());
      cursor_ = e.seq;
    }
    WriteBatchLocked();
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
  bool status_only_ ABSL_GUARDED_BY(mu_) = false;      // KvEventsRequest.status_only
  bool drain_announced_ ABSL_GUARDED_BY(mu_) = false;  // a batch said draining
  KvSnapshot snapshot_ ABSL_GUARDED_BY(mu_);           // being sent, in chunks
  size_t snapshot_sent_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;     // Finish was called
  bool finish_done_ ABSL_GUARDED_BY(mu_) = false;  // ... and completed
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;    // the call is over
  KvEventBatch batch_ ABSL_GUARDED_BY(mu_);        // the message being written
};

}  // namespace

void AwaitKvEventsCall(WorkerService* service, grpc::ServerCompletionQueue* cq, Engine* engine,
                       const std::string& instance_id) {
  new KvEventsCall(service, cq, engine, instance_id);
}

}  // namespace tandem::worker
