// Disaggregated serving across processes: a prefill `tandem worker` and a
// decode `tandem worker`, the KV moving between them over UCX, driven
// through the gRPC protocol of proto/tandem/v1/worker.proto (RECEIVE on the
// decode worker, SEND on the prefill worker, KvReady between them), as the
// router does. Outputs are compared with an aggregated worker's; every fault
// of the fault-injecting transport wrapper and a SIGKILL of either worker
// mid-transfer are checked to leave no block behind on the survivor, which
// keeps serving.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/block_hash.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "tests/testing/http_client.h"
#include "tests/testing/worker_client.h"
#include "tests/testing/worker_process.h"
#include "tests/testing/worker_test.h"

namespace tandem {
namespace {

using namespace ::tandem::testing;  // NOLINT: the helpers of every test here
using std::chrono::milliseconds;
using std::chrono::seconds;
using ::testing::HasSubstr;

class DisaggGrpcTest : public WorkerTest {
 protected:
  // The split's KV transport: ucx over shared memory, or the one
  // TANDEM_TEST_KV_TRANSPORT names (cuda_ipc on the GPU machine, with
  // TANDEM_TEST_WORKER_DEVICE=cuda putting every worker on the GPU).
  static std::string KvTransport() {
    const char* t = std::getenv("TANDEM_TEST_KV_TRANSPORT");
    return t != nullptr && *t != '\0' ? t : "ucx";
  }
  // ucx_staged and nccl send and receive: their workers push (--kv-delivery
  // push, whether or not a test asks for it). nccl runs with
  // TANDEM_TEST_WORKER_DEVICE=cuda:by-role (two GPUs).
  static bool TwoSided() { return KvTransport() == "ucx_staged" || KvTransport() == "nccl"; }
  static std::vector<std::string> TransportFlags() {
    const std::string t = KvTransport();
    if (t == "ucx") return {"--kv-transport", t, "--kv-transport-tls", "shm"};
    // A small ring (three 64 KiB slots: five of the tiny model's blocks a
    // chunk), so most hand-offs are several chunks and wait for slots.
    if (t == "ucx_staged") {
      return {"--kv-transport",     t,   "--kv-transport-tls",     "shm",
              "--kv-staging-slots", "3", "--kv-staging-slot-size", "64KiB"};
    }
    return {"--kv-transport", t};
  }
  static std::vector<std::string> DeliveryFlags(const std::vector<std::string>& extra) {
    if (!TwoSided() || std::find(extra.begin(), extra.end(), "--kv-delivery") != extra.end()) return {};
    return {"--kv-delivery", "push"};
  }
  // One KV block of the split's workers (bfloat16 on a GPU).
  static int64_t SplitBytesPerBlock() { return KvTransport() == "ucx" ? kBytesPerBlock : AggregatedBytesPerBlock(); }
  WorkerProcess* StartPrefill(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--kv-cache-memory", "8MiB", "--role", "prefill", "--kv-hold-timeout-ms", "3000"};
    for (const std::vector<std::string>& more : {TransportFlags(), DeliveryFlags(extra), extra})
      flags.insert(flags.end(), more.begin(), more.end());
    return StartWorker(flags);
  }
  WorkerProcess* StartDecode(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--kv-cache-memory", "8MiB", "--role", "decode", "--kv-quarantine-ms", "300"};
    for (const std::vector<std::string>& more : {TransportFlags(), DeliveryFlags(extra), extra})
      flags.insert(flags.end(), more.begin(), more.end());
    return StartWorker(flags);
  }
  void SetUp() override {
    aggregated_ = StartWorker({"--kv-cache-memory", "8MiB"});
    ASSERT_NE(aggregated_, nullptr);
  }

  Split RunSplit(WorkerProcess& prefill, WorkerProcess& decode, const v1::GenerateRequest& req,
                 uint32_t timeout_ms = 0) {
    return RunDisaggregated(prefill.stub(), decode.stub(), decode.address(), req, timeout_ms);
  }

  Output Aggregated(const v1::GenerateRequest& req) { return Generate(aggregated_->stub(), req); }

  // The decode side's output of `req` after its KV did not arrive: the
  // reference's tokens after the first (it went on from the prefill
  // worker's first token), or all of them (it prefilled locally).
  void ExpectFallbackOutput(const Output& d, const v1::GenerateRequest& req) {
    const Output reference = Aggregated(req);
    if (!d.includes_first_token) {
      std::vector<int32_t> tail(reference.tokens.begin() + 1, reference.tokens.end());
      EXPECT_EQ(d.tokens, tail);
    } else {
      ExpectSameOutput(d, reference, "prefilled locally");
    }
  }

  // Waits until `decode` has a KV pull submitted to its transport.
  static void ExpectPullInFlight(WorkerProcess& decode) {
    ASSERT_TRUE(WaitForPullInFlight(decode.stub())) << "no KV pull started on the decode worker";
  }

  // Twelve prompts of mixed lengths (one token to 20 blocks, block-aligned
  // or not; prompts MakePrompt(seed + i)), greedy and seeded alternately,
  // ignoring EOS.
  static constexpr int kMixedLengths[] = {1, 15, 16, 17, 64, 100, 129, 300, 47, 250, 33, 320};
  static std::vector<v1::GenerateRequest> MixedRequests(uint32_t seed) {
    std::vector<v1::GenerateRequest> reqs;
    for (int i = 0; i < 12; ++i) {
      std::vector<int32_t> prompt = MakePrompt(seed + i, kMixedLengths[i]);
      reqs.push_back(i % 2 ? SampledRequest(prompt, 10 + i, 7 + i) : GreedyRequest(prompt, 10 + i));
      reqs.back().mutable_sampling()->set_ignore_eos(true);
    }
    return reqs;
  }

  // A worker's KV pool as KvReady names it (GetKvTransferInfo).
  static v1::KvTransferInfo TransferInfo(WorkerProcess& w) {
    v1::KvTransferInfo info;
    grpc::ClientContext ctx;
    EXPECT_TRUE(w.stub().GetKvTransferInfo(&ctx, v1::KvTransferInfoRequest(), &info).ok());
    return info;
  }
  // A KvReady for reservation `r` as a prefill worker with pool `source`
  // would send it for `prompt` (its blocks 0, 1, ... there) and first token
  // `first`, in `phase`, without checksums.
  static v1::KvReadyRequest KvReadyFor(const v1::KvReservation& r, const v1::KvTransferInfo& source,
                                       const std::vector<int32_t>& prompt, int32_t first,
                                       v1::KvReadyRequest::Phase phase = v1::KvReadyRequest::PHASE_UNSPECIFIED) {
    v1::KvReadyRequest k;
    k.set_reservation_id(r.reservation_id());
    k.set_decode_instance_id(r.instance_id());
    k.set_reservation_token(r.reservation_token());
    *k.mutable_source() = source;
    for (int b = 0; b < (static_cast<int>(prompt.size()) + kBlockSize - 1) / kBlockSize; ++b) k.add_block_ids(b);
    k.set_prompt_tokens(static_cast<int32_t>(prompt.size()));
    k.set_prompt_hash(HashTokens(prompt));
    k.mutable_first_token()->set_token_id(first);
    k.set_phase(phase);
    return k;
  }
  // KvReady on `w` directly; the answer in *resp when given.
  static grpc::Status CallKvReady(WorkerProcess& w, const v1::KvReadyRequest& r, v1::KvReadyResponse* resp = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
    v1::KvReadyResponse ignored;
    return w.stub().KvReady(&ctx, r, resp != nullptr ? resp : &ignored);
  }

