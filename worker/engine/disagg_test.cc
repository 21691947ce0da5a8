// Disaggregated serving inside one process: a prefill engine and a decode
// engine (both builtin:tiny) joined by the loopback KV transport, checked
// against an aggregated engine. The multi-process version over UCX drives
// the same engine calls through gRPC.
#include <condition_variable>
#include <future>
#include <mutex>

#include "gtest/gtest.h"
#include "kvtransfer/loopback/loopback_transport.h"
#include "worker/engine/engine.h"
#include "worker/model/model_loader.h"

namespace tandem::worker {
namespace {

using std::chrono::milliseconds;

class CollectSink final : public OutputSink {
 public:
  void OnToken(const SampledToken& t) override {
    std::lock_guard<std::mutex> lock(mu_);
    tokens_.push_back(t);
  }
  void OnFinish(const FinishInfo& info) override {
    std::lock_guard<std::mutex> lock(mu_);
    info_ = info;
    done_ = true;
    cv_.notify_all();
  }
  bool Wait(milliseconds timeout = milliseconds(20000)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return done_; });
  }
  std::vector<SampledToken> tokens() {
    std::lock_guard<std::mutex> lock(mu_);
    return tokens_;
  }
  FinishInfo info() {
    std::lock_guard<std::mutex> lock(mu_);
    return info_;
  }
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<SampledToken> tokens_;
  FinishInfo info_;
  bool done_ = false;
};

std::unique_ptr<Engine> StartEngine(int64_t kv_bytes = 16 << 20) {
  absl::StatusOr<LoadedModel> model = LoadModel("builtin:tiny");
  EXPECT_TRUE(model.ok()) << model.status();
  EngineConfig config;
  config.kv_cache_bytes = kv_bytes;
  config.threads = 1;
  config.log_stats_interval_s = 0;
  config.transfer_quarantine_s = 0.05;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(config, std::move(*model));
  EXPECT_TRUE(engine.ok()) << engine.status();
  (*engine)->Start();
  return std::move(*engine);
}

GenerateSpec Spec(std::vector<int32_t> prompt, int max_tokens, std::optional<uint64_t> seed) {
  GenerateSpec spec{.request_id = "t", .prompt = std::move(prompt), .params = {}};
  spec.params.max_tokens = max_tokens;
  spec.params.ignore_eos = true;
  spec.params.logprobs = 2;
  if (seed) {
    spec.params.temperature = 0.8f;
    spec.params.seed = *seed;
  } else {
    spec.params.temperature = 0.0f;
  }
  return spec;
}

std::vector<int32_t> Prompt(int len, int salt) {
  std::vector<int32_t> p(len);
  for (int i = 0; i < len; ++i) p[i] = (i * 31 + salt * 7) % 256;
  return p;
}

void ExpectSame(const std::vector<SampledToken>& got, const std::vector<SampledToken>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].token_id, want[i].token_id) << "token " << i;
    EXPECT_NEAR(got[i].logprob, want[i].logprob, 1e-5) << "token " << i;
  }
}

class DisaggTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefill_ = StartEngine();
    decode_ = StartEngine();
    aggregated_ = StartEngine();
    auto fabric = std::make_shared<kvtransfer::LoopbackFabric>();
    p_transport_ = std::make_unique<kvtransfer::LoopbackTransport>(fabric);
    d_transport_ = std::make_unique<kvtransfer::LoopbackTransport>(fabric);
    ASSERT_TRUE(p_transport_->RegisterPool(prefill_->pool_layout(), prefill_->kv_data()).ok());
    ASSERT_TRUE(d_transport_->RegisterPool(decode_->pool_layout(), decode_->kv_data()).ok());
    ASSERT_TRUE(p_transport_->AddPeer(*d_transport_->LocalInfo()).ok());
    decode_agent_ = d_transport_->LocalInfo()->agent_id;
  }

  struct Result {
    std::vector<SampledToken> tokens;  // first (from prefill) + decode's
    FinishInfo decode_finish;
    int blocks_sent = 0;
    int cached_on_decode = 0;
  };

  // The lifecycle: reserve on decode -> prefill -> push the blocks decode
  // lacks -> commit on decode -> decode streams.
  Result RunDisaggregated(const GenerateSpec& spec) {
    Result r;
    auto decode_sink = std::make_shared<CollectSink>();
    std::promise<absl::StatusOr<Reservation>> reserved;
    decode_->Reserve(spec, decode_sink, std::chrono::steady_clock::now() + std::chrono::seconds(30),
                     [&](absl::StatusOr<Reservation> res) { reserved.set_value(std::move(res)); });
    absl::StatusOr<Reservation> res = reserved.get_future().get();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) return r;
    r.cached_on_decode = res->cached_tokens;

    std::promise<absl::Status> committed;
    GenerateSpec p = spec;
    const int bs = decode_->config().block_size;
    p.on_prefilled = [&, res = *res](const Prefilled& done) {
      std::vector<kvtransfer::BlockPair> pairs;
      for (size_t i = res.cached_tokens / bs; i < done.blocks.size(); ++i) {
        pairs.push_back({done.blocks[i], res.blocks[i]});
      }
      r.blocks_sent = static_cast<int>(pairs.size());
      r.tokens.push_back(done.first);
      // The prompt's KV writes come with a fence, completed by the time the
      // engine calls back (the CPU runner's step is synchronous).
      EXPECT_TRUE(done.written != nullptr && done.written->Wait(std::chrono::steady_clock::now()).ok());
      const uint64_t id = done.id;
      const SampledToken first = done.first;
      absl::StatusOr<uint64_t> t = p_transport_->PushAfter(
          decode_agent_, std::move(pairs), done.written, res.id,
          std::chrono::steady_clock::now() + std::chrono::seconds(10), [&, id, first, rid = res.id](absl::Status st) {
            prefill_->ReleasePrefilled(id);
            if (!st.ok()) {
              committed.set_value(st);
              return;
            }
            decode_->Commit(rid, first, [&](absl::Status c) { committed.set_value(c); });
          });
      if (!t.ok()) committed.set_value(t.status());
    };
    auto prefill_sink = std::make_shared<CollectSink>();
    EXPECT_TRUE(prefill_->Submit(std::move(p), prefill_sink).ok());
    EXPECT_TRUE(prefill_sink->Wait());
    EXPECT_EQ(prefill_sink->tokens().size(), 1u);
    absl::Status c = committed.get_future().get();
    EXPECT_TRUE(c.ok()) << c;
    EXPECT_TRUE(decode_sink->Wait());
    for (const SampledToken& t : decode_sink->tokens()) r.tokens.push_back(t);
    r.decode_finish = decode_sink->info();
    return r;
  }

  std::vector<SampledToken> RunAggregated(const GenerateSpec& spec) {
    auto sink = std::make_shared<CollectSink>();
    EXPECT_TRUE(aggregated_->Submit(spec, sink).ok());
    EXPECT_TRUE(sink->Wait());
    return sink->tokens();
  }

  void ExpectIdle(Engine& e) {
    for (int i = 0; i < 500; ++i) {
      LoadSnapshot l = e.GetLoad();
      if (l.used_blocks == 0 && l.running == 0 && l.waiting == 0 && l.reserved == 0 && l.prefilled == 0) {
        return;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    LoadSnapshot l = e.GetLoad();
    ADD_FAILURE() << "not idle: used " << l.used_blocks << " running " << l.running << " reserved " << l.reserved
                  << " prefilled " << l.prefilled;
  }

  std::unique_ptr<Engine> prefill_, decode_, aggregated_;
  std::unique_ptr<kvtransfer::LoopbackTransport> p_transport_, d_transport_;
  std::string decode_agent_;
};

TEST_F(DisaggTest, SplitAcrossTwoEnginesMatchesAggregated) {
  for (int i = 0; i < 4; ++i) {
    GenerateSpec spec = Spec(Prompt(37 + 20 * i, i), 24, i % 2 ? std::optional<uint64_t>(5 + i) : std::nullopt);
    Result r = RunDisaggregated(spec);
    ExpectSame(r.tokens, RunAggregated(spec));
    EXPECT_EQ(r.decode_finish.reason, FinishReason::kLength);
    EXPECT_EQ(r.decode_finish.completion_tokens, 24);
  }
  ExpectIdle(*prefill_);
  ExpectIdle(*decode_);
}

TEST_F(DisaggTest, DecodePrefixHitsAreNotSentAgainAndItsEventsCoverReceivedBlocks) {
  GenerateSpec first = Spec(Prompt(100, 1), 8, std::nullopt);
  Result a = RunDisaggregated(first);
  EXPECT_EQ(a.cached_on_decode, 0);
  EXPECT_EQ(a.blocks_sent, 7);  // ceil(100 / 16)
  // The decode worker's KV events now list the received prompt blocks.
  EXPECT_GE(decode_->GetLoad().kv_event_seq, 6u);
  // Same 96-token prefix: decode already holds 6 blocks, only the tail moves.
  std::vector<int32_t> longer = Prompt(100, 1);
  longer.resize(96);
  for (int i = 0; i < 30; ++i) longer.push_back(200 + i);
  GenerateSpec second = Spec(longer, 8, std::nullopt);
  Result b = RunDisaggregated(second);
  EXPECT_EQ(b.cached_on_decode, 96);
  EXPECT_EQ(b.blocks_sent, 2);  // blocks 6 and 7 of ceil(126 / 16) = 8
  ExpectSame(b.tokens, RunAggregated(second));
  ExpectIdle(*prefill_);
  ExpectIdle(*decode_);
}

TEST_F(DisaggTest, ExpiredReservationFallsBackToALocalPrefill) {
  GenerateSpec spec = Spec(Prompt(50, 3), 8, std::nullopt);
  auto sink = std::make_shared<CollectSink>();
  std::promise<absl::StatusOr<Reservation>> reserved;
  decode_->Reserve(spec, sink, std::chrono::steady_clock::now() + milliseconds(50),
                   [&](absl::StatusOr<Reservation> r) { reserved.set_value(std::move(r)); });
  absl::StatusOr<Reservation> res = reserved.get_future().get();
  ASSERT_TRUE(res.ok());
  EXPECT_EQ(res->blocks.size(), 4u);
  ASSERT_TRUE(sink->Wait(milliseconds(10000)));
  // No prefill came: the decode worker computed the prompt itself, and the
  // whole output (first token included) is what an aggregated run gives.
  EXPECT_EQ(sink->info().reason, FinishReason::kLength);
  ExpectSame(sink->tokens(), RunAggregated(spec));
  ExpectIdle(*decode_);
  EXPECT_EQ(decode_->GetLoad().expired_reservations, 1);
  EXPECT_EQ(decode_->GetLoad().local_prefill_fallbacks, 1);
  // A late commit is refused.
  std::promise<absl::Status> late;
  decode_->Commit(res->id, SampledToken{.token_id = 1}, [&](absl::Status s) { late.set_value(s); });
  EXPECT_EQ(late.get_future().get().code(), absl::StatusCode::kNotFound);
}

TEST_F(DisaggTest, ReportedPrefillFailureFallsBackOrFailsAsConfigured) {
  // Fallback on (the default): Fallback() prefills locally, same output.
  GenerateSpec spec = Spec(Prompt(33, 8), 6, 42);
  auto sink = std::make_shared<CollectSink>();
  std::promise<absl::StatusOr<Reservation>> reserved;
  decode_->Reserve(spec, sink, std::chrono::steady_clock::now() + std::chrono::seconds(30),
                   [&](absl::StatusOr<Reservation> r) { reserved.set_value(std::move(r)); });
  absl::StatusOr<Reservation> res = reserved.get_future().get();
  ASSERT_TRUE(res.ok());
  decode_->Fallback(res->id, std::nullopt, "test: prefill failed");
  ASSERT_TRUE(sink->Wait());
  const std::vector<SampledToken> aggregated = RunAggregated(spec);
  ExpectSame(sink->tokens(), aggregated);
  EXPECT_EQ(decode_->GetLoad().local_prefill_fallbacks, 1);

  // The prefill worker's first token is known (its transfer failed after
  // it): the local prefill keeps it and the sink gets only what follows.
  auto known = std::make_shared<CollectSink>();
  std::promise<absl::StatusOr<Reservation>> known_reserved;
  decode_->Reserve(spec, known, std::chrono::steady_clock::now() + std::chrono::seconds(30),
                   [&](absl::StatusOr<Reservation> r) { known_reserved.set_value(std::move(r)); });
  absl::StatusOr<Reservation> known_res = known_reserved.get_future().get();
  ASSERT_TRUE(known_res.ok());
  decode_->Fallback(known_res->id, aggregated[0], "test: transfer failed");
  ASSERT_TRUE(known->Wait());
  ExpectSame(known->tokens(), std::vector<SampledToken>(aggregated.begin() + 1, aggregated.end()));
  EXPECT_EQ(known->info().completion_tokens, 6);
  EXPECT_EQ(decode_->GetLoad().local_prefill_fallbacks, 2);

  // Fallback off: the request ends with an error and frees its blocks.
  absl::StatusOr<LoadedModel> model = LoadModel("builtin:tiny");
  ASSERT_TRUE(model.ok());
  EngineConfig strict_config;
  strict_config.kv_cache_bytes = 16 << 20;
  strict_config.log_stats_interval_s = 0;
  strict_config.local_prefill_fallback = false;
  strict_config.transfer_quarantine_s = 0.5;
  absl::StatusOr<std::unique_ptr<Engine>> strict = Engine::Create(strict_config, std::move(*model));
  ASSERT_TRUE(strict.ok());
  (*strict)->Start();
  auto strict_sink = std::make_shared<CollectSink>();
  std::promise<absl::StatusOr<Reservation>> strict_reserved;
  (*strict)->Reserve(spec, strict_sink, std::chrono::steady_clock::now() + std::chrono::seconds(30),
                     [&](absl::StatusOr<Reservation> r) { strict_reserved.set_value(std::move(r)); });
  absl::StatusOr<Reservation> strict_res = strict_reserved.get_future().get();
  ASSERT_TRUE(strict_res.ok());
  (*strict)->Fallback(strict_res->id, std::nullopt, "test: prefill failed");
  ASSERT_TRUE(strict_sink->Wait());
  EXPECT_EQ(strict_sink->info().reason, FinishReason::kError);
  EXPECT_TRUE(strict_sink->tokens().empty());
  // The blocks a transfer was writing stay out of use for the quarantine
  // (a late byte must not land in a block already given to someone else),
  // then return to the pool.
  for (int i = 0; i < 100 && (*strict)->GetLoad().quarantined_blocks == 0; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ((*strict)->GetLoad().quarantined_blocks, 3);  // ceil(33 / 16), none cached
  ExpectIdle(**strict);
  EXPECT_EQ((*strict)->GetLoad().quarantined_blocks, 0);
}

TEST_F(DisaggTest, PinnedReservationStaysQuarantinedPastACancel) {
  // decode_'s quarantine is 50 ms; a pin of 400 ms keeps a cancelled
  // reservation's blocks out of use that long (a sender may still be
  // writing into them), then they return to the pool.
  GenerateSpec spec = Spec(Prompt(33, 9), 4, std::nullopt);
  auto sink = std::make_shared<CollectSink>();
  std::promise<absl::StatusOr<Reservation>> reserved;
  decode_->Reserve(spec, sink, std::chrono::steady_clock::now() + std::chrono::seconds(30),
                   [&](absl::StatusOr<Reservation> r) { reserved.set_value(std::move(r)); });
  absl::StatusOr<Reservation> res = reserved.get_future().get();
  ASSERT_TRUE(res.ok()) << res.status();

  std::promise<absl::Status> pinned;
  const auto pinned_at = std::chrono::steady_clock::now();
  decode_->PinReservation(res->id, pinned_at + milliseconds(400), [&](absl::Status st) { pinned.set_value(st); });
  ASSERT_TRUE(pinned.get_future().get().ok());
  decode_->Cancel(res->id);
  ASSERT_TRUE(sink->Wait());
  EXPECT_EQ(sink->info().reason, FinishReason::kAbort);
  for (int i = 0; i < 100 && decode_->GetLoad().quarantined_blocks == 0; ++i)
    std::this_thread::sleep_for(milliseconds(5));
  std::this_thread::sleep_for(milliseconds(150));  // three quarantines
  if (std::chrono::steady_clock::now() < pinned_at + milliseconds(350)) {
    EXPECT_EQ(decode_->GetLoad().quarantined_blocks, 3);  // ceil(33 / 16), none cached
  }
  ExpectIdle(*decode_);
  for (int i = 0; i < 100 && decode_->GetLoad().quarantined_blocks != 0; ++i)
    std::this_thread::sleep_for(milliseconds(10));
  EXPECT_EQ(decode_->GetLoad().quarantined_blocks, 0);
  EXPECT_GE(std::chrono::steady_clock::now() - pinned_at, milliseconds(400));

  // Pinning what is not a waiting reservation: NotFound.
  std::promise<absl::Status> unknown;
  decode_->PinReservation(res->id, std::chrono::steady_clock::now() + milliseconds(100),
                          [&](absl::Status st) { unknown.set_value(st); });
  EXPECT_EQ(unknown.get_future().get().code(), absl::StatusCode::kNotFound);
}

TEST_F(DisaggTest, CancelledReservationAndUnreleasedHandOffFreeEverything) {
  auto sink = std::make_shared<CollectSink>();
  std::promise<absl::StatusOr<Reservation>> reserved;
  decode_->Reserve(Spec(Prompt(40, 4), 8, std::nullopt), sink,
                   std::chrono::steady_clock::now() + std::chrono::seconds(30),
                   [&](absl::StatusOr<Reservation> r) { reserved.set_value(std::move(r)); });
  absl::StatusOr<Reservation> res = reserved.get_future().get();
  ASSERT_TRUE(res.ok());
  // The load report counts the reservation at once and shows its blocks
  // once the step that parked it is published.
  for (int i = 0; i < 500 && decode_->GetLoad().used_blocks != 3; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(decode_->GetLoad().reserved, 1);
  EXPECT_EQ(decode_->GetLoad().used_blocks, 3);  // ceil(40 / 16)
  decode_->Cancel(res->id);
  ASSERT_TRUE(sink->Wait());
  EXPECT_EQ(sink->info().reason, FinishReason::kAbort);
  ExpectIdle(*decode_);

  // A prefill whose transfer never reports back: its blocks are freed at the
  // hold deadline.
  GenerateSpec p = Spec(Prompt(40, 5), 8, std::nullopt);
  p.hold_timeout = milliseconds(100);
  p.on_prefilled = [](const Prefilled&) {};
  auto psink = std::make_shared<CollectSink>();
  ASSERT_TRUE(prefill_->Submit(std::move(p), psink).ok());
  ASSERT_TRUE(psink->Wait());
  EXPECT_EQ(psink->tokens().size(), 1u);
  // The hand-off parks after the sink's finish: wait for it to expire.
  for (int i = 0; i < 500 && prefill_->GetLoad().expired_handoffs == 0; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(prefill_->GetLoad().expired_handoffs, 1);
  ExpectIdle(*prefill_);
}

// A report read after a request was answered counts that request (or what it
// left): the engine republishes only at the end of the step that answered,
// so Submit and Reserve count themselves into the report at once. Otherwise
// a client that polls for "idle" after a response can read the report from
// before its request and see an idle worker without the request's blocks.
class LoadProbeSink final : public OutputSink {
 public:
  explicit LoadProbeSink(Engine* engine) : engine_(engine) {}
  void OnToken(const SampledToken&) override {}
  void OnFinish(const FinishInfo&) override {
    seen_ = engine_->GetLoad();  // on the engine thread, before its republish
    done_.set_value();
  }
  LoadSnapshot Wait() {
    done_.get_future().wait();
    return seen_;
  }

 private:
  Engine* engine_;
  LoadSnapshot seen_;
  std::promise<void> done_;
};

TEST_F(DisaggTest, TheLoadReportNeverPrecedesAnAnsweredRequest) {
  for (int i = 0; i < 10; ++i) {
    auto sink = std::make_shared<LoadProbeSink>(aggregated_.get());
    ASSERT_TRUE(aggregated_->Submit(Spec(Prompt(20, 40 + i), 1, std::nullopt), sink).ok());
    const LoadSnapshot seen = sink->Wait();
    EXPECT_GE(seen.running + seen.waiting, 1) << "request " << i;
    EXPECT_GT(seen.tokens_in_flight, 0) << "request " << i;
  }
  ExpectIdle(*aggregated_);
  // Idle, the report matches the cache's own event stream.
  const LoadSnapshot idle = aggregated_->GetLoad();
  EXPECT_EQ(idle.cached_blocks, 10);  // one full 16-token block per prompt
  EXPECT_EQ(idle.kv_event_seq, 10u);

  std::promise<LoadSnapshot> at_reply;
  decode_->Reserve(Spec(Prompt(40, 60), 2, std::nullopt), std::make_shared<CollectSink>(),
                   std::chrono::steady_clock::now() + std::chrono::seconds(30), [&](absl::StatusOr<Reservation> r) {
                     EXPECT_TRUE(r.ok()) << r.status();
                     at_reply.set_value(decode_->GetLoad());
                   });
  EXPECT_EQ(at_reply.get_future().get().reserved, 1);
  EXPECT_EQ(decode_->GetLoad().reserved, 1);
}

TEST_F(DisaggTest, ReservationLargerThanTheFreeCacheIsRefused) {
  std::unique_ptr<Engine> small =
      StartEngine(/*kv_bytes=*/12288 * 4);  // 4 blocks of 16 tokens (3 layers x K,V x 2 heads x 16 x 16 floats)
  auto sink = std::make_shared<CollectSink>();
  std::promise<absl::StatusOr<Reservation>> first;
  small->Reserve(Spec(Prompt(60, 6), 2, std::nullopt), sink,
                 std::chrono::steady_clock::now() + std::chrono::seconds(30),
                 [&](absl::StatusOr<Reservation> r) { first.set_value(std::move(r)); });
  absl::StatusOr<Reservation> got = first.get_future().get();
  ASSERT_TRUE(got.ok()) << got.status();  // 4 blocks: the whole cache
  std::promise<absl::StatusOr<Reservation>> second;
  small->Reserve(Spec(Prompt(20, 7), 2, std::nullopt), std::make_shared<CollectSink>(),
                 std::chrono::steady_clock::now() + std::chrono::seconds(30),
                 [&](absl::StatusOr<Reservation> r) { second.set_value(std::move(r)); });
  EXPECT_EQ(second.get_future().get().status().code(), absl::StatusCode::kResourceExhausted);
  small->Stop();
  ASSERT_TRUE(sink->Wait());
  EXPECT_EQ(sink->info().reason, FinishReason::kAbort);
  EXPECT_TRUE(sink->info().worker_stopping);
}

}  // namespace
}  // namespace tandem::worker
