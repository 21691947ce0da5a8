#include "worker/server/worker_service.h"

#include <algorithm>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace tandem::worker {
namespace {

using tandem::v1::GenerateResponse;
using tandem::v1::KvEventBatch;

std::string NewInstanceId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

tandem::v1::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return tandem::v1::FINISH_REASON_STOP;
    case FinishReason::kLength: return tandem::v1::FINISH_REASON_LENGTH;
    case FinishReason::kAbort: return tandem::v1::FINISH_REASON_ABORT;
    case FinishReason::kError: return tandem::v1::FINISH_REASON_ERROR;
  }
  return tandem::v1::FINISH_REASON_ERROR;
}

// One Generate stream. The engine thread pushes tokens through the Sink; the
// reactor writes whatever accumulated since the last write as one message.
// Lifetime: gRPC owns the reactor until OnDone; the Sink (shared with the
// engine) outlives it and drops output once the reactor is gone.
//
// How a stream ends: a normal finish sends the pending tokens with the finish
// reason and usage, status OK. An abort sends what is pending, then ends with
// CANCELLED (the client cancelled) or UNAVAILABLE (the worker is stopping, so
// the caller may retry elsewhere). A failed write (client gone) cancels the
// request in the engine and ends with CANCELLED.
class GenerateReactor final : public grpc::ServerWriteReactor<GenerateResponse> {
 public:
  class Sink final : public OutputSink {
   public:
    explicit Sink(GenerateReactor* r) : reactor_(r) {}
    void OnToken(const SampledToken& t) override {
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ != nullptr) reactor_->AddTokenLocked(t);
    }
    void OnFinish(const FinishInfo& info) override {
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ != nullptr) reactor_->FinishLocked(info);
    }
    // Called from OnDone: no more output reaches the reactor.
    void Detach() {
      std::lock_guard<std::mutex> lock(mu_);
      reactor_ = nullptr;
    }
    std::mutex& mu() { return mu_; }

   private:
    std::mutex mu_;
    GenerateReactor* reactor_;
  };

  GenerateReactor(Engine* engine, const tandem::v1::GenerateRequest& req)
      : engine_(engine), sink_(std::make_shared<Sink>(this)) {
    GenerateSpec spec;
    spec.request_id = req.request_id();
    spec.prompt.assign(req.prompt_token_ids().begin(), req.prompt_token_ids().end());
    spec.params = FromProto(req.sampling());
    want_logprobs_ = spec.params.logprobs >= 0;
    absl::StatusOr<uint64_t> id = engine_->Submit(std::move(spec), sink_);
    if (!id.ok()) {
      std::lock_guard<std::mutex> lock(sink_->mu());
      done_called_ = true;
      Finish(ToGrpcStatus(id.status()));
      return;
    }
    id_ = *id;
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(sink_->mu());
    writing_ = false;
    if (!ok) {
      // The client is gone: stop generating.
      if (!done_called_) {
        done_called_ = true;
        engine_->Cancel(id_);
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client stream closed"));
      }
      return;
    }
    MaybeWriteLocked();
  }

  void OnCancel() override { engine_->Cancel(id_); }

  void OnDone() override {
    sink_->Detach();
    delete this;
  }

 private:
  // REQUIRES: sink_->mu() held (all below).
  void AddTokenLocked(const SampledToken& t) {
    auto* out = pending_.add_tokens();
    out->set_token_id(t.token_id);
    if (want_logprobs_) {
      out->set_logprob(t.logprob);
      for (const TokenLogprob& tl : t.top_logprobs) {
        auto* alt = out->add_top_logprobs();
        alt->set_token_id(tl.token_id);
        alt->set_logprob(tl.logprob);
      }
    }
    MaybeWriteLocked();
  }

  void FinishLocked(const FinishInfo& info) {
    finished_ = true;
    if (info.reason == FinishReason::kAbort) {
      final_status_ = info.worker_stopping
                          ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is shutting down")
                          : grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled");
    }
    final_.set_finish_reason(ToProto(info.reason));
    if (info.stop_token_id >= 0) final_.set_stop_token_id(info.stop_token_id);
    final_.mutable_usage()->set_prompt_tokens(info.prompt_tokens);
    final_.mutable_usage()->set_completion_tokens(info.completion_tokens);
    final_.mutable_usage()->set_cached_prompt_tokens(info.cached_prompt_tokens);
    if (!info.error.empty()) final_.set_error_message(info.error);
    MaybeWriteLocked();
  }

  void MaybeWriteLocked() {
    if (writing_ || done_called_) return;
    if (finished_ && final_status_.ok()) {
      // The last message: pending tokens, finish reason and usage together.
      final_.mutable_tokens()->Swap(pending_.mutable_tokens());
      done_called_ = true;
      StartWriteAndFinish(&final_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    if (pending_.tokens_size() > 0) {
      current_.Clear();
      current_.Swap(&pending_);
      writing_ = true;
      StartWrite(&current_);
      return;
    }
    if (finished_) {
      done_called_ = true;
      Finish(final_status_);
    }
  }

  Engine* const engine_;
  std::shared_ptr<Sink> sink_;
  uint64_t id_ = 0;
  bool want_logprobs_ = false;
  // Guarded by sink_->mu().
  GenerateResponse pending_;   // tokens not yet written
  GenerateResponse current_;   // the message being written
  GenerateResponse final_;     // finish reason and usage, once finished_
  grpc::Status final_status_;  // OK, or why an aborted stream ends
  bool writing_ = false;
  bool finished_ = false;
  bool done_called_ = false;   // Finish (or StartWriteAndFinish) was called
};

// One KV event stream: a snapshot when needed (in chunks), then events as
// they come, each batch bounded in size so default gRPC clients (4 MiB
// messages) can read it.
class KvEventsReactor final : public grpc::ServerWriteReactor<KvEventBatch> {
 public:
  KvEventsReactor(Engine* engine, const std::string& instance_id,
                  const tandem::v1::KvEventsRequest& req)
      : log_(engine->events()), instance_id_(instance_id), cursor_(req.start_after_seq()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      need_snapshot_ = req.snapshot() || cursor_ > log_.last_seq();
    }
    // The listener may run as soon as it is added; it takes mu_ itself.
    listener_ = log_.AddListener([this] {
      std::lock_guard<std::mutex> l(mu_);
      MaybeWriteLocked();
    });
    std::lock_guard<std::mutex> lock(mu_);
    MaybeWriteLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "subscriber gone"));
      return;
    }
    MaybeWriteLocked();
  }
  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }
  void OnDone() override {
    log_.RemoveListener(listener_);
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
    Finish(s);
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
      for (; snapshot_sent_ < end; ++snapshot_sent_) {
        auto* b = s->add_blocks();
        b->set_block_hash(snapshot_.blocks[snapshot_sent_].hash);
        b->set_parent_hash(snapshot_.blocks[snapshot_sent_].parent);
      }
      if (snapshot_sent_ < snapshot_.blocks.size()) {
        writing_ = true;
        StartWrite(&batch_);
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
      auto* out = batch_.add_events();
      out->set_seq(e.seq);
      switch (e.kind) {
        case KvEvent::Kind::kStored: {
          auto* st = out->mutable_stored();
          st->set_block_hash(e.block_hash);
          st->set_parent_hash(e.parent_hash);
          st->mutable_token_ids()->Add(e.token_ids.begin(), e.token_ids.end());
          break;
        }
        case KvEvent::Kind::kRemoved:
          out->mutable_removed()->set_block_hash(e.block_hash);
          break;
        case KvEvent::Kind::kCleared:
          out->mutable_cleared();
          break;
      }
      cursor_ = e.seq;
    }
    writing_ = true;
    StartWrite(&batch_);
  }

  KvEventLog& log_;
  const std::string instance_id_;
  std::mutex mu_;
  // Guarded by mu_.
  uint64_t cursor_;              // the last seq sent (or covered by the snapshot)
  bool need_snapshot_ = false;
  bool sending_snapshot_ = false;
  KvSnapshot snapshot_;          // being sent, in chunks
  size_t snapshot_sent_ = 0;
  bool writing_ = false;
  bool finished_ = false;
  int listener_ = -1;
  KvEventBatch batch_;
};

}  // namespace