  WorkerProcess* aggregated_ = nullptr;
};

// Mixed lengths (one token to 20 blocks, block-aligned or not), greedy and
// seeded, all at once: the same tokens and logprobs as one worker gives.
TEST_F(DisaggGrpcTest, ConcurrentMixedRequestsMatchAggregatedServing) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  const std::vector<v1::GenerateRequest> reqs = MixedRequests(100);
  const std::vector<Split> got = RunDisaggregatedConcurrently(prefill->stub(), decode->stub(), decode->address(), reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::string what = absl::StrCat("request ", i, " (", kMixedLengths[i], " prompt tokens)");
    EXPECT_TRUE(got[i].prefill.status.ok()) << what << ": " << got[i].prefill.status.error_message();
    EXPECT_EQ(got[i].prefill.tokens.size(), 1u) << what;
    EXPECT_EQ(got[i].prefill.kv_transfer_error, "") << what;
    EXPECT_FALSE(got[i].decode.includes_first_token) << what;
    ExpectSameOutput(got[i].combined, Aggregated(reqs[i]), what);
    EXPECT_EQ(got[i].decode.usage.prompt_tokens(), kMixedLengths[i]) << what;
  }
  const v1::LoadReport d = ExpectIdle(decode->stub(), "decode");
  const v1::LoadReport p = ExpectIdle(prefill->stub(), "prefill");
  EXPECT_EQ(d.kv_pulls(), 12);
  EXPECT_EQ(d.kv_pull_failures(), 0);
  EXPECT_EQ(d.local_prefill_fallbacks(), 0);
  EXPECT_EQ(p.kv_handoffs(), 12);
  EXPECT_EQ(p.expired_handoffs(), 0);
  // Only the blocks each prompt needs moved: sum of ceil(len / 16).
  int64_t blocks = 0;
  for (int len : kMixedLengths) blocks += (len + kBlockSize - 1) / kBlockSize;
  EXPECT_EQ(d.kv_bytes_pulled(), blocks * SplitBytesPerBlock());
  EXPECT_GT(d.kv_pull_seconds(), 0.0);
  EXPECT_EQ(d.kv_pulls_in_flight(), 0);
}

// Prefix hits on either side: the decode worker pulls only what it lacks,
// the prefill worker computes only what it lacks; outputs do not change. The
// decode worker's KV events cover the blocks it received.
TEST_F(DisaggGrpcTest, PrefixHitsOnEitherSideSaveWorkAndChangeNothing) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  const std::vector<int32_t> shared = MakePrompt(7, 96);  // 6 full blocks
  const v1::GenerateRequest first = GreedyRequest(Concat(shared, MakePrompt(8, 20)), 12);
  Split a = RunSplit(*prefill, *decode, first);
  ExpectSameOutput(a.combined, Aggregated(first), "first");
  EXPECT_EQ(a.decode.reservation.cached_tokens(), 0);
  const int64_t bytes_first = GetLoad(decode->stub()).kv_bytes_pulled();
  EXPECT_EQ(bytes_first, 8 * SplitBytesPerBlock());  // ceil(116 / 16)

  // The decode worker's KV events name every full block it now holds.
  const v1::ModelInfo info = GetModelInfo(decode->stub());
  std::vector<int32_t> computed =
      Concat(std::vector<int32_t>(first.prompt_token_ids().begin(), first.prompt_token_ids().end()), a.combined.tokens);
  computed.pop_back();  // the last token is never fed back
  {
    v1::KvEventsRequest er;
    er.set_snapshot(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
    auto reader = decode->stub().StreamKvEvents(&ctx, er);
    std::set<uint64_t> held;
    v1::KvEventBatch batch;
    while (reader->Read(&batch)) {
      for (const v1::CachedBlock& b : batch.snapshot().blocks()) held.insert(b.block_hash());
      if (batch.snapshot().complete()) break;
    }
    ctx.TryCancel();
    reader->Finish();
    for (uint64_t h : HashBlocks(info.block_hash_seed(), computed, kBlockSize)) {
      EXPECT_TRUE(held.count(h)) << "block hash " << h << " missing from the decode worker's events";
    }
  }

  // Same 96-token prefix, another tail: decode holds 6 blocks, prefill too.
  const v1::GenerateRequest second = SampledRequest(Concat(shared, MakePrompt(9, 40)), 12, 99);
  Split b = RunSplit(*prefill, *decode, second);
  ExpectSameOutput(b.combined, Aggregated(second), "second");
  EXPECT_EQ(b.decode.reservation.cached_tokens(), 96);
  EXPECT_EQ(b.prefill.usage.cached_prompt_tokens(), 96);
  // ceil(136 / 16) = 9 blocks, 6 of them cached on the decode worker.
  EXPECT_EQ(GetLoad(decode->stub()).kv_bytes_pulled() - bytes_first, 3 * SplitBytesPerBlock());
  ExpectIdle(decode->stub(), "decode");
  ExpectIdle(prefill->stub(), "prefill");
}

// Every fault of the wrapper, injected into the decode worker's transport
// (it pulls): the request still completes with the aggregated output (local
// prefill from the prefill worker's first token), the counters say so, and
// both workers end with nothing held.
TEST_F(DisaggGrpcTest, EveryTransportFaultFallsBackAndLeaksNothing) {
  WorkerProcess* prefill = StartPrefill();
  ASSERT_NE(prefill, nullptr);
  struct Case {
    std::string fault;
    bool fails;
    bool checksum;
  };
  const Case cases[] = {{"drop", true, false},
                        {"delay_ms=300", false, false},
                        {"corrupt", true, true},
                        {"fail_after_blocks=2", true, false},
                        {"fail_submit", true, false}};
  int n = 0;
  for (const Case& c : cases) {
    WorkerProcess* decode = StartDecode({"--kv-fault", c.fault});
    ASSERT_NE(decode, nullptr);
    const v1::GenerateRequest req = SampledRequest(MakePrompt(300 + n++, 90), 12, 5);
    Split s = RunSplit(*prefill, *decode, req);
    ExpectSameOutput(s.combined, Aggregated(req), c.fault);
    EXPECT_TRUE(s.prefill.status.ok()) << c.fault;
    EXPECT_FALSE(s.decode.includes_first_token) << c.fault << ": the prefill's first token is kept";
    const v1::LoadReport d = ExpectIdle(decode->stub(), c.fault + ": decode");
    if (c.fails) {
      EXPECT_NE(s.prefill.kv_transfer_error, "") << c.fault;
      EXPECT_EQ(d.kv_pull_failures(), 1) << c.fault;
      EXPECT_EQ(d.local_prefill_fallbacks(), 1) << c.fault;
      EXPECT_EQ(d.kv_checksum_failures(), c.checksum ? 1 : 0) << c.fault;
      if (c.checksum) {
        EXPECT_THAT(s.prefill.kv_transfer_error, HasSubstr("corrupted"));
      }
    } else {
      EXPECT_EQ(s.prefill.kv_transfer_error, "") << c.fault;
      EXPECT_EQ(d.kv_pulls(), 1) << c.fault;
    }
    // The prefill worker got a definite answer each time: its blocks are
    // free at once, not at the hold timeout.
    const v1::LoadReport p = ExpectIdle(prefill->stub(), c.fault + ": prefill");
    EXPECT_EQ(p.expired_handoffs(), 0) << c.fault;
  }
}

// --kv-fallback error: a failed transfer ends the request with an error.
TEST_F(DisaggGrpcTest, FallbackErrorEndsTheRequestWithAReason) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode({"--kv-fault", "fail_submit", "--kv-fallback", "error"});
  ASSERT_TRUE(prefill && decode);
  Split s = RunSplit(*prefill, *decode, GreedyRequest(MakePrompt(5, 40), 8));
  EXPECT_TRUE(s.decode.status.ok());
  EXPECT_EQ(s.decode.finish, v1::FINISH_REASON_ERROR);
  EXPECT_THAT(s.decode.error_message, HasSubstr("disaggregated prefill failed"));
  EXPECT_TRUE(s.decode.tokens.empty());
  ExpectIdle(decode->stub(), "decode");
  ExpectIdle(prefill->stub(), "prefill");
}

// No prefill ever comes: the reservation expires, the decode worker
// prefills itself and says its stream starts with the first token.
TEST_F(DisaggGrpcTest, ExpiredReservationPrefillsLocally) {
  WorkerProcess* decode = StartDecode();
  ASSERT_NE(decode, nullptr);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(11, 70), 9);
  ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/200);
  ASSERT_TRUE(receive.reserved());
  EXPECT_EQ(receive.reservation().timeout_ms(), 200u);
  Output out = receive.Finish();
  EXPECT_TRUE(out.includes_first_token);
  ExpectSameOutput(out, Aggregated(req), "expired");
  const v1::LoadReport d = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(d.expired_reservations(), 1);
  EXPECT_EQ(d.local_prefill_fallbacks(), 1);
}

// The client goes away while the reservation waits: its blocks are freed,
// and the prefill worker's late KvReady is refused, which frees its blocks.
TEST_F(DisaggGrpcTest, CancelledReservationRefusesTheLateKv) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(12, 50), 9);
  auto receive = std::make_unique<ReceiveStream>(decode->stub(), req);
  ASSERT_TRUE(receive->reserved());
  const v1::KvReservation r = receive->reservation();
  bool ok = false;
  WaitForLoad(
      decode->stub(), [](const v1::LoadReport& l) { return l.reserved_requests() == 1; }, &ok);
  EXPECT_TRUE(ok);
  receive->Cancel();
  EXPECT_EQ(receive->Finish().status.error_code(), grpc::StatusCode::CANCELLED);
  receive.reset();
  ExpectIdle(decode->stub(), "decode after the cancel");
  Output p = Generate(prefill->stub(), SendRequest(req, decode->address(), r));
  EXPECT_TRUE(p.status.ok());
  EXPECT_EQ(p.tokens.size(), 1u);
  EXPECT_THAT(p.kv_transfer_error, HasSubstr("no reservation"));
  const v1::LoadReport pl = ExpectIdle(prefill->stub(), "prefill");
  EXPECT_EQ(pl.kv_handoff_failures(), 1);
  EXPECT_EQ(pl.expired_handoffs(), 0);
}

