// Every conversion of proto_convert.h: each enum value and status code, and
// the messages field by field, so that a field added to one side and not the
// other shows up here rather than as a zero on the wire.
#include "worker/server/proto_convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

namespace tandem::worker {
namespace {

using ::testing::ElementsAre;

TEST(ProtoConvertTest, EveryFinishReasonHasItsOwnWireValue) {
  EXPECT_EQ(ToProto(FinishReason::kStop), tandem::v1::FINISH_REASON_STOP);
  EXPECT_EQ(ToProto(FinishReason::kLength), tandem::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(ToProto(FinishReason::kAbort), tandem::v1::FINISH_REASON_ABORT);
  EXPECT_EQ(ToProto(FinishReason::kError), tandem::v1::FINISH_REASON_ERROR);
}

TEST(ProtoConvertTest, EveryStatusCodeRoundTripsWithItsMessage) {
  std::set<int> seen;
  for (int code = 0; code <= 16; ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code), "why");
    const grpc::Status wire = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(wire.error_code()), code);
    EXPECT_EQ(FromGrpcStatus(wire), status) << code;
    // And from the gRPC side.
    const grpc::Status from_grpc(static_cast<grpc::StatusCode>(code), "because");
    const absl::Status back = FromGrpcStatus(from_grpc);
    EXPECT_EQ(static_cast<int>(back.code()), code);
    EXPECT_EQ(ToGrpcStatus(back).error_code(), from_grpc.error_code());
    if (code != 0) {
      EXPECT_EQ(wire.error_message(), "why");
      EXPECT_EQ(back.message(), "because");
    }
    seen.insert(static_cast<int>(wire.error_code()));
  }
  EXPECT_EQ(seen.size(), 17u);
  // The names agree, not only the numbers.
  EXPECT_EQ(ToGrpcStatus(absl::UnavailableError("x")).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "x")).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(ProtoConvertTest, ASampledTokenWithLogprobsRoundTrips) {
  const SampledToken token{.token_id = 42,
                           .logprob = -0.25f,
                           .top_logprobs = {{.token_id = 42, .logprob = -0.25f}, {.token_id = 7, .logprob = -1.5f}}};
  tandem::v1::TokenOutput wire;
  ToProto(token, /*logprobs=*/true, &wire);
  const SampledToken back = FromProto(wire);
  EXPECT_EQ(back.token_id, 42);
  EXPECT_EQ(back.logprob, -0.25f);
  ASSERT_EQ(back.top_logprobs.size(), 2u);
  EXPECT_EQ(back.top_logprobs[0].token_id, 42);
  EXPECT_EQ(back.top_logprobs[0].logprob, -0.25f);
  EXPECT_EQ(back.top_logprobs[1].token_id, 7);
  EXPECT_EQ(back.top_logprobs[1].logprob, -1.5f);
}

TEST(ProtoConvertTest, ASampledTokenWithoutLogprobsCarriesItsIdAlone) {
  const SampledToken token{.token_id = 42, .logprob = -0.25f, .top_logprobs = {{.token_id = 7, .logprob = -1.5f}}};
  tandem::v1::TokenOutput wire;
  ToProto(token, /*logprobs=*/false, &wire);
  EXPECT_EQ(wire.token_id(), 42);
  EXPECT_EQ(wire.logprob(), 0.0f);
  EXPECT_EQ(wire.top_logprobs_size(), 0);
}

TEST(ProtoConvertTest, UnsetSamplingFieldsTakeTheEnginesDefaults) {
  const SamplingParams got = FromProto(tandem::v1::SamplingParams());
  const SamplingParams want;
  EXPECT_EQ(got.temperature, want.temperature);
  EXPECT_EQ(got.top_k, want.top_k);
  EXPECT_EQ(got.top_p, want.top_p);
  EXPECT_EQ(got.min_p, want.min_p);
  EXPECT_EQ(got.repetition_penalty, want.repetition_penalty);
  EXPECT_EQ(got.presence_penalty, want.presence_penalty);
  EXPECT_EQ(got.frequency_penalty, want.frequency_penalty);
  EXPECT_EQ(got.max_tokens, want.max_tokens);
  EXPECT_EQ(got.min_tokens, want.min_tokens);
  EXPECT_TRUE(got.stop_token_ids.empty());
  EXPECT_EQ(got.ignore_eos, want.ignore_eos);
  EXPECT_EQ(got.logprobs, want.logprobs);
  EXPECT_FALSE(got.seed.has_value());
}