SamplingParams FromProto(const tandem::v1::SamplingParams& p) {
  SamplingParams s;
  if (p.has_temperature()) s.temperature = p.temperature();
  if (p.has_top_k()) s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  if (p.has_min_p()) s.min_p = p.min_p();
  if (p.has_repetition_penalty()) s.repetition_penalty = p.repetition_penalty();
  if (p.has_presence_penalty()) s.presence_penalty = p.presence_penalty();
  if (p.has_frequency_penalty()) s.frequency_penalty = p.frequency_penalty();
  if (p.has_max_tokens()) s.max_tokens = p.max_tokens();
  s.min_tokens = p.min_tokens();
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.ignore_eos = p.ignore_eos();
  if (p.has_logprobs()) s.logprobs = p.logprobs();
  if (p.has_seed()) s.seed = p.seed();
  return s;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

WorkerService::WorkerService(Engine* engine, std::string role, kvtransfer::Transport* transport)
    : engine_(engine), transport_(transport), role_(std::move(role)), instance_id_(NewInstanceId()) {}

void ToProto(const kvtransfer::PeerInfo& info, tandem::v1::KvTransferInfo* out) {
  out->set_agent_id(info.agent_id);
  out->set_backend(info.backend);
  out->set_address(info.address);
  tandem::v1::KvPoolLayout* l = out->mutable_layout();
  l->set_model(info.layout.model);
  l->set_dtype(info.layout.dtype);
  l->set_num_layers(info.layout.num_layers);
  l->set_num_kv_heads(info.layout.num_kv_heads);
  l->set_head_dim(info.layout.head_dim);
  l->set_block_size(info.layout.block_size);
  l->set_num_blocks(info.layout.num_blocks);
  l->set_block_bytes(info.layout.block_bytes);
  l->set_cuda(info.layout.memory_type == kvtransfer::MemoryType::kCuda);
  l->set_device_id(info.layout.device_id);
}

kvtransfer::PeerInfo FromProto(const tandem::v1::KvTransferInfo& info) {
  const tandem::v1::KvPoolLayout& l = info.layout();
  return kvtransfer::PeerInfo{
      .agent_id = info.agent_id(),
      .backend = info.backend(),
      .layout = {.model = l.model(), .dtype = l.dtype(), .num_layers = l.num_layers(),
                 .num_kv_heads = l.num_kv_heads(), .head_dim = l.head_dim(),
                 .block_size = l.block_size(), .num_blocks = l.num_blocks(),
                 .block_bytes = l.block_bytes(),
                 .memory_type = l.cuda() ? kvtransfer::MemoryType::kCuda : kvtransfer::MemoryType::kHost,
                 .device_id = l.device_id()},
      .address = info.address()};
}

grpc::ServerUnaryReactor* WorkerService::GetKvTransferInfo(grpc::CallbackServerContext* ctx,
                                                           const tandem::v1::KvTransferInfoRequest*,
                                                           tandem::v1::KvTransferInfo* response) {
  auto* reactor = ctx->DefaultReactor();
  if (transport_ == nullptr) {
    reactor->Finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                 "this worker runs without a KV transport (--kv-transport)"));
    return reactor;
  }
  absl::StatusOr<kvtransfer::PeerInfo> info = transport_->LocalInfo();
  if (info.ok()) ToProto(*info, response);
  reactor->Finish(info.ok() ? grpc::Status::OK : ToGrpcStatus(info.status()));
  return reactor;
}