// A decode worker counts its reservations against --max-running (issue 18,
// finding 6: ten n=128 requests put 1,280 sequences on a worker capped at
// 256). A hand-off past the cap is refused with RESOURCE_EXHAUSTED, which the
// router retries elsewhere; aggregated work waits for a place in the batch
// rather than overfill it; committed hand-offs still run.
TEST_F(DisaggGrpcTest, ReservationsCountAgainstMaxRunning) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode({"--max-running", "2"});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest a = GreedyRequest(MakePrompt(31, 40), 6);
  const v1::GenerateRequest b = GreedyRequest(MakePrompt(32, 40), 6);
  const v1::GenerateRequest c = GreedyRequest(MakePrompt(33, 40), 6);
  ReceiveStream ra(decode->stub(), a);
  ReceiveStream rb(decode->stub(), b);
  ASSERT_TRUE(ra.reserved() && rb.reserved());
  {
    ReceiveStream rc(decode->stub(), c);
    EXPECT_FALSE(rc.reserved());
    const Output out = rc.Finish();
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << out.status.error_message();
    EXPECT_THAT(out.status.error_message(), HasSubstr("--max-running"));
  }
  // An aggregated request queues behind the two held places.
  Output aggregated;
  std::thread agg([&] { aggregated = Generate(decode->stub(), c); });
  bool ok = false;
  WaitForLoad(
      decode->stub(), [](const v1::LoadReport& l) { return l.waiting_sequences() == 1 && l.reserved_requests() == 2; },
      &ok);
  EXPECT_TRUE(ok) << "the aggregated request should wait while both places are reserved";
  std::this_thread::sleep_for(milliseconds(200));
  v1::LoadReport l = WaitForLoad(
      decode->stub(), [](const v1::LoadReport&) { return true; }, &ok);
  EXPECT_EQ(l.running_sequences(), 0);
  EXPECT_EQ(l.waiting_sequences(), 1);
  EXPECT_EQ(l.reservations_refused(), 1);
  // Both hand-offs commit and run; then the aggregated request gets a place.
  Output pa = Generate(prefill->stub(), SendRequest(a, decode->address(), ra.reservation()));
  Output pb = Generate(prefill->stub(), SendRequest(b, decode->address(), rb.reservation()));
  EXPECT_TRUE(pa.status.ok() && pb.status.ok());
  ExpectSameOutput(Combine(pa, ra.Finish()), Aggregated(a), "a");
  ExpectSameOutput(Combine(pb, rb.Finish()), Aggregated(b), "b");
  agg.join();
  ExpectSameOutput(aggregated, Aggregated(c), "aggregated behind the reservations");
  ExpectIdle(decode->stub(), "decode");
  ExpectIdle(prefill->stub(), "prefill");
}

// Requests that cannot be served say why, and leave nothing behind.
TEST_F(DisaggGrpcTest, InvalidDisaggregatedRequestsAreRejected) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(13, 40), 5);

  // Roles: a prefill worker does not reserve, a decode worker does not send.
  Output wrong_role = ReceiveStream(prefill->stub(), req).Finish();
  EXPECT_EQ(wrong_role.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(wrong_role.status.error_message(), HasSubstr("role is prefill"));
  v1::KvReservation fake;
  fake.set_reservation_id(1);
  fake.set_instance_id("x");
  Output send_on_decode = Generate(decode->stub(), SendRequest(req, prefill->address(), fake));
  EXPECT_EQ(send_on_decode.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  // SEND without a destination; cached tokens not on a block boundary.
  v1::GenerateRequest no_dest = req;
  no_dest.mutable_kv_transfer()->set_mode(v1::KvTransferParams::SEND);
  EXPECT_EQ(Generate(prefill->stub(), no_dest).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::KvReservation odd = fake;
  odd.set_cached_tokens(5);
  Output odd_out = Generate(prefill->stub(), SendRequest(req, decode->address(), odd));
  EXPECT_EQ(odd_out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(odd_out.status.error_message(), HasSubstr("decode_cached_tokens"));

  // A reservation waits no longer than the worker allows: a longer
  // timeout_ms is capped (--kv-receive-timeout-max-ms, 60 s by default),
  // not refused (tests/worker_tls_test.cc covers the cap's counter).
  {
    ReceiveStream too_long(decode->stub(), req, /*timeout_ms=*/3600 * 1000 + 1);
    ASSERT_TRUE(too_long.reserved()) << too_long.Finish().status.error_message();
    EXPECT_EQ(too_long.reservation().timeout_ms(), 60000u);
    too_long.Cancel();
    too_long.Finish();
  }

  // A worker without a KV transport takes no part.
  Output no_transport = ReceiveStream(aggregated_->stub(), req).Finish();
  EXPECT_EQ(no_transport.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(no_transport.status.error_message(), HasSubstr("--kv-transport"));

  // The prefill worker is given another prompt than the decode worker
  // reserved: KvReady is refused (nothing moves) and the reservation waits
  // for its deadline, then prefills locally.
  ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/1000);
  ASSERT_TRUE(receive.reserved());
  Output mismatched = Generate(
      prefill->stub(), SendRequest(GreedyRequest(MakePrompt(14, 40), 5), decode->address(), receive.reservation()));
  EXPECT_THAT(mismatched.kv_transfer_error, HasSubstr("another prompt"));
  Output local = receive.Finish();
  EXPECT_TRUE(local.includes_first_token);
  ExpectSameOutput(local, Aggregated(req), "mismatched prompt, local prefill");

  // A restarted decode worker (another instance id) refuses the KvReady.
  ReceiveStream again(decode->stub(), req, /*timeout_ms=*/500);
  ASSERT_TRUE(again.reserved());
  v1::KvReservation stale = again.reservation();
  stale.set_instance_id("an-older-instance");
  Output stale_out = Generate(prefill->stub(), SendRequest(req, decode->address(), stale));
  EXPECT_THAT(stale_out.kv_transfer_error, HasSubstr("instance"));
  again.Finish();

  ExpectIdle(decode->stub(), "decode");
  ExpectIdle(prefill->stub(), "prefill");
}

// The reservation names the decode worker's pool blocks for the prompt (one
// per prompt block, distinct), the SEND carries the reservation forwarded
// whole (SendRequest does, as the router does), and a forwarded reservation
// that disagrees with the SEND's own fields, or names a negative block, is
// INVALID_ARGUMENT before anything runs.
TEST_F(DisaggGrpcTest, ReservationNamesItsDestinationBlocks) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(31, 40), 4);  // 3 blocks of 16
  ReceiveStream receive(decode->stub(), req);
  ASSERT_TRUE(receive.reserved());
  const v1::KvReservation& r = receive.reservation();
  ASSERT_EQ(r.block_ids_size(), 3);
  std::set<int32_t> distinct(r.block_ids().begin(), r.block_ids().end());
  EXPECT_EQ(distinct.size(), 3u);
  for (int32_t id : r.block_ids()) EXPECT_GE(id, 0);

  auto refused = [&](const std::function<void(v1::KvReservation*)>& edit, const std::string& says) {
    v1::GenerateRequest send = SendRequest(req, decode->address(), r);
    edit(send.mutable_kv_transfer()->mutable_reservation());
    const Output out = Generate(prefill->stub(), send);
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << says;
    EXPECT_THAT(out.status.error_message(), HasSubstr(says));
  };
  refused([](v1::KvReservation* x) { x->set_cached_tokens(x->cached_tokens() + 16); }, "does not match");
  refused([](v1::KvReservation* x) { x->set_reservation_token("another token"); }, "does not match");
  refused([](v1::KvReservation* x) { x->set_block_ids(1, -2); }, "block_ids holds -2");

  // The forwarded reservation, unchanged: the split request completes.
  Output sent = Generate(prefill->stub(), SendRequest(req, decode->address(), r));
  EXPECT_TRUE(sent.status.ok()) << sent.status.error_message();
  EXPECT_EQ(sent.kv_transfer_error, "");
  const Output received = receive.Finish();
  ASSERT_TRUE(received.status.ok()) << received.status.error_message();
  ExpectSameOutput(Combine(sent, received), Aggregated(req), "forwarded reservation");
  ExpectIdle(decode->stub(), "decode");
  ExpectIdle(prefill->stub(), "prefill");
}

// Workers whose KV layouts differ (block size) never exchange bytes: the
// decode worker refuses the pool and prefills locally.
TEST_F(DisaggGrpcTest, IncompatibleLayoutsAreRefusedBeforeAnyByteMoves) {
  WorkerProcess* prefill = StartPrefill({"--block-size", "32"});
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(15, 70), 6);
  Split s = RunSplit(*prefill, *decode, req);
  EXPECT_THAT(s.prefill.kv_transfer_error, HasSubstr("block_size"));
  ExpectSameOutput(s.combined, Aggregated(req), "layout mismatch");
  const v1::LoadReport d = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(d.local_prefill_fallbacks(), 1);
  EXPECT_EQ(d.kv_bytes_pulled(), 0);
  ExpectIdle(prefill->stub(), "prefill");
}