TEST(ProtoConvertTest, EverySamplingFieldIsRead) {
  tandem::v1::SamplingParams p;
  p.set_temperature(0.5f);
  p.set_top_k(40);
  p.set_top_p(0.9f);
  p.set_min_p(0.05f);
  p.set_repetition_penalty(1.1f);
  p.set_presence_penalty(0.5f);
  p.set_frequency_penalty(-0.5f);
  p.set_max_tokens(17);
  p.set_min_tokens(3);
  p.add_stop_token_ids(2);
  p.add_stop_token_ids(9);
  p.set_ignore_eos(true);
  p.set_logprobs(5);
  p.set_seed(1234);
  const SamplingParams s = FromProto(p);
  EXPECT_EQ(s.temperature, 0.5f);
  EXPECT_EQ(s.top_k, 40);
  EXPECT_EQ(s.top_p, 0.9f);
  EXPECT_EQ(s.min_p, 0.05f);
  EXPECT_EQ(s.repetition_penalty, 1.1f);
  EXPECT_EQ(s.presence_penalty, 0.5f);
  EXPECT_EQ(s.frequency_penalty, -0.5f);
  EXPECT_EQ(s.max_tokens, 17);
  EXPECT_EQ(s.min_tokens, 3);
  EXPECT_THAT(s.stop_token_ids, ElementsAre(2, 9));
  EXPECT_TRUE(s.ignore_eos);
  EXPECT_EQ(s.logprobs, 5);
  EXPECT_EQ(s.seed, 1234u);
  // Zero is a value, not "unset", for the optional fields.
  tandem::v1::SamplingParams zero;
  zero.set_temperature(0);
  zero.set_logprobs(0);
  EXPECT_EQ(FromProto(zero).temperature, 0.0f);
  EXPECT_EQ(FromProto(zero).logprobs, 0);
}

TEST(ProtoConvertTest, AGenerateRequestBecomesTheEnginesSpec) {
  tandem::v1::GenerateRequest req;
  req.set_request_id("r1");
  for (int id : {5, 6, 7}) req.add_prompt_token_ids(id);
  req.mutable_sampling()->set_max_tokens(4);
  req.set_resume_output_tokens(1);
  req.mutable_kv_transfer()->set_mode(tandem::v1::KvTransferParams::RECEIVE);
  const GenerateSpec spec = FromProto(req);
  EXPECT_EQ(spec.request_id, "r1");
  EXPECT_THAT(spec.prompt, ElementsAre(5, 6, 7));
  EXPECT_EQ(spec.params.max_tokens, 4);
  EXPECT_EQ(spec.resume_output_tokens, 1);
  EXPECT_FALSE(spec.on_prefilled);  // the hand-off's, not the conversion's
}