grpc::ServerWriteReactor<GenerateResponse>* WorkerService::Generate(
    grpc::CallbackServerContext* ctx, const tandem::v1::GenerateRequest* request) {
  return new GenerateReactor(engine_, *request);
}

grpc::ServerUnaryReactor* WorkerService::Health(grpc::CallbackServerContext* ctx,
                                                const tandem::v1::HealthRequest*,
                                                tandem::v1::HealthResponse* response) {
  response->set_status(engine_->running() ? tandem::v1::HealthResponse::SERVING
                                          : tandem::v1::HealthResponse::NOT_SERVING);
  response->set_role(role_);
  response->set_instance_id(instance_id_);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                      const tandem::v1::ModelInfoRequest*,
                                                      tandem::v1::ModelInfo* r) {
  const ModelConfig& c = engine_->model_config();
  r->set_model(engine_->model_name());
  r->set_architecture(c.architecture);
  r->set_vocab_size(c.vocab_size);
  r->set_max_context_length(engine_->max_model_len());
  r->mutable_eos_token_ids()->Add(c.eos_token_ids.begin(), c.eos_token_ids.end());
  r->set_bos_token_id(c.bos_token_id);
  r->set_num_layers(c.num_layers);
  r->set_num_kv_heads(c.num_kv_heads);
  r->set_head_dim(c.head_dim);
  r->set_block_size(engine_->config().block_size);
  r->set_total_blocks(engine_->total_blocks());
  r->set_kv_dtype("float32");
  r->set_role(role_);
  r->set_instance_id(instance_id_);
  r->set_block_hash_seed(engine_->config().block_hash_seed);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::GetLoad(grpc::CallbackServerContext* ctx,
                                                 const tandem::v1::LoadRequest*,
                                                 tandem::v1::LoadReport* r) {
  LoadSnapshot s = engine_->GetLoad();
  r->set_running_sequences(s.running);
  r->set_waiting_sequences(s.waiting);
  r->set_tokens_in_flight(s.tokens_in_flight);
  r->set_prefill_tokens_pending(s.prefill_tokens_pending);
  r->set_total_blocks(s.total_blocks);
  r->set_free_blocks(s.free_blocks);
  r->set_used_blocks(s.used_blocks);
  r->set_cached_blocks(s.cached_blocks);
  r->set_prefix_hit_rate(s.hit_rate());
  r->set_prefix_query_tokens(s.prefix_query_tokens);
  r->set_prefix_hit_tokens(s.prefix_hit_tokens);
  r->set_kv_event_seq(s.kv_event_seq);
  r->set_preemptions(s.preemptions);
  r->set_finished_requests(s.finished);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<KvEventBatch>* WorkerService::StreamKvEvents(
    grpc::CallbackServerContext* ctx, const tandem::v1::KvEventsRequest* request) {
  return new KvEventsReactor(engine_, instance_id_, *request);
}

grpc::ServerUnaryReactor* WorkerService::ClearKvCache(grpc::CallbackServerContext* ctx,
                                                      const tandem::v1::ClearKvCacheRequest*,
                                                      tandem::v1::ClearKvCacheResponse* r) {
  // Completed on the engine thread at its next step; no gRPC thread waits.
  auto* reactor = ctx->DefaultReactor();
  engine_->ClearPrefixCache([reactor, r](absl::StatusOr<int64_t> cleared) {
    if (cleared.ok()) r->set_blocks_cleared(*cleared);
    reactor->Finish(cleared.ok() ? grpc::Status::OK : ToGrpcStatus(cleared.status()));
  });
  return reactor;
}

}  // namespace tandem::worker