// SIGKILL of the prefill worker while the decode worker's pull waits (a
// delay fault holds it): the pull fails, the decode worker prefills locally
// from the first token it was given, frees everything and serves the next
// request with a new prefill worker.
TEST_F(DisaggGrpcTest, KilledPrefillWorkerMidTransfer) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode({"--kv-fault", "delay_ms=1500"});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = SampledRequest(MakePrompt(16, 120), 10, 3);
  ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/10000);
  ASSERT_TRUE(receive.reserved());
  Output p;
  std::jthread send(
      [&] { p = Generate(prefill->stub(), SendRequest(req, decode->address(), receive.reservation()), seconds(20)); });
  // The first token is out and the decode worker's pull is under way (held
  // by the delay): kill the prefill worker.
  ExpectPullInFlight(*decode);
  Kill(prefill);
  send.join();
  EXPECT_FALSE(p.status.ok());
  Output d = receive.Finish();
  EXPECT_TRUE(d.status.ok()) << d.status.error_message();
  const Output reference = Aggregated(req);
  EXPECT_EQ(Combine(p, d).tokens.size(), reference.tokens.size());
  if (!d.includes_first_token) {
    // The decode worker continued from the first token it was handed.
    std::vector<int32_t> tail(reference.tokens.begin() + 1, reference.tokens.end());
    EXPECT_EQ(d.tokens, tail);
  }
  const v1::LoadReport dl = ExpectIdle(decode->stub(), "decode");
  if (KvTransport() == "ucx") {
    EXPECT_EQ(dl.local_prefill_fallbacks(), 1);
  } else {
    // cuda_ipc: the dead worker's pool stays mapped until the decode side
    // notices the exit (within a second), so a pull that starts before then
    // still reads the (complete) KV; either way the output is the same.
    EXPECT_LE(dl.local_prefill_fallbacks(), 1);
  }

  WorkerProcess* prefill2 = StartPrefill();
  ASSERT_NE(prefill2, nullptr);
  const v1::GenerateRequest next = GreedyRequest(MakePrompt(17, 60), 8);
  Split s = RunSplit(*prefill2, *decode, next);
  ExpectSameOutput(s.combined, Aggregated(next), "after the kill");
  ExpectIdle(decode->stub(), "decode");
}

// SIGKILL of the decode worker while it pulls: the prefill worker's
// KvReady fails without a definite answer, so it holds the blocks until the
// call's deadline (the dead side could still have been reading), then frees
// them and keeps serving.
TEST_F(DisaggGrpcTest, KilledDecodeWorkerMidTransfer) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode({"--kv-fault", "delay_ms=1500"});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(18, 120), 10);
  auto receive = std::make_unique<ReceiveStream>(decode->stub(), req);
  ASSERT_TRUE(receive->reserved());
  Output p;
  std::jthread send(
      [&] { p = Generate(prefill->stub(), SendRequest(req, decode->address(), receive->reservation()), seconds(20)); });
  ExpectPullInFlight(*decode);
  Kill(decode);
  send.join();
  EXPECT_TRUE(p.status.ok()) << p.status.error_message();
  EXPECT_EQ(p.tokens.size(), 1u);
  EXPECT_NE(p.kv_transfer_error, "");
  EXPECT_FALSE(receive->Finish().status.ok());
  receive.reset();
  // Held until the 3 s hold timeout, then freed.
  const v1::LoadReport pl = ExpectIdle(prefill->stub(), "prefill", seconds(10));
  EXPECT_EQ(pl.expired_handoffs(), 1);

  WorkerProcess* decode2 = StartDecode();
  ASSERT_NE(decode2, nullptr);
  const v1::GenerateRequest next = GreedyRequest(MakePrompt(19, 60), 8);
  Split s = RunSplit(*prefill, *decode2, next);
  ExpectSameOutput(s.combined, Aggregated(next), "after the kill");
  ExpectIdle(prefill->stub(), "prefill");
  ExpectIdle(decode2->stub(), "decode");
}

// Chaos: concurrent split requests whose streams are cancelled at random
// moments on either side, or given short deadlines. Whatever happens, both
// workers end with nothing held, and serve a normal request correctly.
TEST_F(DisaggGrpcTest, RandomCancellationsOnEitherSideLeakNothing) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 8;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      for (int i = 0; i < kPerThread; ++i) {
        const int len = 1 + static_cast<int>(rng() % 200);
        v1::GenerateRequest req = GreedyRequest(MakePrompt(1000 + t * 100 + i, len), 20);
        req.mutable_sampling()->set_ignore_eos(true);
        const int action = static_cast<int>(rng() % 4);
        const milliseconds delay(rng() % 40);
        // A short reservation timeout: a prefill that is cancelled before
        // its first token never sends KvReady.
        ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/800);
        if (!receive.reserved()) {
          receive.Finish();
          continue;
        }
        grpc::ClientContext pctx;
        pctx.set_deadline(std::chrono::system_clock::now() +
                          (action == 2 ? milliseconds(1 + rng() % 10) : kRpcTimeout));
        std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
            prefill->stub().Generate(&pctx, SendRequest(req, decode->address(), receive.reservation()));
        std::jthread canceller([&] {
          std::this_thread::sleep_for(delay);
          if (action == 0) receive.Cancel();
          if (action == 1) pctx.TryCancel();
        });
        v1::GenerateResponse msg;
        while (reader->Read(&msg)) {
        }
        reader->Finish();
        canceller.join();
        Output d = receive.Finish();
        if (action == 3) {
          EXPECT_TRUE(d.status.ok()) << d.status.error_message();
          EXPECT_EQ(d.finish, v1::FINISH_REASON_LENGTH);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ExpectIdle(decode->stub(), "decode", seconds(10));
  ExpectIdle(prefill->stub(), "prefill", seconds(10));
  const v1::GenerateRequest req = SampledRequest(MakePrompt(77, 130), 16, 4);
  Split s = RunSplit(*prefill, *decode, req);
  ExpectSameOutput(s.combined, Aggregated(req), "after the chaos");
}

// A decode worker shutting down ends its waiting reservations with
// UNAVAILABLE (the caller retries elsewhere); the prefill worker's late
// KvReady fails and it frees its blocks.
// A decode worker stopped at once (--drain-timeout 0, or a drain that ran
// out) ends the reservations waiting for their KV with UNAVAILABLE.
TEST_F(DisaggGrpcTest, ShutdownEndsWaitingReservationsWithUnavailable) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode({"--drain-timeout", "0"});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(21, 60), 8);
  ReceiveStream receive(decode->stub(), req);
  ASSERT_TRUE(receive.reserved());
  const v1::KvReservation r = receive.reservation();
  ::kill(decode->pid(), SIGTERM);
  Output d = receive.Finish();
  EXPECT_EQ(d.status.error_code(), grpc::StatusCode::UNAVAILABLE) << d.status.error_message();
  absl::StatusOr<int> exited = decode->Wait(seconds(10));
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << *exited;
  Output p = Generate(prefill->stub(), SendRequest(req, decode->address(), r), seconds(20));
  EXPECT_TRUE(p.status.ok());
  EXPECT_NE(p.kv_transfer_error, "");
  ExpectIdle(prefill->stub(), "prefill", seconds(10));
}

