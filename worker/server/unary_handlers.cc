#include "worker/server/unary_handlers.h"

#include <chrono>
#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"
#include "worker/server/proto_convert.h"

namespace tandem::worker {

void HandleHealth(WorkerService& worker, const grpc::ServerContext& ctx, const tandem::v1::HealthRequest& /*request*/,
                  tandem::v1::HealthResponse* response, UnaryFinish finish) {
  response->set_status(worker.serving() ? tandem::v1::HealthResponse::SERVING
                                        : tandem::v1::HealthResponse::NOT_SERVING);
  response->set_role(WorkerRoleName(worker.role()));
  response->set_instance_id(worker.instance_id());
  finish(grpc::Status::OK);
}

void HandleGetModelInfo(WorkerService& worker, const grpc::ServerContext& ctx,
                        const tandem::v1::ModelInfoRequest& /*request*/, tandem::v1::ModelInfo* r, UnaryFinish finish) {
  const Engine& engine = *worker.engine();
  const ModelConfig& c = engine.model_config();
  r->set_model(engine.model_name());
  r->set_architecture(c.architecture);
  r->set_vocab_size(c.vocab_size);
  r->set_max_context_length(engine.max_model_len());
  r->set_engine(engine.simulated() ? "sim" : "real");
  r->mutable_eos_token_ids()->Add(c.eos_token_ids.begin(), c.eos_token_ids.end());
  r->set_bos_token_id(c.bos_token_id);
  r->set_num_layers(c.num_layers);
  r->set_num_kv_heads(c.num_kv_heads);
  r->set_head_dim(c.head_dim);
  r->set_block_size(engine.config().block_size);
  r->set_total_blocks(engine.total_blocks());
  r->set_kv_dtype(kernels::DTypeName(engine.kv_layout().dtype));
  r->set_role(WorkerRoleName(worker.role()));
  r->set_instance_id(worker.instance_id());
  r->set_block_hash_seed(engine.config().block_hash_seed);
  r->set_max_batched_tokens(engine.config().max_batched_tokens);
  r->set_tokenizer_sha256(engine.tokenizer_sha256());
  r->set_kv_domain(worker.kv_domain());
  finish(grpc::Status::OK);
}

void HandleGetLoad(WorkerService& worker, const grpc::ServerContext& ctx, const tandem::v1::LoadRequest& /*request*/,
                   tandem::v1::LoadReport* r, UnaryFinish finish) {
  ToProto(worker.engine()->GetLoad(), r);
  ToProto(worker.kv_stats(), r);
  r->set_calls_denied(worker.calls_denied());
  finish(grpc::Status::OK);
}

void HandleClearKvCache(WorkerService& worker, const grpc::ServerContext& ctx,
                        const tandem::v1::ClearKvCacheRequest& /*request*/, tandem::v1::ClearKvCacheResponse* r,
                        UnaryFinish finish) {
  // Completed on the engine thread at its next step; no gRPC thread waits.
  worker.engine()->ClearPrefixCache([finish = std::move(finish), r](absl::StatusOr<int64_t> cleared) {
    if (cleared.ok()) r->set_blocks_cleared(*cleared);
    finish(cleared.ok() ? grpc::Status::OK : ToGrpcStatus(cleared.status()));
  });
}

void HandleGetKvTransferInfo(WorkerService& worker, const grpc::ServerContext& ctx,
                             const tandem::v1::KvTransferInfoRequest& /*request*/, tandem::v1::KvTransferInfo* response,
                             UnaryFinish finish) {
  absl::StatusOr<kvtransfer::PeerInfo> info = worker.kv_handoff().LocalInfo();
  if (info.ok()) ToProto(*info, response);
  finish(ToGrpcStatus(info.status()));
}

void HandleKvReady(WorkerService& worker, const grpc::ServerContext& ctx, const tandem::v1::KvReadyRequest& request,
                   tandem::v1::KvReadyResponse* response, UnaryFinish finish) {
  // The caller's deadline, on this machine's steady clock (none: an hour).
  const auto now_sys = std::chrono::system_clock::now();
  const auto left = ctx.deadline() > now_sys + std::chrono::hours(1)
                        ? std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::hours(1))
                        : std::chrono::duration_cast<std::chrono::steady_clock::duration>(ctx.deadline() - now_sys);
  worker.kv_handoff().KvReady(request, std::chrono::steady_clock::now() + left, response,
                              [finish = std::move(finish)](grpc::Status s) { finish(s); });
}

}  // namespace tandem::worker