TEST(ProtoConvertTest, AFinishCarriesItsReasonStopIdUsageAndError) {
  tandem::v1::GenerateResponse out;
  ToProto(FinishInfo{.reason = FinishReason::kError,
                     .stop_token_id = 3,
                     .prompt_tokens = 10,
                     .completion_tokens = 4,
                     .cached_prompt_tokens = 8,
                     .error = "broke"},
          &out);
  EXPECT_EQ(out.finish_reason(), tandem::v1::FINISH_REASON_ERROR);
  EXPECT_EQ(out.stop_token_id(), 3);
  EXPECT_EQ(out.usage().prompt_tokens(), 10);
  EXPECT_EQ(out.usage().completion_tokens(), 4);
  EXPECT_EQ(out.usage().cached_prompt_tokens(), 8);
  EXPECT_EQ(out.error_message(), "broke");
  // No stop id (-1) and no error leave the fields unset.
  tandem::v1::GenerateResponse plain;
  ToProto(FinishInfo{.reason = FinishReason::kLength}, &plain);
  EXPECT_EQ(plain.finish_reason(), tandem::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(plain.stop_token_id(), 0);
  EXPECT_TRUE(plain.error_message().empty());
}

TEST(ProtoConvertTest, EveryKvEventKindAndACachedBlock) {
  tandem::v1::KvEvent stored;
  ToProto(KvEvent{.seq = 1, .kind = KvEvent::Kind::kStored, .block_hash = 11, .parent_hash = 10, .token_ids = {1, 2}},
          &stored);
  EXPECT_EQ(stored.seq(), 1u);
  ASSERT_TRUE(stored.has_stored());
  EXPECT_EQ(stored.stored().block_hash(), 11u);
  EXPECT_EQ(stored.stored().parent_hash(), 10u);
  EXPECT_THAT(stored.stored().token_ids(), ElementsAre(1, 2));
  tandem::v1::KvEvent removed;
  ToProto(KvEvent{.seq = 2, .kind = KvEvent::Kind::kRemoved, .block_hash = 11}, &removed);
  EXPECT_EQ(removed.seq(), 2u);
  ASSERT_TRUE(removed.has_removed());
  EXPECT_EQ(removed.removed().block_hash(), 11u);
  tandem::v1::KvEvent cleared;
  ToProto(KvEvent{.seq = 3, .kind = KvEvent::Kind::kCleared}, &cleared);
  EXPECT_EQ(cleared.seq(), 3u);
  EXPECT_TRUE(cleared.has_cleared());
  tandem::v1::CachedBlock block;
  ToProto(CachedBlock{.hash = 21, .parent = 20}, &block);
  EXPECT_EQ(block.block_hash(), 21u);
  EXPECT_EQ(block.parent_hash(), 20u);
}

TEST(ProtoConvertTest, TheLoadReportCarriesEveryCounter) {
  // Distinct values, so that two fields swapped show up.
  const LoadSnapshot s{.running = 1,
                       .waiting = 2,
                       .tokens_in_flight = 3,
                       .prefill_tokens_pending = 4,
                       .total_blocks = 5,
                       .free_blocks = 6,
                       .used_blocks = 7,
                       .cached_blocks = 8,
                       .prefix_query_tokens = 40,
                       .prefix_hit_tokens = 10,
                       .preemptions = 11,
                       .finished = 12,
                       .reserved = 13,
                       .prefilled = 14,
                       .quarantined_blocks = 15,
                       .expired_reservations = 16,
                       .local_prefill_fallbacks = 17,
                       .reservations_refused = 18,
                       .expired_handoffs = 19,
                       .kv_event_seq = 20};
  tandem::v1::LoadReport r;
  ToProto(s, &r);
  EXPECT_EQ(r.running_sequences(), 1);
  EXPECT_EQ(r.waiting_sequences(), 2);
  EXPECT_EQ(r.tokens_in_flight(), 3);
  EXPECT_EQ(r.prefill_tokens_pending(), 4);
  EXPECT_EQ(r.total_blocks(), 5);
  EXPECT_EQ(r.free_blocks(), 6);
  EXPECT_EQ(r.used_blocks(), 7);
  EXPECT_EQ(r.cached_blocks(), 8);
  EXPECT_EQ(r.prefix_query_tokens(), 40);
  EXPECT_EQ(r.prefix_hit_tokens(), 10);
  EXPECT_DOUBLE_EQ(r.prefix_hit_rate(), 0.25);
  EXPECT_EQ(r.preemptions(), 11);
  EXPECT_EQ(r.finished_requests(), 12);
  EXPECT_EQ(r.reserved_requests(), 13);
  EXPECT_EQ(r.prefilled_requests(), 14);
  EXPECT_EQ(r.quarantined_blocks(), 15);
  EXPECT_EQ(r.expired_reservations(), 16);
  EXPECT_EQ(r.local_prefill_fallbacks(), 17);
  EXPECT_EQ(r.reservations_refused(), 18);
  EXPECT_EQ(r.expired_handoffs(), 19);
  EXPECT_EQ(r.kv_event_seq(), 20u);

  const KvHandoffStats kv{.pulls = 31,
                          .pull_failures = 32,
                          .checksum_failures = 33,
                          .bytes_pulled = 34,
                          .handoffs = 35,
                          .handoff_failures = 36,
                          .pulls_in_flight = 37,
                          .pull_seconds = 3.5,
                          .timeouts_capped = 38,
                          .over_caller_cap = 39,
                          .reserved_blocks = 40,
                          .peers_refused = 41,
                          .pushes = 42,
                          .bytes_pushed = 43,
                          .pushes_received = 44};
  ToProto(kv, &r);
  EXPECT_EQ(r.kv_pulls(), 31);
  EXPECT_EQ(r.kv_pull_failures(), 32);
  EXPECT_EQ(r.kv_checksum_failures(), 33);
  EXPECT_EQ(r.kv_bytes_pulled(), 34);
  EXPECT_EQ(r.kv_handoffs(), 35);
  EXPECT_EQ(r.kv_handoff_failures(), 36);
  EXPECT_EQ(r.kv_pulls_in_flight(), 37);
  EXPECT_DOUBLE_EQ(r.kv_pull_seconds(), 3.5);
  EXPECT_EQ(r.reservation_timeouts_capped(), 38);
  EXPECT_EQ(r.reservations_over_caller_cap(), 39);
  EXPECT_EQ(r.reserved_blocks(), 40);
  EXPECT_EQ(r.kv_peers_refused(), 41);
  EXPECT_EQ(r.kv_pushes(), 42);
  EXPECT_EQ(r.kv_bytes_pushed(), 43);
  EXPECT_EQ(r.kv_pushes_received(), 44);
  EXPECT_EQ(r.running_sequences(), 1);  // the engine's fields stay
}

TEST(ProtoConvertTest, PeerInfoRoundTripsOnTheHostAndOnAGpu) {
  for (kvtransfer::MemoryType memory : {kvtransfer::MemoryType::kHost, kvtransfer::MemoryType::kCuda}) {
    const bool cuda = memory == kvtransfer::MemoryType::kCuda;
    // Field by field: GCC 12 takes a nested designated initializer in a loop for an uninitialized read.
    kvtransfer::PeerInfo info;
    info.agent_id = "agent-1";
    info.backend = "loopback";
    info.address = "127.0.0.1:9";
    info.layout = {.model = "tiny",
                   .dtype = "float32",
                   .num_layers = 2,
                   .num_kv_heads = 3,
                   .head_dim = 4,
                   .block_size = 16,
                   .num_blocks = 100,
                   .block_bytes = 4096,
                   .memory_type = memory,
                   .device_id = cuda ? 1 : -1};
    tandem::v1::KvTransferInfo wire;
    ToProto(info, &wire);
    EXPECT_EQ(wire.layout().cuda(), cuda);
    const kvtransfer::PeerInfo back = FromProto(wire);
    EXPECT_EQ(back.agent_id, info.agent_id);
    EXPECT_EQ(back.backend, info.backend);
    EXPECT_EQ(back.address, info.address);
    EXPECT_EQ(back.layout.model, info.layout.model);
    EXPECT_EQ(back.layout.dtype, info.layout.dtype);
    EXPECT_EQ(back.layout.num_layers, info.layout.num_layers);
    EXPECT_EQ(back.layout.num_kv_heads, info.layout.num_kv_heads);
    EXPECT_EQ(back.layout.head_dim, info.layout.head_dim);
    EXPECT_EQ(back.layout.block_size, info.layout.block_size);
    EXPECT_EQ(back.layout.num_blocks, info.layout.num_blocks);
    EXPECT_EQ(back.layout.block_bytes, info.layout.block_bytes);
    EXPECT_EQ(back.layout.memory_type, memory);
    EXPECT_EQ(back.layout.device_id, info.layout.device_id);
    EXPECT_TRUE(kvtransfer::CheckCompatible(info.layout, back.layout).ok());
  }
}

}  // namespace
}  // namespace tandem::worker