// A draining decode worker (SIGTERM) refuses new requests but keeps the
// hand-offs it committed to: the KV the prefill worker sends afterwards is
// taken, the stream finishes with the aggregated tokens, then it exits.
TEST_F(DisaggGrpcTest, DrainingDecodeWorkerFinishesItsCommittedHandOffs) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(22, 60), 8);
  ReceiveStream receive(decode->stub(), req);
  ASSERT_TRUE(receive.reserved());
  const v1::KvReservation r = receive.reservation();
  ::kill(decode->pid(), SIGTERM);
  // The signal is handled asynchronously: wait until the drain shows.
  ASSERT_EQ(WaitForHealth(decode->stub(), v1::HealthResponse::NOT_SERVING, seconds(5)),
            v1::HealthResponse::NOT_SERVING);
  {
    // New work is refused...
    Output refused = Generate(decode->stub(), GreedyRequest(MakePrompt(23, 20), 4), seconds(10));
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.status.error_message();
  }
  // ...but the committed hand-off completes.
  Output p = Generate(prefill->stub(), SendRequest(req, decode->address(), r), seconds(20));
  EXPECT_TRUE(p.status.ok()) << p.status.error_message();
  EXPECT_EQ(p.kv_transfer_error, "");
  Output d = receive.Finish();
  ASSERT_TRUE(d.status.ok()) << d.status.error_message();
  // The prefill worker streams the first token, the decode worker the rest.
  EXPECT_EQ(Concat(p.tokens, d.tokens), Aggregated(req).tokens);
  absl::StatusOr<int> exited = decode->Wait(seconds(10));
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << *exited;
  ExpectIdle(prefill->stub(), "prefill", seconds(10));
}

// The workers' metrics ports count the hand-off: bytes and pulls on the
// decode side (as its LoadReport does), a KvReady sent on the prefill side.
TEST_F(DisaggGrpcTest, MetricsPortsCountTheKvTransfer) {
  const int prefill_port = FreeTcpPort();
  const int decode_port = FreeTcpPort();
  ASSERT_TRUE(prefill_port > 0 && decode_port > 0 && prefill_port != decode_port);
  WorkerProcess* prefill = StartPrefill({"--metrics-port", std::to_string(prefill_port)});
  WorkerProcess* decode = StartDecode({"--metrics-port", std::to_string(decode_port)});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(24, 60), 8);
  ReceiveStream receive(decode->stub(), req);
  ASSERT_TRUE(receive.reserved());
  Output p = Generate(prefill->stub(), SendRequest(req, decode->address(), receive.reservation()), seconds(20));
  ASSERT_TRUE(p.status.ok()) << p.status.error_message();
  ASSERT_TRUE(receive.Finish().status.ok());
  const std::string d = absl::StrCat("127.0.0.1:", decode_port);
  const std::string f = absl::StrCat("127.0.0.1:", prefill_port);
  const v1::LoadReport load = GetLoad(decode->stub());
  EXPECT_GT(load.kv_bytes_pulled(), 0);
  EXPECT_EQ(ScrapeMetric(d, "tandem_worker_kv_transfer_bytes_total"), load.kv_bytes_pulled());
  EXPECT_EQ(ScrapeMetric(d, "tandem_worker_kv_transfers_total{outcome=\"pulled\"}"), 1);
  EXPECT_GT(ScrapeMetric(d, "tandem_worker_kv_transfer_seconds_total").value_or(0), 0);
  EXPECT_EQ(ScrapeMetric(f, "tandem_worker_kv_transfers_total{outcome=\"sent\"}"), 1);
}

// The CLI splits a request the same way: `tandem generate --decode`.
TEST_F(DisaggGrpcTest, GenerateCliSplitsARequest) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  const std::vector<int32_t> prompt = MakePrompt(31, 40);
  const std::string out_path = ::testing::TempDir() + "/generate_split.txt";
  absl::StatusOr<ChildProcess> cli = ChildProcess::Spawn(
      {*bin, "generate", "--target", prefill->address(), "--decode", decode->address(), "--prompt-ids",
       absl::StrJoin(prompt, ","), "--max-tokens", "12", "--temperature", "0", "--show-ids"},
      out_path);
  ASSERT_TRUE(cli.ok()) << cli.status();
  absl::StatusOr<int> status = cli->Wait(seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  std::ifstream in(out_path);
  std::vector<int32_t> printed;
  int32_t id;
  while (in >> id) printed.push_back(id);
  EXPECT_EQ(printed, Aggregated(GreedyRequest(prompt, 12)).tokens);
  EXPECT_EQ(GetLoad(decode->stub()).kv_pulls(), 1);
}

