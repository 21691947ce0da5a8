#include "worker/server/proto_convert.h"

namespace tandem::worker {

tandem::v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return tandem::v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return tandem::v1::FINISH_REASON_LENGTH;
    case FinishReason::kAbort:
      return tandem::v1::FINISH_REASON_ABORT;
    case FinishReason::kError:
      return tandem::v1::FINISH_REASON_ERROR;
  }
  return tandem::v1::FINISH_REASON_ERROR;
}

void ToProto(const SampledToken& token, bool logprobs, tandem::v1::TokenOutput* out) {
  out->set_token_id(token.token_id);
  if (!logprobs) return;
  out->set_logprob(token.logprob);
  for (const TokenLogprob& tl : token.top_logprobs) {
    tandem::v1::TopLogprob* alt = out->add_top_logprobs();
    alt->set_token_id(tl.token_id);
    alt->set_logprob(tl.logprob);
  }
}

SampledToken FromProto(const tandem::v1::TokenOutput& token) {
  SampledToken s{.token_id = token.token_id(), .logprob = token.logprob()};
  for (const tandem::v1::TopLogprob& alt : token.top_logprobs()) {
    s.top_logprobs.push_back(TokenLogprob{.token_id = alt.token_id(), .logprob = alt.logprob()});
  }
  return s;
}

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

GenerateSpec FromProto(const tandem::v1::GenerateRequest& request) {
  GenerateSpec spec;
  spec.request_id = request.request_id();
  spec.prompt.assign(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
  spec.params = FromProto(request.sampling());
  spec.resume_output_tokens = request.resume_output_tokens();
  return spec;
}

void ToProto(const FinishInfo& info, tandem::v1::GenerateResponse* out) {
  out->set_finish_reason(ToProto(info.reason));
  if (info.stop_token_id >= 0) out->set_stop_token_id(info.stop_token_id);
  out->mutable_usage()->set_prompt_tokens(info.prompt_tokens);
  out->mutable_usage()->set_completion_tokens(info.completion_tokens);
  out->mutable_usage()->set_cached_prompt_tokens(info.cached_prompt_tokens);
  if (!info.error.empty()) out->set_error_message(info.error);
}

void ToProto(const KvEvent& event, tandem::v1::KvEvent* out) {
  out->set_seq(event.seq);
  switch (event.kind) {
    case KvEvent::Kind::kStored: {
      tandem::v1::BlockStored* stored = out->mutable_stored();
      stored->set_block_hash(event.block_hash);
      stored->set_parent_hash(event.parent_hash);
      stored->mutable_token_ids()->Add(event.token_ids.begin(), event.token_ids.end());
      break;
    }
    case KvEvent::Kind::kRemoved:
      out->mutable_removed()->set_block_hash(event.block_hash);
      break;
    case KvEvent::Kind::kCleared:
      out->mutable_cleared();
      break;
  }
}

void ToProto(const CachedBlock& block, tandem::v1::CachedBlock* out) {
  out->set_block_hash(block.hash);
  out->set_parent_hash(block.parent);
}

void ToProto(const LoadSnapshot& s, tandem::v1::LoadReport* r) {
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
  r->set_reserved_requests(s.reserved);
  r->set_prefilled_requests(s.prefilled);
  r->set_quarantined_blocks(s.quarantined_blocks);
  r->set_expired_reservations(s.expired_reservations);
  r->set_local_prefill_fallbacks(s.local_prefill_fallbacks);
  r->set_reservations_refused(s.reservations_refused);
  r->set_expired_handoffs(s.expired_handoffs);
}

void ToProto(const KvHandoffStats& kv, tandem::v1::LoadReport* r) {
  r->set_kv_pulls(kv.pulls);
  r->set_kv_pull_failures(kv.pull_failures);
  r->set_kv_checksum_failures(kv.checksum_failures);
  r->set_kv_bytes_pulled(kv.bytes_pulled);
  r->set_kv_handoffs(kv.handoffs);
  r->set_kv_handoff_failures(kv.handoff_failures);
  r->set_kv_pulls_in_flight(kv.pulls_in_flight);
  r->set_kv_pull_seconds(kv.pull_seconds);
  r->set_reservation_timeouts_capped(kv.timeouts_capped);
  r->set_reservations_over_caller_cap(kv.over_caller_cap);
  r->set_kv_peers_refused(kv.peers_refused);
  r->set_reserved_blocks(kv.reserved_blocks);
  r->set_kv_pushes(kv.pushes);
  r->set_kv_bytes_pushed(kv.bytes_pushed);
  r->set_kv_pushes_received(kv.pushes_received);
}

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
      .layout = {.model = l.model(),
                 .dtype = l.dtype(),
                 .num_layers = l.num_layers(),
                 .num_kv_heads = l.num_kv_heads(),
                 .head_dim = l.head_dim(),
                 .block_size = l.block_size(),
                 .num_blocks = l.num_blocks(),
                 .block_bytes = l.block_bytes(),
                 .memory_type = l.cuda() ? kvtransfer::MemoryType::kCuda : kvtransfer::MemoryType::kHost,
                 .device_id = l.device_id()},
      .address = info.address()};
}

}  // namespace tandem::worker