// KvReady called directly with malformed content: each is refused with the
// right code; one the reservation cannot survive (block ids outside the
// source pool) ends in a local prefill that keeps the given first token.
TEST_F(DisaggGrpcTest, MalformedKvReadyCallsAreRefused) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode();
  ASSERT_TRUE(prefill && decode);
  const std::vector<int32_t> prompt = MakePrompt(41, 40);  // 3 blocks
  const v1::GenerateRequest req = GreedyRequest(prompt, 6);
  ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/20000);
  ASSERT_TRUE(receive.reserved());
  const v1::KvTransferInfo source = TransferInfo(*prefill);
  const Output reference = Aggregated(req);
  const v1::KvReadyRequest good = KvReadyFor(receive.reservation(), source, prompt, reference.tokens[0]);
  auto call = [&](const v1::KvReadyRequest& r) { return CallKvReady(*decode, r); };
  v1::KvReadyRequest r = good;
  r.set_decode_instance_id("another");
  EXPECT_EQ(call(r).error_code(), grpc::StatusCode::NOT_FOUND);
  r = good;  // the reservation's id without its token names nothing
  r.clear_reservation_token();
  EXPECT_EQ(call(r).error_code(), grpc::StatusCode::NOT_FOUND);
  r = good;
  r.mutable_first_token()->set_token_id(kVocabSize);
  EXPECT_EQ(call(r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  r = good;
  r.add_block_ids(3);
  EXPECT_EQ(call(r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  r = good;
  r.add_block_checksums(1);
  EXPECT_EQ(call(r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  r = good;
  r.set_prompt_hash(good.prompt_hash() + 1);
  EXPECT_EQ(call(r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(GetLoad(decode->stub()).reserved_requests(), 1) << "still waiting for the right call";
  // Block ids past the source pool: the pull cannot start; fallback.
  r = good;
  r.set_block_ids(2, static_cast<int32_t>(source.layout().num_blocks()));
  grpc::Status st = call(r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  Output d = receive.Finish();
  EXPECT_FALSE(d.includes_first_token);
  ExpectSameOutput(Combine(reference, d), reference, "fallback after a bad KvReady");
  // The reservation is gone: the good call now finds nothing.
  EXPECT_EQ(call(good).error_code(), grpc::StatusCode::NOT_FOUND);
  ExpectIdle(decode->stub(), "decode");
}

// ---------------------------------------------------------------------------
// Push delivery (--kv-delivery push on both workers): the prefill worker
// joins the reservation (KvReady JOIN: the decode worker pins its blocks and
// names its pool), writes the blocks into it, and says so (KvReady PUSHED).

// Mixed lengths at once, then a prompt sharing a prefix with the decode
// worker's cache: the same outputs as one worker, every byte pushed (only
// the blocks the decode worker lacks), nothing pulled, nothing left behind.
TEST_F(DisaggGrpcTest, PushedSplitsMatchAggregatedServing) {
  WorkerProcess* prefill = StartPrefill({"--kv-delivery", "push"});
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  ASSERT_TRUE(prefill && decode);
  const std::vector<v1::GenerateRequest> reqs = MixedRequests(500);
  const std::vector<Split> got = RunDisaggregatedConcurrently(prefill->stub(), decode->stub(), decode->address(), reqs);
  int64_t blocks = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::string what = absl::StrCat("request ", i, " (", kMixedLengths[i], " prompt tokens)");
    EXPECT_TRUE(got[i].prefill.status.ok()) << what << ": " << got[i].prefill.status.error_message();
    EXPECT_EQ(got[i].prefill.kv_transfer_error, "") << what;
    EXPECT_FALSE(got[i].decode.includes_first_token) << what;
    EXPECT_TRUE(got[i].decode.reservation.has_destination()) << what << ": the reservation offers no pool";
    EXPECT_EQ(got[i].decode.reservation.destination().backend(), KvTransport()) << what;
    ExpectSameOutput(got[i].combined, Aggregated(reqs[i]), what);
    blocks += (kMixedLengths[i] + kBlockSize - 1) / kBlockSize;
  }
  v1::LoadReport d = ExpectIdle(decode->stub(), "decode");
  v1::LoadReport p = ExpectIdle(prefill->stub(), "prefill");
  EXPECT_EQ(d.kv_pushes_received(), 12);
  EXPECT_EQ(d.kv_pulls(), 0);
  EXPECT_EQ(d.kv_pull_failures(), 0);
  EXPECT_EQ(d.local_prefill_fallbacks(), 0);
  EXPECT_EQ(p.kv_pushes(), 12);
  EXPECT_EQ(p.kv_handoffs(), 12);
  EXPECT_EQ(p.kv_bytes_pushed(), blocks * SplitBytesPerBlock());
  EXPECT_EQ(p.expired_handoffs(), 0);

  // A prompt whose first 6 blocks the decode worker holds: 2 more move.
  const v1::GenerateRequest first = GreedyRequest(Concat(MakePrompt(77, 96), MakePrompt(78, 20)), 8);
  const v1::GenerateRequest second = GreedyRequest(Concat(MakePrompt(77, 96), MakePrompt(79, 20)), 8);
  ExpectSameOutput(RunSplit(*prefill, *decode, first).combined, Aggregated(first), "first");
  const int64_t before = GetLoad(prefill->stub()).kv_bytes_pushed();
  Split s = RunSplit(*prefill, *decode, second);
  EXPECT_EQ(s.decode.reservation.cached_tokens(), 96);
  ExpectSameOutput(s.combined, Aggregated(second), "second");
  p = ExpectIdle(prefill->stub(), "prefill");
  EXPECT_EQ(p.kv_bytes_pushed() - before, 2 * SplitBytesPerBlock());
  d = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(d.kv_pushes_received(), 14);
}

// Push needs both sides: a push-mode prefill worker pulls for a decode
// worker that offers no pool, and a push-mode decode worker is pulled from
// by a prefill worker that does not push.
TEST_F(DisaggGrpcTest, PushNeedsBothWorkersElseTheKvIsPulled) {
  for (bool prefill_pushes : {true, false}) {
    const std::string what = prefill_pushes ? "push prefill, pull decode" : "pull prefill, push decode";
    WorkerProcess* prefill =
        StartPrefill(prefill_pushes ? std::vector<std::string>{"--kv-delivery", "push"} : std::vector<std::string>{});
    WorkerProcess* decode =
        StartDecode(prefill_pushes ? std::vector<std::string>{} : std::vector<std::string>{"--kv-delivery", "push"});
    ASSERT_TRUE(prefill && decode);
    const v1::GenerateRequest req = GreedyRequest(MakePrompt(prefill_pushes ? 81 : 82, 50), 6);
    Split s = RunSplit(*prefill, *decode, req);
    EXPECT_EQ(s.decode.reservation.has_destination(), !prefill_pushes) << what;
    EXPECT_EQ(s.prefill.kv_transfer_error, "") << what;
    ExpectSameOutput(s.combined, Aggregated(req), what);
    const v1::LoadReport d = ExpectIdle(decode->stub(), what);
    const v1::LoadReport p = ExpectIdle(prefill->stub(), what);
    EXPECT_EQ(d.kv_pulls(), 1) << what;
    EXPECT_EQ(p.kv_pushes(), 0) << what;
    if (!prefill_pushes) continue;
    // A pool offered where the decode worker takes no push (a stale or
    // forged destination): its JOIN is refused and the KV is pulled.
    ReceiveStream receive(decode->stub(), req);
    ASSERT_TRUE(receive.reserved());
    v1::KvReservation forged = receive.reservation();
    *forged.mutable_destination() = TransferInfo(*decode);
    const Output sent = Generate(prefill->stub(), SendRequest(req, decode->address(), forged));
    EXPECT_EQ(sent.kv_transfer_error, "");
    ExpectSameOutput(Combine(sent, receive.Finish()), Aggregated(req), "forged destination");
    EXPECT_EQ(ExpectIdle(decode->stub(), "forged destination").kv_pulls(), 2);
    ExpectIdle(prefill->stub(), "forged destination");
  }
}

// A router that says the decode worker holds less of the prompt than it
// does (cached_tokens forged down, consistently): the blocks of its prefix
// cache are never written; the sender tells the decode worker, which
// prefills locally at once.
TEST_F(DisaggGrpcTest, AForgedCachedPrefixIsNeverPushedInto) {
  WorkerProcess* prefill = StartPrefill({"--kv-delivery", "push"});
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest first = GreedyRequest(Concat(MakePrompt(91, 96), MakePrompt(92, 20)), 8);
  const v1::GenerateRequest second = GreedyRequest(Concat(MakePrompt(91, 96), MakePrompt(93, 20)), 8);
  ExpectSameOutput(RunSplit(*prefill, *decode, first).combined, Aggregated(first), "first");
  ReceiveStream receive(decode->stub(), second, /*timeout_ms=*/30000);
  ASSERT_TRUE(receive.reserved());
  ASSERT_EQ(receive.reservation().cached_tokens(), 96);
  v1::KvReservation forged = receive.reservation();
  forged.set_cached_tokens(0);
  v1::GenerateRequest send = SendRequest(second, decode->address(), forged);
  send.mutable_kv_transfer()->set_decode_cached_tokens(0);
  const auto sent_at = std::chrono::steady_clock::now();
  const Output sent = Generate(prefill->stub(), send);
  EXPECT_THAT(sent.kv_transfer_error, HasSubstr("cached"));
  const Output got = receive.Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - sent_at, seconds(10)) << "fell back at the deadline, not at once";
  ExpectSameOutput(Combine(sent, got), Aggregated(second), "forged cached prefix");
  const v1::LoadReport d = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(d.local_prefill_fallbacks(), 1);
  EXPECT_EQ(d.kv_pushes_received(), 1);
  ExpectIdle(prefill->stub(), "prefill");
  // The shared prefix is intact: a third request over it matches.
  const v1::GenerateRequest third = GreedyRequest(Concat(MakePrompt(91, 96), MakePrompt(94, 20)), 8);
  ExpectSameOutput(RunSplit(*prefill, *decode, third).combined, Aggregated(third), "third");
}

// Every fault of the injector on the pushing side (and a pairing that
// fails): the decode worker hears of it from the sender (KvReady PUSHED with
// sender_error, or a checksum mismatch) and prefills locally at once, not
// at its reservation's deadline; outputs do not change; both workers end
// with nothing held, the decode worker's pinned blocks freed.
TEST_F(DisaggGrpcTest, EveryPushFaultFallsBackAndLeaksNothing) {
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  ASSERT_NE(decode, nullptr);
  struct Case {
    std::string fault;
    bool fails;
    bool checksum;
  };
  const Case cases[] = {{"drop", true, false},        {"delay_ms=300", false, false},
                        {"corrupt", true, true},      {"fail_after_blocks=2", true, false},
                        {"fail_submit", true, false}, {"fail_pair", true, false}};
  // nccl's receiver checks the sender's runs against the receive's block
  // pairs before a byte lands: a wrong source block breaks a run, and the
  // push fails there ("block lists differ") instead of at the checksums.
  const bool runs_checked = KvTransport() == "nccl";
  int n = 0;
  int64_t failures = 0, fallbacks = 0, checksum_failures = 0, received = 0;
  for (const Case& c : cases) {
    WorkerProcess* prefill = StartPrefill({"--kv-delivery", "push", "--kv-fault", c.fault});
    ASSERT_NE(prefill, nullptr) << c.fault;
    const v1::GenerateRequest req = SampledRequest(MakePrompt(600 + n++, 90), 12, 5);
    // A reservation that outlives the test's patience: a fallback must come
    // from the sender's word, not from the deadline.
    Split s = RunSplit(*prefill, *decode, req, /*timeout_ms=*/30000);
    ExpectSameOutput(s.combined, Aggregated(req), c.fault);
    EXPECT_TRUE(s.prefill.status.ok()) << c.fault << ": " << s.prefill.status.error_message();
    EXPECT_FALSE(s.decode.includes_first_token) << c.fault << ": the prefill's first token is kept";
    const v1::LoadReport d = ExpectIdle(decode->stub(), c.fault + ": decode");
    failures += c.fails ? 1 : 0;
    fallbacks += c.fails ? 1 : 0;
    checksum_failures += c.checksum && !runs_checked ? 1 : 0;
    received += c.fails ? 0 : 1;
    EXPECT_EQ(d.kv_pull_failures(), failures) << c.fault;
    EXPECT_EQ(d.local_prefill_fallbacks(), fallbacks) << c.fault;
    EXPECT_EQ(d.kv_checksum_failures(), checksum_failures) << c.fault;
    EXPECT_EQ(d.kv_pushes_received(), received) << c.fault;
    EXPECT_EQ(d.expired_reservations(), 0) << c.fault;
    if (c.fails) {
      EXPECT_NE(s.prefill.kv_transfer_error, "") << c.fault;
      if (c.checksum) {
        EXPECT_THAT(s.prefill.kv_transfer_error, HasSubstr(runs_checked ? "block lists differ" : "corrupted"));
      }
      if (c.fault == "fail_pair") {
        EXPECT_THAT(s.prefill.kv_transfer_error, HasSubstr("pairing"));
      }
    } else {
      EXPECT_EQ(s.prefill.kv_transfer_error, "") << c.fault;
    }
    const v1::LoadReport p = ExpectIdle(prefill->stub(), c.fault + ": prefill");
    EXPECT_EQ(p.kv_pushes(), c.fails ? 0 : 1) << c.fault;
    EXPECT_EQ(p.expired_handoffs(), 0) << c.fault;
  }
}

// A prefill worker shut down while its push is held back (a delay fault,
// past its drain timeout) cancels the push and still tells the decode
// worker (PUSHED with sender_error), which prefills locally at once instead
// of keeping the joined reservation until its 30 s deadline.
TEST_F(DisaggGrpcTest, AStoppingPusherTellsTheDecodeWorker) {
  WorkerProcess* prefill =
      StartPrefill({"--kv-delivery", "push", "--kv-fault", "delay_ms=2500", "--drain-timeout", "0.2"});
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(45, 60), 6);
  ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/30000);
  ASSERT_TRUE(receive.reserved());
  Output sent;
  std::jthread send([&] {
    sent = Generate(prefill->stub(), SendRequest(req, decode->address(), receive.reservation()), seconds(20));
  });
  std::this_thread::sleep_for(milliseconds(500));  // the first token is out, the push held
  const auto stopped = std::chrono::steady_clock::now();
  ::kill(prefill->pid(), SIGTERM);
  const Output d = receive.Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - stopped, seconds(10)) << "the decode worker waited for its deadline";
  EXPECT_TRUE(d.status.ok()) << d.status.error_message();
  send.join();
  ExpectFallbackOutput(d, req);
  const v1::LoadReport load = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(load.local_prefill_fallbacks(), 1);
  EXPECT_EQ(load.expired_reservations(), 0);
  EXPECT_EQ(load.kv_pushes_received(), 0);
}

// Send/receive transports (TANDEM_TEST_KV_TRANSPORT=ucx_staged): the
// decode worker's Receive, posted at the JOIN, sees the pusher die (its
// process gone) and prefills locally at once, not at the reservation's
// deadline; a new prefill worker then pushes to it.
TEST_F(DisaggGrpcTest, AKilledPusherIsNoticedByTheReceiveAtOnce) {
  if (!TwoSided()) GTEST_SKIP() << "for send/receive transports (TANDEM_TEST_KV_TRANSPORT=ucx_staged)";
  WorkerProcess* prefill = StartPrefill({"--kv-delivery", "push", "--kv-fault", "delay_ms=3000"});
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = SampledRequest(MakePrompt(46, 120), 10, 3);
  ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/30000);
  ASSERT_TRUE(receive.reserved());
  Output p;
  std::jthread send(
      [&] { p = Generate(prefill->stub(), SendRequest(req, decode->address(), receive.reservation()), seconds(20)); });
  std::this_thread::sleep_for(milliseconds(800));  // joined; the push held back by the delay
  const auto killed = std::chrono::steady_clock::now();
  Kill(prefill);
  send.join();
  const Output d = receive.Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - killed, seconds(5)) << "the decode worker waited for its deadline";
  EXPECT_TRUE(d.status.ok()) << d.status.error_message();
  ExpectFallbackOutput(d, req);
  const v1::LoadReport dl = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(dl.local_prefill_fallbacks(), 1);
  EXPECT_EQ(dl.expired_reservations(), 0);
  WorkerProcess* prefill2 = StartPrefill({"--kv-delivery", "push"});
  ASSERT_NE(prefill2, nullptr);
  const v1::GenerateRequest next = GreedyRequest(MakePrompt(47, 60), 8);
  ExpectSameOutput(RunSplit(*prefill2, *decode, next).combined, Aggregated(next), "after the kill");
  EXPECT_EQ(ExpectIdle(decode->stub(), "decode").kv_pushes_received(), 1);
  ExpectIdle(prefill2->stub(), "prefill");
}

// The other way round: the receiver killed after it joined; the push fails
// (its peer gone), the prefill worker frees its blocks and pushes to a new
// decode worker.
TEST_F(DisaggGrpcTest, AKilledReceiverFailsThePushAndFreesTheBlocks) {
  if (!TwoSided()) GTEST_SKIP() << "for send/receive transports (TANDEM_TEST_KV_TRANSPORT=ucx_staged)";
  WorkerProcess* prefill = StartPrefill({"--kv-delivery", "push", "--kv-fault", "delay_ms=1500"});
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(48, 120), 10);
  auto receive = std::make_unique<ReceiveStream>(decode->stub(), req);
  ASSERT_TRUE(receive->reserved());
  Output p;
  std::jthread send(
      [&] { p = Generate(prefill->stub(), SendRequest(req, decode->address(), receive->reservation()), seconds(20)); });
  std::this_thread::sleep_for(milliseconds(600));
  Kill(decode);
  send.join();
  EXPECT_TRUE(p.status.ok()) << p.status.error_message();
  EXPECT_EQ(p.tokens.size(), 1u);
  EXPECT_NE(p.kv_transfer_error, "");
  EXPECT_FALSE(receive->Finish().status.ok());
  receive.reset();
  ExpectIdle(prefill->stub(), "prefill", seconds(10));
  WorkerProcess* decode2 = StartDecode({"--kv-delivery", "push"});
  ASSERT_NE(decode2, nullptr);
  const v1::GenerateRequest next = GreedyRequest(MakePrompt(49, 60), 8);
  ExpectSameOutput(RunSplit(*prefill, *decode2, next).combined, Aggregated(next), "after the kill");
  EXPECT_EQ(ExpectIdle(prefill->stub(), "prefill").kv_pushes(), 1);
  ExpectIdle(decode2->stub(), "decode");
}

// A transport that pairs through an offer (the fault injector's
// offer_pairing, shaped as NCCL's communicator id): the prefill worker's
// JOIN carries its offer and the decode worker pairs with it. A prefill
// worker that offers nothing is refused at the JOIN (its pairing fails on
// the decode side), and the request falls back at once.
TEST_F(DisaggGrpcTest, APairingOfferTravelsInTheJoin) {
  if (!TwoSided()) GTEST_SKIP() << "for send/receive transports (TANDEM_TEST_KV_TRANSPORT=ucx_staged)";
  if (KvTransport() == "nccl") GTEST_SKIP() << "nccl pairs through its own offer in every test here";
  WorkerProcess* prefill = StartPrefill({"--kv-delivery", "push", "--kv-fault", "offer_pairing"});
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push", "--kv-fault", "offer_pairing"});
  ASSERT_TRUE(prefill && decode);
  for (int i = 0; i < 2; ++i) {  // the second reuses the pairing
    const v1::GenerateRequest req = GreedyRequest(MakePrompt(50 + i, 70), 6);
    Split s = RunSplit(*prefill, *decode, req);
    EXPECT_EQ(s.prefill.kv_transfer_error, "") << i;
    ExpectSameOutput(s.combined, Aggregated(req), absl::StrCat("request ", i));
  }
  v1::LoadReport d = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(d.kv_pushes_received(), 2);
  EXPECT_EQ(d.local_prefill_fallbacks(), 0);
  ExpectIdle(prefill->stub(), "prefill");

  WorkerProcess* silent = StartPrefill({"--kv-delivery", "push"});
  ASSERT_NE(silent, nullptr);
  const v1::GenerateRequest req = GreedyRequest(MakePrompt(52, 70), 6);
  const auto sent = std::chrono::steady_clock::now();
  Split s = RunSplit(*silent, *decode, req, /*timeout_ms=*/30000);
  EXPECT_LT(std::chrono::steady_clock::now() - sent, seconds(10)) << "fell back at the deadline, not at once";
  EXPECT_THAT(s.prefill.kv_transfer_error, HasSubstr("offer"));
  ExpectSameOutput(s.combined, Aggregated(req), "no offer");
  d = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(d.local_prefill_fallbacks(), 1);
  EXPECT_EQ(d.kv_pushes_received(), 2);
  ExpectIdle(silent->stub(), "prefill without an offer");
}

// The JOIN / PUSHED protocol driven by hand against a push-mode decode
// worker: each bad call gets its status and leaves the reservation as it
// was; a joined reservation's blocks stay pinned past its cancellation
// (beyond the quarantine) until the pin ends; a JOIN to a pull-mode worker
// is refused without consuming the reservation.
TEST_F(DisaggGrpcTest, JoinAndPushedCallsAreCheckedAndPinsOutliveACancel) {
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  WorkerProcess* pulling = StartDecode();
  ASSERT_TRUE(prefill && decode && pulling);
  const v1::KvTransferInfo source = TransferInfo(*prefill);
  const std::vector<int32_t> prompt = MakePrompt(43, 40);  // 3 blocks
  const v1::GenerateRequest req = GreedyRequest(prompt, 6);
  const Output reference = Aggregated(req);
  auto describe = [&](const v1::KvReservation& r, v1::KvReadyRequest::Phase phase) {
    return KvReadyFor(r, source, prompt, reference.tokens[0], phase);
  };
  auto call = [](WorkerProcess* w, const v1::KvReadyRequest& r, v1::KvReadyResponse* resp = nullptr) {
    return CallKvReady(*w, r, resp);
  };

  // A pull-mode worker refuses JOIN and PUSHED; its reservation still takes
  // a pull afterwards.
  {
    v1::GenerateRequest preq = GreedyRequest(prompt, 6);
    ReceiveStream receive(pulling->stub(), preq, /*timeout_ms=*/20000);
    ASSERT_TRUE(receive.reserved());
    EXPECT_FALSE(receive.reservation().has_destination());
    grpc::Status st = call(pulling, describe(receive.reservation(), v1::KvReadyRequest::JOIN));
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("--kv-delivery"));
    EXPECT_EQ(call(pulling, describe(receive.reservation(), v1::KvReadyRequest::PUSHED)).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    const Output sent = Generate(prefill->stub(), SendRequest(preq, pulling->address(), receive.reservation()));
    EXPECT_EQ(sent.kv_transfer_error, "");
    ExpectSameOutput(Combine(sent, receive.Finish()), reference, "pulled after a refused JOIN");
    ExpectIdle(pulling->stub(), "pulling decode");
  }

  ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/20000);
  ASSERT_TRUE(receive.reserved());
  const v1::KvReservation r = receive.reservation();
  ASSERT_TRUE(r.has_destination());
  v1::KvReadyRequest k = describe(r, v1::KvReadyRequest::PUSHED);
  grpc::Status st = call(decode, k);  // PUSHED before any JOIN
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  k = describe(r, v1::KvReadyRequest::JOIN);
  k.add_block_checksums(1);
  EXPECT_EQ(call(decode, k).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "JOIN with checksums";
  k = describe(r, v1::KvReadyRequest::PHASE_UNSPECIFIED);
  k.set_sender_error("x");
  EXPECT_EQ(call(decode, k).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "sender_error on a pull";
  k = describe(r, v1::KvReadyRequest::PUSHED);
  k.set_join_timeout_ms(5);
  EXPECT_EQ(call(decode, k).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "join_timeout_ms on PUSHED";
  k = describe(r, v1::KvReadyRequest::PUSHED);
  k.set_pair_offer("x");
  EXPECT_EQ(call(decode, k).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "pair_offer on PUSHED";
  k = describe(r, v1::KvReadyRequest::JOIN);
  k.set_pair_offer(std::string(5000, 'x'));
  EXPECT_EQ(call(decode, k).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "a 5000-byte pair_offer";
  k = describe(r, static_cast<v1::KvReadyRequest::Phase>(7));
  EXPECT_EQ(call(decode, k).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "phase 7";
  k = describe(r, v1::KvReadyRequest::JOIN);
  k.set_prompt_hash(k.prompt_hash() + 1);
  EXPECT_EQ(call(decode, k).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "another prompt";
  EXPECT_EQ(GetLoad(decode->stub()).reserved_requests(), 1) << "still waiting for the right call";

  // The JOIN: pinned for 2.5 s, in the decode worker's own pool and blocks.
  k = describe(r, v1::KvReadyRequest::JOIN);
  k.set_join_timeout_ms(2500);
  v1::KvReadyResponse joined;
  st = call(decode, k, &joined);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_GT(joined.pinned_ms(), 2000u);
  EXPECT_LE(joined.pinned_ms(), 2500u);
  EXPECT_EQ(joined.destination().agent_id(), r.destination().agent_id());
  EXPECT_THAT(joined.destination_block_ids(), ::testing::ElementsAreArray(r.block_ids()));
  EXPECT_EQ(joined.destination_cached_blocks(), 0);
  EXPECT_EQ(call(decode, k).error_code(), grpc::StatusCode::ALREADY_EXISTS) << "a second JOIN";
  v1::KvReadyRequest other = describe(r, v1::KvReadyRequest::PUSHED);
  other.mutable_source()->set_agent_id("another agent");
  EXPECT_EQ(call(decode, other).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "PUSHED from another agent";

  // Cancelled after the JOIN: the blocks stay out of use past the 300 ms
  // quarantine, until the pin ends; then everything is free.
  const auto cancelled = std::chrono::steady_clock::now();
  receive.Cancel();
  receive.Finish();
  std::this_thread::sleep_for(milliseconds(900));
  const v1::LoadReport held = GetLoad(decode->stub());
  if (std::chrono::steady_clock::now() - cancelled < milliseconds(2000)) {
    EXPECT_EQ(held.quarantined_blocks(), 3) << "the pinned blocks were freed before the pin ended";
  }
  EXPECT_EQ(call(decode, describe(r, v1::KvReadyRequest::PUSHED)).error_code(), grpc::StatusCode::NOT_FOUND)
      << "PUSHED after the cancel";
  ExpectIdle(decode->stub(), "decode after the pin");
  ExpectIdle(prefill->stub(), "prefill");
}

// PUSHED with sender_error after a JOIN: the decode worker falls back at
// once, with the first token the sender gave.
TEST_F(DisaggGrpcTest, SenderErrorFallsBackAtOnce) {
  if (KvTransport() == "nccl") GTEST_SKIP() << "the test's own JOIN cannot carry an NCCL pairing offer";
  WorkerProcess* prefill = StartPrefill();
  WorkerProcess* decode = StartDecode({"--kv-delivery", "push"});
  ASSERT_TRUE(prefill && decode);
  const std::vector<int32_t> prompt = MakePrompt(44, 40);
  const v1::GenerateRequest req = GreedyRequest(prompt, 6);
  const Output reference = Aggregated(req);
  ReceiveStream receive(decode->stub(), req, /*timeout_ms=*/30000);
  ASSERT_TRUE(receive.reserved());
  v1::KvReadyRequest k =
      KvReadyFor(receive.reservation(), TransferInfo(*prefill), prompt, reference.tokens[0], v1::KvReadyRequest::JOIN);
  k.set_join_timeout_ms(1000);  // the blocks stay pinned (out of use) until then, fallback or not
  auto call = [&](const v1::KvReadyRequest& r) { return CallKvReady(*decode, r); };
  ASSERT_TRUE(call(k).ok());
  k.set_phase(v1::KvReadyRequest::PUSHED);
  k.clear_join_timeout_ms();
  k.set_sender_error(std::string(2000, 'x'));
  EXPECT_EQ(call(k).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "a 2000-byte sender_error";
  k.set_sender_error("the test could not push");
  const auto sent = std::chrono::steady_clock::now();
  grpc::Status st = call(k);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("the test could not push"));
  Output d = receive.Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - sent, seconds(10)) << "fell back at the deadline, not at once";
  EXPECT_FALSE(d.includes_first_token);
  ExpectSameOutput(Combine(reference, d), reference, "fallback after sender_error");
  v1::LoadReport load = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(load.local_prefill_fallbacks(), 1);
  EXPECT_EQ(load.expired_reservations(), 0);

  // A sender_error before any JOIN (the JOIN's answer lost, or the JOIN
  // still on its way): the reservation falls back now, a late JOIN finds
  // nothing.
  ReceiveStream early(decode->stub(), req, /*timeout_ms=*/30000);
  ASSERT_TRUE(early.reserved());
  k.set_reservation_id(early.reservation().reservation_id());
  k.set_reservation_token(early.reservation().reservation_token());
  st = call(k);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  ExpectSameOutput(Combine(reference, early.Finish()), reference, "sender_error before JOIN");
  k.set_phase(v1::KvReadyRequest::JOIN);
  k.clear_sender_error();
  EXPECT_EQ(call(k).error_code(), grpc::StatusCode::NOT_FOUND) << "a JOIN after the fallback";

  // Joined, then PUSHED without checksums: never committed unverified.
  ReceiveStream unchecked(decode->stub(), req, /*timeout_ms=*/30000);
  ASSERT_TRUE(unchecked.reserved());
  k.set_reservation_id(unchecked.reservation().reservation_id());
  k.set_reservation_token(unchecked.reservation().reservation_token());
  k.set_join_timeout_ms(1000);
  ASSERT_TRUE(call(k).ok());
  k.set_phase(v1::KvReadyRequest::PUSHED);
  k.clear_join_timeout_ms();
  st = call(k);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("checksums"));
  ExpectSameOutput(Combine(reference, unchecked.Finish()), reference, "PUSHED without checksums");
  load = ExpectIdle(decode->stub(), "decode");
  EXPECT_EQ(load.local_prefill_fallbacks(), 3);
  EXPECT_EQ(load.kv_pushes_received(), 0);
}

}  // namespace
}  // namespace tandem
