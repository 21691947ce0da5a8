// Cross-process tests of `tandem worker`: each test starts real worker
// processes (tests/testing/worker_process.h) and drives them through the
// gRPC API of proto/tandem/v1/worker.proto only. The model is builtin:tiny
// (vocabulary 384: bytes 0-255 plus specials, EOS ids 257 and 260, context
// 2048, 3 layers, 2 KV heads of dimension 16), which generates about two
// thousand tokens a second on one CPU thread, so every test is short.
//
// Behaviour is checked through responses, status codes, GetLoad and the KV
// event stream, never through the worker's log.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <latch>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
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
using ::testing::AllOf;
using ::testing::HasSubstr;

// Each test owns the workers it starts; they must exit cleanly at the end.
using WorkerGrpcTest = WorkerTest;

// ---------------------------------------------------------------------------
// 1. Health and model info.

TEST_F(WorkerGrpcTest, HealthAndModelInfo) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
  v1::HealthResponse health;
  ASSERT_TRUE(w->stub().Health(&ctx, v1::HealthRequest(), &health).ok());
  EXPECT_EQ(health.status(), v1::HealthResponse::SERVING);
  EXPECT_EQ(health.role(), "both");
  EXPECT_FALSE(health.instance_id().empty());

  v1::ModelInfo info = GetModelInfo(w->stub());
  EXPECT_EQ(info.vocab_size(), kVocabSize);
  EXPECT_EQ(info.block_size(), kBlockSize);
  EXPECT_THAT(info.eos_token_ids(), ::testing::UnorderedElementsAre(257, 260));
  EXPECT_EQ(info.max_context_length(), kContext);
  EXPECT_EQ(info.num_layers(), 3);
  EXPECT_EQ(info.num_kv_heads(), 2);
  EXPECT_EQ(info.head_dim(), 16);
  EXPECT_EQ(info.total_blocks(), (int64_t{256} << 20) / AggregatedBytesPerBlock());
  EXPECT_EQ(info.role(), "both");
  EXPECT_EQ(info.instance_id(), health.instance_id());
  EXPECT_EQ(info.kv_dtype(), WorkersOnGpu() ? "bfloat16" : "float32");
  EXPECT_EQ(info.max_batched_tokens(), 2048);  // the engine's default step budget

  // The block geometry and the step budget follow the flags.
  // (The GPU runner takes 16, 32 or 64 tokens a block.)
  const int other_block = WorkersOnGpu() ? 32 : 8;
  WorkerProcess* w8 = StartWorker(
      {"--block-size", absl::StrCat(other_block), "--kv-cache-memory", "1MiB", "--max-batched-tokens", "256"});
  ASSERT_NE(w8, nullptr);
  v1::ModelInfo info8 = GetModelInfo(w8->stub());
  EXPECT_EQ(info8.block_size(), other_block);
  EXPECT_EQ(info8.max_batched_tokens(), 256);
  EXPECT_EQ(info8.total_blocks(), (int64_t{1} << 20) / (AggregatedBytesPerBlock() * other_block / kBlockSize));
  EXPECT_NE(info8.instance_id(), info.instance_id());
}

// ---------------------------------------------------------------------------
// 2. Greedy generation, streamed.

TEST_F(WorkerGrpcTest, GreedyGenerationStreamsMaxTokens) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  const std::vector<int32_t> prompt = MakePrompt(1, 12);
  v1::GenerateRequest req = GreedyRequest(prompt, 32);
  req.mutable_sampling()->set_ignore_eos(true);

  Output out = Generate(w->stub(), req);
  ExpectWellFormed(out, "greedy");
  EXPECT_EQ(out.tokens.size(), 32u);
  EXPECT_EQ(out.finish, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(out.usage.prompt_tokens(), 12);
  EXPECT_EQ(out.usage.completion_tokens(), 32);
  EXPECT_EQ(out.usage.cached_prompt_tokens(), 0);
  EXPECT_GE(out.messages, 1);
  // Greedy: the sampled token is the most likely alternative.
  ASSERT_EQ(out.top.size(), out.tokens.size());
  for (size_t i = 0; i < out.tokens.size(); ++i) {
    ASSERT_EQ(out.top[i].size(), 3u) << "token " << i;
    EXPECT_EQ(out.top[i][0].first, out.tokens[i]) << "token " << i;
    EXPECT_FLOAT_EQ(out.top[i][0].second, out.logprobs[i]) << "token " << i;
    EXPECT_LE(out.logprobs[i], 0.0f) << "token " << i;
    EXPECT_GE(out.top[i][0].second, out.top[i][1].second) << "token " << i;
    EXPECT_GE(out.top[i][1].second, out.top[i][2].second) << "token " << i;
  }

  // Without logprobs requested none come back; the tokens are the same.
  v1::GenerateRequest plain = req;
  plain.mutable_sampling()->clear_logprobs();
  Output plain_out = Generate(w->stub(), plain);
  ExpectWellFormed(plain_out, "greedy without logprobs");
  EXPECT_EQ(plain_out.tokens, out.tokens);
  for (size_t i = 0; i < plain_out.top.size(); ++i) EXPECT_TRUE(plain_out.top[i].empty());
}

// ---------------------------------------------------------------------------
// 3. Continuous batching gives each request what it gets alone.

TEST_F(WorkerGrpcTest, ConcurrentStreamsMatchSequentialRuns) {
  WorkerProcess* alone = StartWorker();
  WorkerProcess* batched = StartWorker();
  ASSERT_NE(alone, nullptr);
  ASSERT_NE(batched, nullptr);

  constexpr int kRequests = 12;
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    const std::vector<int32_t> prompt = MakePrompt(100 + i, 5 + 7 * i);
    const int max_tokens = 12 + 2 * i;
    requests.push_back(i % 2 == 0 ? GreedyRequest(prompt, max_tokens) : SampledRequest(prompt, max_tokens, 1000 + i));
    requests.back().set_request_id(absl::StrCat("r", i));
  }

  std::vector<Output> want;
  for (const v1::GenerateRequest& r : requests) want.push_back(Generate(alone->stub(), r));

  std::vector<Output> got = GenerateConcurrently(batched->stub(), requests);

  for (int i = 0; i < kRequests; ++i) {
    ExpectSameOutput(got[i], want[i], absl::StrCat("request ", i));
    EXPECT_EQ(got[i].usage.prompt_tokens(), requests[i].prompt_token_ids_size());
  }
  v1::LoadReport load = ExpectIdle(batched->stub(), "after the burst");
  EXPECT_EQ(load.finished_requests(), kRequests);
}

// ---------------------------------------------------------------------------
// 4. The prefix cache serves full blocks and changes nothing.

TEST_F(WorkerGrpcTest, PrefixCacheHitGivesIdenticalOutput) {
  WorkerProcess* w = StartWorker();
  WorkerProcess* uncached = StartWorker({"--no-prefix-caching"});
  ASSERT_NE(w, nullptr);
  ASSERT_NE(uncached, nullptr);
  v1::GenerateRequest req = GreedyRequest(MakePrompt(4, 100), 16);
  req.mutable_sampling()->set_ignore_eos(true);

  Output first = Generate(w->stub(), req);
  Output second = Generate(w->stub(), req);
  ExpectWellFormed(first, "first");
  EXPECT_EQ(first.usage.cached_prompt_tokens(), 0);
  // 100 prompt tokens: the last one is always computed, so 6 full blocks of
  // the first 99 can come from the cache.
  EXPECT_GE(second.usage.cached_prompt_tokens(), 6 * kBlockSize);
  EXPECT_LT(second.usage.cached_prompt_tokens(), 100);
  ExpectSameOutput(second, first, "cached vs first");

  Output off1 = Generate(uncached->stub(), req);
  Output off2 = Generate(uncached->stub(), req);
  EXPECT_EQ(off1.usage.cached_prompt_tokens(), 0);
  EXPECT_EQ(off2.usage.cached_prompt_tokens(), 0);
  ExpectSameOutput(off1, first, "no prefix caching vs first");
  ExpectSameOutput(off2, first, "no prefix caching, again");

  bool ok = false;
  v1::LoadReport load = WaitForLoad(
      w->stub(), [](const v1::LoadReport& l) { return l.finished_requests() == 2; }, &ok);
  EXPECT_TRUE(ok) << load.ShortDebugString();
  EXPECT_EQ(load.prefix_hit_tokens(), second.usage.cached_prompt_tokens());
  EXPECT_EQ(load.prefix_query_tokens(), 200);
  EXPECT_EQ(GetLoad(uncached->stub()).prefix_hit_tokens(), 0);
  EXPECT_EQ(GetLoad(uncached->stub()).cached_blocks(), 0);
}

// ---------------------------------------------------------------------------
// 5. Chunked prefill gives the same result as one-shot prefill.

TEST_F(WorkerGrpcTest, ChunkedPrefillMatchesOneShotPrefill) {
  WorkerProcess* chunked = StartWorker({"--max-batched-tokens", "7"});
  WorkerProcess* whole = StartWorker();
  ASSERT_NE(chunked, nullptr);
  ASSERT_NE(whole, nullptr);
  const std::vector<int32_t> prompt = MakePrompt(5, 150);
  for (const v1::GenerateRequest& req : {GreedyRequest(prompt, 16), SampledRequest(prompt, 16, 77)}) {
    Output want = Generate(whole->stub(), req);
    Output got = Generate(chunked->stub(), req);
    ExpectSameOutput(got, want, req.sampling().ShortDebugString());
    EXPECT_EQ(got.usage.prompt_tokens(), 150);
  }
  // Two chunked prefills at once share each step's 7-token budget.
  std::vector<int32_t> other = MakePrompt(6, 150);
  Output want_other = Generate(whole->stub(), GreedyRequest(other, 8));
  Output want_first = Generate(whole->stub(), GreedyRequest(prompt, 8));
  Output got_other, got_first;
  std::thread t([&] { got_other = Generate(chunked->stub(), GreedyRequest(other, 8)); });
  got_first = Generate(chunked->stub(), GreedyRequest(prompt, 8));
  t.join();
  ExpectSameOutput(got_other, want_other, "concurrent chunked prefill, other");
  ExpectSameOutput(got_first, want_first, "concurrent chunked prefill, first");
}

// ---------------------------------------------------------------------------
// 6. Cancelling a stream frees its blocks at once.

TEST_F(WorkerGrpcTest, CancelMidStreamFreesEveryBlock) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  constexpr int kPrompt = 20;
  constexpr int kMaxTokens = 1500;
  v1::GenerateRequest req = GreedyRequest(MakePrompt(6, kPrompt), kMaxTokens);
  req.mutable_sampling()->set_ignore_eos(true);

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  auto reader = w->stub().Generate(&ctx, req);
  v1::GenerateResponse msg;
  int received = 0;
  for (int m = 0; m < 3 && reader->Read(&msg); ++m) {
    received += msg.tokens_size();
    ASSERT_EQ(msg.finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
  }
  ASSERT_GT(received, 0);
  ctx.TryCancel();
  while (reader->Read(&msg)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);

  v1::LoadReport load = ExpectIdle(w->stub(), "after cancelling");
  EXPECT_EQ(load.free_blocks() + load.cached_blocks(), load.total_blocks());
  // The sequence stopped early: a run to max_tokens would have left
  // (kPrompt + kMaxTokens - 1) / kBlockSize full blocks in the prefix cache.
  EXPECT_LT(load.cached_blocks(), (kPrompt + kMaxTokens - 1) / kBlockSize)
      << "the request ran to completion instead of being aborted";

  v1::GenerateRequest next = GreedyRequest(MakePrompt(7, 10), 8);
  Output out = Generate(w->stub(), next);
  ExpectWellFormed(out, "after cancel");
  EXPECT_GT(out.tokens.size(), 0u);
  ExpectIdle(w->stub(), "after the next request");
}

// ---------------------------------------------------------------------------
// 7. A client process that dies mid-stream: its request is aborted.

TEST_F(WorkerGrpcTest, KilledClientProcessFreesEveryBlock) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  absl::StatusOr<std::string> bin = tandem::testing::TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  // `tandem generate` samples greedily without ignore_eos; greedy decoding of
  // this prompt meets no EOS within kMaxTokens (checked at the end).
  const std::vector<int32_t> prompt = MakePrompt(9, 20);
  constexpr int kMaxTokens = 1500;

  absl::StatusOr<ChildProcess> client =
      ChildProcess::Spawn({*bin, "generate", "--target", w->address(), "--prompt-ids", absl::StrJoin(prompt, ","),
                           "--max-tokens", absl::StrCat(kMaxTokens)},
                          "/dev/null");
  ASSERT_TRUE(client.ok()) << client.status();
  bool running = false;
  v1::LoadReport load = WaitForLoad(
      w->stub(), [](const v1::LoadReport& l) { return l.running_sequences() == 1 && l.used_blocks() > 0; }, &running,
      seconds(20));
  ASSERT_TRUE(running) << "the client's request never ran: " << load.ShortDebugString();
  client->Signal(SIGKILL);
  absl::StatusOr<int> status = client->Wait(seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL)
      << "the client ended on its own before it was killed";

  load = ExpectIdle(w->stub(), "after the client was killed");
  EXPECT_EQ(load.free_blocks() + load.cached_blocks(), load.total_blocks());
  EXPECT_EQ(load.finished_requests(), 1);
  const int64_t blocks_when_killed = load.cached_blocks();

  // The same request run to its end (here) computes more blocks than the
  // killed one got to, so the kill did stop it early.
  v1::GenerateRequest same = GreedyRequest(prompt, kMaxTokens);
  same.mutable_sampling()->clear_logprobs();
  Output full = Generate(w->stub(), same);
  ExpectWellFormed(full, "the same request, run to its end");
  EXPECT_EQ(full.usage.completion_tokens(), kMaxTokens);
  const int64_t full_blocks = (static_cast<int64_t>(prompt.size()) + full.usage.completion_tokens() - 1) / kBlockSize;
  EXPECT_LT(blocks_when_killed, full_blocks)
      << "the killed client's request ran to completion instead of being aborted";
  ExpectIdle(w->stub(), "after the full run");
}

// ---------------------------------------------------------------------------
// 8. Invalid requests.

TEST_F(WorkerGrpcTest, InvalidRequestsAreRejectedWithAReason) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  const std::vector<int32_t> prompt = MakePrompt(9, 10);
  struct Case {
    std::string name;
    v1::GenerateRequest request;
    std::string names;  // the message names the problem
  };
  std::vector<Case> cases;
  {
    v1::GenerateRequest r = GreedyRequest({}, 4);
    cases.push_back({"empty prompt", r, "prompt_token_ids"});
  }
  {
    v1::GenerateRequest r = GreedyRequest(prompt, 4);
    r.set_prompt_token_ids(3, kVocabSize);
    cases.push_back({"token id = vocab size", r, "prompt_token_ids"});
  }
  {
    v1::GenerateRequest r = GreedyRequest(prompt, 4);
    r.set_prompt_token_ids(0, -1);
    cases.push_back({"negative token id", r, "prompt_token_ids"});
  }
  {
    v1::GenerateRequest r = GreedyRequest(prompt, 4);
    r.mutable_sampling()->set_temperature(-1.0f);
    cases.push_back({"temperature -1", r, "temperature"});
  }
  for (float top_p : {0.0f, 1.5f}) {
    v1::GenerateRequest r = GreedyRequest(prompt, 4);
    r.mutable_sampling()->set_top_p(top_p);
    cases.push_back({absl::StrCat("top_p ", top_p), r, "top_p"});
  }
  {
    v1::GenerateRequest r = GreedyRequest(prompt, 4);
    r.mutable_sampling()->set_logprobs(50);
    cases.push_back({"logprobs 50", r, "logprobs"});
  }
  {
    v1::GenerateRequest r = GreedyRequest(prompt, 5000);
    cases.push_back({"max_tokens past the context", r, "max_tokens"});
  }
  {
    v1::GenerateRequest r = GreedyRequest(prompt, 4);
    r.mutable_sampling()->add_stop_token_ids(kVocabSize + 5);
    cases.push_back({"stop id outside the vocabulary", r, "stop_token_ids"});
  }
  {
    v1::GenerateRequest r = GreedyRequest(MakePrompt(9, kContext), 1);
    cases.push_back({"prompt as long as the context", r, "prompt"});
  }

  for (const Case& c : cases) {
    Output out = Generate(w->stub(), c.request, seconds(10));
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.name << ": " << out.status.error_message();
    EXPECT_THAT(out.status.error_message(), HasSubstr(c.names)) << c.name;
    EXPECT_TRUE(out.tokens.empty()) << c.name;
  }

  // Still serving, and nothing leaked.
  Output out = Generate(w->stub(), GreedyRequest(prompt, 4));
  ExpectWellFormed(out, "valid request after invalid ones");
  v1::LoadReport load = ExpectIdle(w->stub(), "after invalid requests");
  EXPECT_EQ(load.finished_requests(), 1);
}

// ---------------------------------------------------------------------------
// 9. A request that cannot fit in the whole KV cache fails at once.

TEST_F(WorkerGrpcTest, RequestLargerThanTheCacheIsRejected) {
  constexpr int kBlocks = 20;
  WorkerProcess* w = StartWorker({"--kv-cache-memory", CacheBytesFlag(kBlocks)});
  ASSERT_NE(w, nullptr);
  v1::ModelInfo info = GetModelInfo(w->stub());
  EXPECT_EQ(info.total_blocks(), kBlocks);
  EXPECT_EQ(info.max_context_length(), kBlocks * kBlockSize);

  const auto start = std::chrono::steady_clock::now();
  Output too_long = Generate(w->stub(), GreedyRequest(MakePrompt(10, 400), 4), seconds(5));
  EXPECT_EQ(too_long.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << too_long.status.error_message();
  EXPECT_THAT(too_long.status.error_message(), HasSubstr("cache"));

  // The prompt fits but prompt + max_tokens does not.
  Output too_many = Generate(w->stub(), GreedyRequest(MakePrompt(10, 300), 100), seconds(5));
  EXPECT_EQ(too_many.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << too_many.status.error_message();
  EXPECT_THAT(too_many.status.error_message(), HasSubstr("max_tokens"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(5));

  // A request that uses the whole cache still runs.
  v1::GenerateRequest full = GreedyRequest(MakePrompt(10, 300), 20);
  full.mutable_sampling()->set_ignore_eos(true);
  Output out = Generate(w->stub(), full);
  ExpectWellFormed(out, "a request of exactly the cache's size");
  EXPECT_EQ(out.tokens.size(), 20u);
  ExpectIdle(w->stub(), "after the cache-sized request");
}

// ---------------------------------------------------------------------------
// 10. Overload: a full queue answers RESOURCE_EXHAUSTED.

TEST_F(WorkerGrpcTest, OverloadIsRejectedWithResourceExhausted) {
  constexpr int kMaxRunning = 1;
  constexpr int kMaxWaiting = 2;
  WorkerProcess* w =
      StartWorker({"--max-running", absl::StrCat(kMaxRunning), "--max-waiting", absl::StrCat(kMaxWaiting)});
  ASSERT_NE(w, nullptr);

  // Each request takes a few hundred milliseconds, far longer than the burst
  // takes to arrive, so no slot frees up while it does.
  constexpr int kRequests = 10;
  constexpr int kMaxTokens = 600;
  std::vector<Output> outs(kRequests);
  std::latch start(kRequests + 1);
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest req = GreedyRequest(MakePrompt(200 + i, 16), kMaxTokens);
      req.mutable_sampling()->set_ignore_eos(true);
      req.mutable_sampling()->clear_logprobs();
      start.arrive_and_wait();
      outs[i] = Generate(w->stub(), req);
      done.fetch_add(1);
    });
  }
  // Meanwhile the queue never holds more than --max-waiting requests.
  start.arrive_and_wait();
  int max_waiting = 0;
  while (done.load() < kRequests) {
    v1::LoadReport l = GetLoad(w->stub());
    max_waiting = std::max(max_waiting, l.waiting_sequences());
    EXPECT_LE(l.running_sequences(), kMaxRunning);
    std::this_thread::sleep_for(milliseconds(1));
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(max_waiting, kMaxWaiting) << "GetLoad showed more requests waiting than --max-waiting allows";

  int rejected = 0;
  int completed = 0;
  auto last_call = std::chrono::steady_clock::time_point::min();
  auto first_completion = std::chrono::steady_clock::time_point::max();
  for (int i = 0; i < kRequests; ++i) {
    const Output& o = outs[i];
    last_call = std::max(last_call, o.started);
    if (o.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++rejected;
      EXPECT_TRUE(o.tokens.empty());
    } else {
      ExpectWellFormed(o, absl::StrCat("request ", i));
      EXPECT_EQ(o.finish, v1::FINISH_REASON_LENGTH) << "request " << i;
      EXPECT_EQ(o.tokens.size(), size_t{kMaxTokens}) << "request " << i;
      first_completion = std::min(first_completion, o.ended);
      ++completed;
    }
  }
  EXPECT_GE(rejected, 1);
  EXPECT_GE(completed, 1);
  // If every call was made before the first completion came back, no slot
  // freed up during the burst: only one running request plus a full queue
  // can have been accepted.
  if (last_call < first_completion) {
    EXPECT_LE(completed, kMaxRunning + kMaxWaiting)
        << "more requests were accepted than --max-running + --max-waiting allow";
  }
  v1::LoadReport load = ExpectIdle(w->stub(), "after the burst");
  EXPECT_EQ(load.finished_requests(), completed);

  // Once the queue drains it accepts again.
  Output again = Generate(w->stub(), GreedyRequest(MakePrompt(250, 8), 4));
  ExpectWellFormed(again, "after the overload");
}

// ---------------------------------------------------------------------------
// 11. Preemption by recompute gives the same results.

TEST_F(WorkerGrpcTest, PreemptionByRecomputeGivesIdenticalOutputs) {
  // 24 blocks: six sequences of 60 + 80 tokens need 6 * 9 = 54.
  WorkerProcess* small = StartWorker({"--kv-cache-memory", CacheBytesFlag(24)});
  WorkerProcess* large = StartWorker();
  ASSERT_NE(small, nullptr);
  ASSERT_NE(large, nullptr);

  constexpr int kRequests = 6;
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    v1::GenerateRequest req = GreedyRequest(MakePrompt(300 + i, 60), 80);
    req.mutable_sampling()->set_ignore_eos(true);
    requests.push_back(req);
  }
  std::vector<Output> want;
  for (const v1::GenerateRequest& r : requests) want.push_back(Generate(large->stub(), r));

  std::vector<Output> got = GenerateConcurrently(small->stub(), requests);

  for (int i = 0; i < kRequests; ++i) {
    ExpectSameOutput(got[i], want[i], absl::StrCat("request ", i));
    EXPECT_EQ(got[i].tokens.size(), 80u);
    EXPECT_EQ(got[i].finish, v1::FINISH_REASON_LENGTH);
  }
  v1::LoadReport load = ExpectIdle(small->stub(), "after the preempted requests");
  EXPECT_GT(load.preemptions(), 0);
  EXPECT_EQ(load.finished_requests(), kRequests);
  EXPECT_EQ(load.free_blocks() + load.cached_blocks(), load.total_blocks());
  EXPECT_EQ(GetLoad(large->stub()).preemptions(), 0);
}

// ---------------------------------------------------------------------------
// 12. Stop ids, min_tokens and ignore_eos.

TEST_F(WorkerGrpcTest, StopTokensMinTokensAndIgnoreEos) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  const std::vector<int32_t> prompt = MakePrompt(12, 10);
  v1::GenerateRequest base_req = GreedyRequest(prompt, 8);
  base_req.mutable_sampling()->set_ignore_eos(true);
  Output base = Generate(w->stub(), base_req);
  ExpectWellFormed(base, "base");
  ASSERT_EQ(base.tokens.size(), 8u);
  const int32_t stop = base.tokens[2];
  const size_t first_stop =
      std::find(base.tokens.begin(), base.tokens.end(), stop) - base.tokens.begin();  // 2, or earlier if repeated

  // Stops on (and includes) the first occurrence of the stop id.
  v1::GenerateRequest stop_req = base_req;
  stop_req.mutable_sampling()->add_stop_token_ids(stop);
  Output stopped = Generate(w->stub(), stop_req);
  ExpectWellFormed(stopped, "stop id");
  EXPECT_EQ(stopped.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(stopped.stop_token_id, stop);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(base.tokens.begin(), base.tokens.begin() + first_stop + 1));

  // min_tokens masks the stop id: greedy then takes the runner-up there.
  constexpr int kMinTokens = 5;
  v1::GenerateRequest min_req = stop_req;
  min_req.mutable_sampling()->set_min_tokens(kMinTokens);
  Output masked = Generate(w->stub(), min_req);
  ExpectWellFormed(masked, "min_tokens");
  ASSERT_GE(masked.tokens.size(), size_t{kMinTokens});
  for (int i = 0; i < kMinTokens; ++i) EXPECT_NE(masked.tokens[i], stop) << "token " << i;
  EXPECT_EQ(std::vector<int32_t>(masked.tokens.begin(), masked.tokens.begin() + first_stop),
            std::vector<int32_t>(base.tokens.begin(), base.tokens.begin() + first_stop));
  ASSERT_GE(base.top[first_stop].size(), 2u);
  EXPECT_EQ(masked.tokens[first_stop], base.top[first_stop][1].first);
  if (masked.finish == v1::FINISH_REASON_STOP) {
    EXPECT_EQ(masked.tokens.back(), stop);
    EXPECT_EQ(masked.stop_token_id, stop);
  } else {
    EXPECT_EQ(masked.finish, v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(masked.tokens.size(), 8u);
  }

  // EOS: find a seed whose sample reaches an EOS id (deterministic: the model
  // and the sampler are seeded), then check ignore_eos and min_tokens on it.
  const std::set<int32_t> eos = {257, 260};
  constexpr int kLen = 64;
  Output eos_run;
  v1::GenerateRequest eos_req;
  for (uint64_t seed = 1; seed <= 32; ++seed) {
    v1::GenerateRequest r = GreedyRequest(prompt, kLen);
    r.mutable_sampling()->set_temperature(1.0f);
    r.mutable_sampling()->set_seed(seed);
    Output o = Generate(w->stub(), r);
    ExpectWellFormed(o, absl::StrCat("seed ", seed));
    if (o.finish == v1::FINISH_REASON_STOP) {
      eos_run = o;
      eos_req = r;
      break;
    }
  }
  ASSERT_EQ(eos_run.finish, v1::FINISH_REASON_STOP) << "no seed in 1..32 sampled an EOS id";
  ASSERT_FALSE(eos_run.tokens.empty());
  EXPECT_TRUE(eos.contains(eos_run.tokens.back()));
  EXPECT_EQ(eos_run.stop_token_id, eos_run.tokens.back());
  for (size_t i = 0; i + 1 < eos_run.tokens.size(); ++i) {
    EXPECT_FALSE(eos.contains(eos_run.tokens[i])) << "an EOS id that did not stop, at " << i;
  }

  v1::GenerateRequest ignore_req = eos_req;
  ignore_req.mutable_sampling()->set_ignore_eos(true);
  Output ignored = Generate(w->stub(), ignore_req);
  ExpectWellFormed(ignored, "ignore_eos");
  EXPECT_EQ(ignored.finish, v1::FINISH_REASON_LENGTH);
  ASSERT_EQ(ignored.tokens.size(), size_t{kLen});
  // Same samples up to and including the EOS, then it goes on.
  EXPECT_EQ(std::vector<int32_t>(ignored.tokens.begin(), ignored.tokens.begin() + eos_run.tokens.size()),
            eos_run.tokens);

  // (Masking changes the distribution every step, so the samples before the
  // EOS may differ too: the sampler draws by inverse CDF.)
  const int eos_at = static_cast<int>(eos_run.tokens.size()) - 1;
  v1::GenerateRequest min_eos_req = eos_req;
  min_eos_req.mutable_sampling()->set_min_tokens(eos_at + 2);
  Output min_eos = Generate(w->stub(), min_eos_req);
  ExpectWellFormed(min_eos, "min_tokens past the EOS");
  ASSERT_GE(min_eos.tokens.size(), size_t(eos_at + 2));
  for (int i = 0; i < eos_at + 2; ++i) {
    EXPECT_FALSE(eos.contains(min_eos.tokens[i])) << "EOS id not masked at " << i;
  }
}

// ---------------------------------------------------------------------------
// 12b. A generation resumed elsewhere (the router's mid-stream failover):
// the prompt plus the first k tokens, with resume_output_tokens = k, gives
// exactly the rest of the one-go run: tokens, logprobs within 1e-5, finish
// and usage. Penalties count the resumed tokens as output, min_tokens and
// max_tokens count them, and seeded sampling keeps its positions.

TEST_F(WorkerGrpcTest, ResumedGenerationContinuesExactly) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  const std::vector<int32_t> prompt = MakePrompt(31, 21);
  constexpr int kMax = 24;
  struct Case {
    std::string name;
    v1::GenerateRequest request;
  };
  std::vector<Case> cases;
  {
    v1::GenerateRequest r = GreedyRequest(prompt, kMax);
    r.mutable_sampling()->set_ignore_eos(true);
    cases.push_back({"greedy", r});
  }
  {
    // Penalties apply to output tokens only (repetition to prompt + output).
    v1::GenerateRequest r = GreedyRequest(prompt, kMax);
    r.mutable_sampling()->set_ignore_eos(true);
    r.mutable_sampling()->set_frequency_penalty(2.0f);
    r.mutable_sampling()->set_presence_penalty(1.5f);
    cases.push_back({"greedy with penalties", r});
  }
  {
    v1::GenerateRequest r = SampledRequest(prompt, kMax, 4242);
    r.mutable_sampling()->set_repetition_penalty(1.3f);
    r.mutable_sampling()->set_frequency_penalty(0.5f);
    r.mutable_sampling()->set_min_tokens(kMax);  // EOS masked to the end
    cases.push_back({"seeded with penalties and min_tokens", r});
  }
  for (const Case& c : cases) {
    const Output full = Generate(w->stub(), c.request);
    ExpectWellFormed(full, c.name);
    ASSERT_EQ(full.tokens.size(), size_t{kMax}) << c.name;
    for (int k : {1, 7, 16, kMax - 1}) {
      const std::string what = absl::StrCat(c.name, ", resumed after ", k);
      v1::GenerateRequest resume = c.request;
      for (int i = 0; i < k; ++i) resume.add_prompt_token_ids(full.tokens[i]);
      resume.set_resume_output_tokens(k);
      const Output rest = Generate(w->stub(), resume);
      ExpectWellFormed(rest, what);
      Output want = full;
      want.tokens.erase(want.tokens.begin(), want.tokens.begin() + k);
      want.logprobs.erase(want.logprobs.begin(), want.logprobs.begin() + k);
      want.top.erase(want.top.begin(), want.top.begin() + k);
      want.usage.set_completion_tokens(kMax - k);
      ExpectSameOutput(rest, want, what);
      // Usage: the true prompt, and the tokens this call made.
      EXPECT_EQ(rest.usage.prompt_tokens(), static_cast<int>(prompt.size())) << what;
    }
  }

  // The field matters: the same tokens sent as plain prompt are penalized
  // differently (and max_tokens counts from them).
  {
    const Case& c = cases[1];
    const Output full = Generate(w->stub(), c.request);
    v1::GenerateRequest plain = c.request;
    for (int i = 0; i < 7; ++i) plain.add_prompt_token_ids(full.tokens[i]);
    plain.mutable_sampling()->set_max_tokens(kMax - 7);
    const Output as_prompt = Generate(w->stub(), plain);
    ExpectWellFormed(as_prompt, "resumed tokens as prompt");
    EXPECT_NE(as_prompt.tokens, std::vector<int32_t>(full.tokens.begin() + 7, full.tokens.end()))
        << "penalties did not see the difference between prompt and output";
  }

  // Bad resumptions are refused with a reason.
  {
    v1::GenerateRequest r = GreedyRequest(prompt, kMax);
    r.set_resume_output_tokens(static_cast<int>(prompt.size()));
    const Output out = Generate(w->stub(), r, seconds(10));
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(out.status.error_message(), HasSubstr("resume_output_tokens"));
  }
  {
    v1::GenerateRequest r = GreedyRequest(prompt, 4);
    r.set_resume_output_tokens(4);
    const Output out = Generate(w->stub(), r, seconds(10));
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(out.status.error_message(), HasSubstr("max_tokens"));
  }
  {
    v1::GenerateRequest r = GreedyRequest(prompt, kMax);
    r.set_resume_output_tokens(3);
    r.mutable_kv_transfer()->set_mode(v1::KvTransferParams::RECEIVE);
    const Output out = Generate(w->stub(), r, seconds(10));
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(out.status.error_message(), HasSubstr("resume_output_tokens"));
  }
  ExpectIdle(w->stub(), "after resumed generations");
}

// ---------------------------------------------------------------------------
// 13. The KV event stream mirrors the prefix cache exactly.

// Reads one StreamKvEvents call on a thread of its own.
class KvEventReader {
 public:
  KvEventReader(v1::Worker::Stub& stub, const v1::KvEventsRequest& req) {
    reader_ = stub.StreamKvEvents(&ctx_, req);
    thread_ = std::thread([this] {
      v1::KvEventBatch batch;
      while (reader_->Read(&batch)) {
        std::lock_guard<std::mutex> lock(mu_);
        if (batch.has_snapshot() && batch.snapshot().complete()) {
          last_seq_ = std::max(last_seq_, batch.snapshot().seq());
        }
        for (const v1::KvEvent& e : batch.events()) last_seq_ = std::max(last_seq_, e.seq());
        batches_.push_back(batch);
        cv_.notify_all();
      }
      std::lock_guard<std::mutex> lock(mu_);
      ended_ = true;
      cv_.notify_all();
    });
  }
  ~KvEventReader() {
    ctx_.TryCancel();
    thread_.join();
    reader_->Finish();
  }

  // Waits until the stream has covered `seq` (in a snapshot or an event).
  bool WaitForSeq(uint64_t seq, milliseconds timeout = kIdleTimeout) {
    std::unique_lock<std::mutex> lock(mu_);
    auto covered = [&] { return last_seq_ >= seq && !batches_.empty(); };
    cv_.wait_for(lock, timeout, [&] { return covered() || ended_; });
    return covered();
  }
  std::vector<v1::KvEventBatch> batches() {
    std::lock_guard<std::mutex> lock(mu_);
    return batches_;
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::KvEventBatch>> reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<v1::KvEventBatch> batches_ ABSL_GUARDED_BY(mu_);
  uint64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The cache as a subscriber rebuilds it from a stream.
struct CacheView {
  std::set<uint64_t> blocks;
  uint64_t seq = 0;
  std::vector<v1::KvEvent> events;  // every event after the snapshot / start
  int stored = 0;
  int removed = 0;
  int cleared = 0;
};

void ExpectValidBlock(const v1::BlockStored& b, const std::string& what) {
  EXPECT_EQ(b.token_ids_size(), kBlockSize) << what;
  std::vector<int32_t> tokens(b.token_ids().begin(), b.token_ids().end());
  EXPECT_EQ(b.block_hash(), HashBlock(b.parent_hash(), tokens)) << what;
}

// Applies `batches` (from one stream) to a view, checking the stream's
// invariants: one instance id, a snapshot (possibly over several batches,
// the last marked complete) only first, no events inside an incomplete
// snapshot, seqs without gaps, valid hashes, no block stored twice or
// removed unstored.
CacheView Replay(const std::vector<v1::KvEventBatch>& batches, const std::string& instance_id, bool expect_snapshot,
                 uint64_t start_after_seq) {
  CacheView view;
  view.seq = start_after_seq;
  bool snapshot_open = false;  // a snapshot has started and not completed
  bool snapshot_done = false;
  for (size_t b = 0; b < batches.size(); ++b) {
    const v1::KvEventBatch& batch = batches[b];
    EXPECT_EQ(batch.instance_id(), instance_id);
    if (b == 0) {
      EXPECT_EQ(batch.has_snapshot(), expect_snapshot);
    }
    if (batch.has_snapshot()) {
      EXPECT_TRUE(snapshot_open || b == 0) << "a second snapshot in batch " << b;
      if (!snapshot_open) {
        view.blocks.clear();
        snapshot_open = true;
      } else {
        EXPECT_EQ(batch.snapshot().seq(), view.seq) << "a snapshot's batches differ in seq";
      }
      view.seq = batch.snapshot().seq();
      for (const v1::CachedBlock& s : batch.snapshot().blocks()) {
        EXPECT_TRUE(view.blocks.insert(s.block_hash()).second) << "snapshot repeats a block";
      }
      if (batch.snapshot().complete()) {
        snapshot_open = false;
        snapshot_done = true;
      } else {
        EXPECT_EQ(batch.events_size(), 0) << "events inside an incomplete snapshot";
      }
    } else {
      EXPECT_FALSE(snapshot_open) << "batch " << b << " interrupts a snapshot";
    }
    for (const v1::KvEvent& e : batch.events()) {
      EXPECT_EQ(e.seq(), view.seq + 1) << "a gap or reordering in the event seqs";
      view.seq = e.seq();
      view.events.push_back(e);
      if (e.has_stored()) {
        ++view.stored;
        ExpectValidBlock(e.stored(), absl::StrCat("stored event ", e.seq()));
        EXPECT_TRUE(view.blocks.insert(e.stored().block_hash()).second) << "block stored twice, event " << e.seq();
      } else if (e.has_removed()) {
        ++view.removed;
        EXPECT_EQ(view.blocks.erase(e.removed().block_hash()), 1u) << "removed a block never stored, event " << e.seq();
      } else if (e.has_cleared()) {
        ++view.cleared;
        view.blocks.clear();
      } else {
        ADD_FAILURE() << "event " << e.seq() << " carries nothing";
      }
    }
  }
  EXPECT_EQ(snapshot_done, expect_snapshot) << "the snapshot never completed";
  return view;
}

// A fresh subscription's snapshot (and whatever follows it in the first batch).
CacheView Snapshot(v1::Worker::Stub& stub, const std::string& instance_id, uint64_t seq) {
  v1::KvEventsRequest req;
  req.set_snapshot(true);
  KvEventReader reader(stub, req);
  EXPECT_TRUE(reader.WaitForSeq(seq)) << "no snapshot at seq " << seq;
  return Replay(reader.batches(), instance_id, /*expect_snapshot=*/true, 0);
}

// The hashes of the full blocks that a finished request leaves computed: its
// prompt and every output token but the last (never fed back).
std::set<uint64_t> ExpectedBlocks(uint64_t seed, const std::vector<int32_t>& prompt, const Output& out) {
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), out.tokens.begin(), out.tokens.end());
  if (!all.empty()) all.pop_back();
  std::vector<uint64_t> hashes = HashBlocks(seed, all, kBlockSize);
  return std::set<uint64_t>(hashes.begin(), hashes.end());
}

TEST_F(WorkerGrpcTest, KvEventsMirrorThePrefixCache) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  const v1::ModelInfo info = GetModelInfo(w->stub());
  const std::string& instance = info.instance_id();
  const uint64_t seed = info.block_hash_seed();

  v1::KvEventsRequest live_req;
  live_req.set_snapshot(true);
  KvEventReader live(w->stub(), live_req);
  ASSERT_TRUE(live.WaitForSeq(0)) << "no snapshot on the live stream";

  // Requests sharing prefixes: b and c extend a's first 48 tokens.
  const std::vector<int32_t> a = MakePrompt(13, 50);
  const std::vector<int32_t> b = Concat(std::vector<int32_t>(a.begin(), a.begin() + 48), MakePrompt(14, 30));
  const std::vector<int32_t> c = Concat(std::vector<int32_t>(a.begin(), a.begin() + 48), MakePrompt(15, 21));
  const std::vector<int32_t> d = MakePrompt(16, 37);
  std::set<uint64_t> expected;
  for (const std::vector<int32_t>* p : {&a, &b, &c, &d, &a}) {
    v1::GenerateRequest req = GreedyRequest(*p, 20);
    req.mutable_sampling()->set_ignore_eos(true);
    Output out = Generate(w->stub(), req);
    ExpectWellFormed(out, "request");
    std::set<uint64_t> blocks = ExpectedBlocks(seed, *p, out);
    expected.insert(blocks.begin(), blocks.end());
  }
  v1::LoadReport load = ExpectIdle(w->stub(), "after the requests");
  const uint64_t seq = load.kv_event_seq();
  ASSERT_GT(seq, 0u);
  ASSERT_TRUE(live.WaitForSeq(seq)) << "the live stream did not reach seq " << seq;

  CacheView view = Replay(live.batches(), instance, /*expect_snapshot=*/true, 0);
  EXPECT_EQ(view.seq, seq);
  EXPECT_EQ(view.removed, 0);  // a big cache evicts nothing
  EXPECT_EQ(view.blocks, expected) << "the events do not describe the computed blocks";
  EXPECT_EQ(static_cast<int64_t>(view.blocks.size()), load.cached_blocks());
  // Every stored block's parent is the seed or a block stored before it.
  std::set<uint64_t> seen = {seed};
  for (const v1::KvEvent& e : view.events) {
    if (!e.has_stored()) continue;
    EXPECT_TRUE(seen.contains(e.stored().parent_hash())) << "orphan block, event " << e.seq();
    seen.insert(e.stored().block_hash());
  }

  CacheView fresh = Snapshot(w->stub(), instance, seq);
  EXPECT_EQ(fresh.seq, seq);
  EXPECT_EQ(fresh.blocks, view.blocks) << "a fresh snapshot differs from the replayed events";

  // ClearKvCache: one CacheCleared event, then an empty cache.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
    v1::ClearKvCacheResponse resp;
    ASSERT_TRUE(w->stub().ClearKvCache(&ctx, v1::ClearKvCacheRequest(), &resp).ok());
    EXPECT_EQ(resp.blocks_cleared(), static_cast<int64_t>(view.blocks.size()));
  }
  ASSERT_TRUE(live.WaitForSeq(seq + 1)) << "no CacheCleared event";
  view = Replay(live.batches(), instance, /*expect_snapshot=*/true, 0);
  EXPECT_EQ(view.seq, seq + 1);
  ASSERT_FALSE(view.events.empty());
  EXPECT_TRUE(view.events.back().has_cleared());
  EXPECT_TRUE(view.blocks.empty());
  // ClearKvCache has returned: the load report shows its effect.
  v1::LoadReport cleared = GetLoad(w->stub());
  EXPECT_EQ(cleared.kv_event_seq(), seq + 1);
  EXPECT_EQ(cleared.cached_blocks(), 0) << "GetLoad after ClearKvCache returned still counts "
                                           "cached blocks (at kv_event_seq "
                                        << cleared.kv_event_seq() << ")";
  EXPECT_EQ(cleared.free_blocks(), cleared.total_blocks());
  CacheView after_clear = Snapshot(w->stub(), instance, seq + 1);
  EXPECT_EQ(after_clear.seq, seq + 1);
  EXPECT_TRUE(after_clear.blocks.empty());

  // Resume: a subscriber that saw up to `from` gets exactly the later events.
  const uint64_t from = seq / 2;
  v1::KvEventsRequest resume_req;
  resume_req.set_start_after_seq(from);
  KvEventReader resumed(w->stub(), resume_req);
  ASSERT_TRUE(resumed.WaitForSeq(seq + 1));
  CacheView tail = Replay(resumed.batches(), instance, /*expect_snapshot=*/false, from);
  std::vector<std::string> want, got;
  for (const v1::KvEvent& e : view.events) {
    if (e.seq() > from) want.push_back(e.SerializeAsString());
  }
  for (const v1::KvEvent& e : tail.events) got.push_back(e.SerializeAsString());
  EXPECT_EQ(got, want) << "resumed events differ from the live stream's";
  EXPECT_EQ(tail.seq, seq + 1);
}

TEST_F(WorkerGrpcTest, KvEventsReportEvictions) {
  constexpr int kBlocks = 16;
  WorkerProcess* w = StartWorker({"--kv-cache-memory", CacheBytesFlag(kBlocks)});
  ASSERT_NE(w, nullptr);
  const v1::ModelInfo info = GetModelInfo(w->stub());
  ASSERT_EQ(info.total_blocks(), kBlocks);

  v1::KvEventsRequest req;
  req.set_snapshot(true);
  KvEventReader live(w->stub(), req);
  ASSERT_TRUE(live.WaitForSeq(0));

  // 8 distinct requests of 3 full blocks each: 24 blocks in a 16-block cache.
  std::set<uint64_t> last_blocks;
  for (int i = 0; i < 8; ++i) {
    const std::vector<int32_t> prompt = MakePrompt(400 + i, 48);
    v1::GenerateRequest r = GreedyRequest(prompt, 8);
    r.mutable_sampling()->set_ignore_eos(true);
    Output out = Generate(w->stub(), r);
    ExpectWellFormed(out, absl::StrCat("request ", i));
    if (i == 7) last_blocks = ExpectedBlocks(info.block_hash_seed(), prompt, out);
  }
  v1::LoadReport load = ExpectIdle(w->stub(), "after the requests");
  ASSERT_TRUE(live.WaitForSeq(load.kv_event_seq()));
  CacheView view = Replay(live.batches(), info.instance_id(), /*expect_snapshot=*/true, 0);
  EXPECT_EQ(view.seq, load.kv_event_seq());
  EXPECT_GT(view.removed, 0) << "no eviction reported";
  EXPECT_EQ(view.stored - view.removed, static_cast<int>(view.blocks.size()));
  EXPECT_LE(static_cast<int64_t>(view.blocks.size()), kBlocks);
  EXPECT_EQ(static_cast<int64_t>(view.blocks.size()), load.cached_blocks());
  // The most recent request's blocks were released last and are still cached.
  for (uint64_t h : last_blocks) EXPECT_TRUE(view.blocks.contains(h));

  CacheView fresh = Snapshot(w->stub(), info.instance_id(), load.kv_event_seq());
  EXPECT_EQ(fresh.blocks, view.blocks);
}

// ---------------------------------------------------------------------------
// 14. GetLoad after the work is done.

TEST_F(WorkerGrpcTest, LoadReportIsConsistentWhenIdle) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  v1::LoadReport initial = GetLoad(w->stub());
  EXPECT_TRUE(IsIdle(initial));
  EXPECT_EQ(initial.free_blocks(), initial.total_blocks());
  EXPECT_EQ(initial.finished_requests(), 0);
  EXPECT_EQ(initial.prefix_hit_rate(), 0.0);

  const std::vector<int32_t> shared = MakePrompt(17, 40);
  const std::vector<int32_t> other = MakePrompt(18, 30);
  for (const std::vector<int32_t>* p : {&shared, &shared, &other}) {
    Output out = Generate(w->stub(), GreedyRequest(*p, 10));
    ExpectWellFormed(out, "request");
  }
  bool ok = false;
  v1::LoadReport load = WaitForLoad(
      w->stub(), [](const v1::LoadReport& l) { return IsIdle(l) && l.finished_requests() == 3; }, &ok);
  ASSERT_TRUE(ok) << load.ShortDebugString();
  EXPECT_EQ(load.running_sequences(), 0);
  EXPECT_EQ(load.waiting_sequences(), 0);
  EXPECT_EQ(load.used_blocks(), 0);
  EXPECT_EQ(load.tokens_in_flight(), 0);
  EXPECT_EQ(load.prefill_tokens_pending(), 0);
  EXPECT_EQ(load.total_blocks(), GetModelInfo(w->stub()).total_blocks());
  EXPECT_EQ(load.free_blocks() + load.cached_blocks(), load.total_blocks());
  EXPECT_GT(load.cached_blocks(), 0);
  EXPECT_EQ(load.prefix_query_tokens(), 40 + 40 + 30);
  EXPECT_EQ(load.prefix_hit_tokens(), 2 * kBlockSize);  // the repeat: 2 full blocks of 39
  EXPECT_GE(load.prefix_hit_rate(), 0.0);
  EXPECT_LE(load.prefix_hit_rate(), 1.0);
  EXPECT_NEAR(load.prefix_hit_rate(), 32.0 / 110.0, 1e-9);
  EXPECT_EQ(load.preemptions(), 0);
  EXPECT_GT(load.kv_event_seq(), 0u);
}

// ---------------------------------------------------------------------------
// 15. Chaos: many concurrent clients on a small cache, each ending its stream
// in a different way (reading to the end, cancelling after a few messages,
// a deadline that expires mid-stream, an invalid request), while the prefix
// cache is cleared and KV event subscribers come and go. The worker must
// stay up, free every block, and keep its accounting exact.

TEST_F(WorkerGrpcTest, RandomCancellationsDeadlinesAndClearsLeakNothing) {
  WorkerProcess* w = StartWorker({"--kv-cache-memory", CacheBytesFlag(48), "--max-running", "6", "--max-waiting", "200",
                                  "--max-batched-tokens", "64"});
  ASSERT_NE(w, nullptr);
  constexpr int kClients = 8;
  constexpr int kRequestsPerClient = 16;
  std::atomic<int> completed{0}, cancelled{0}, expired{0}, rejected{0}, unexpected{0};
  std::atomic<bool> stop_background{false};

  // Background churn: clears of the prefix cache and short-lived event streams.
  std::thread churn([&] {
    std::mt19937 rng(99);
    while (!stop_background.load()) {
      {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
        v1::ClearKvCacheResponse resp;
        EXPECT_TRUE(w->stub().ClearKvCache(&ctx, v1::ClearKvCacheRequest(), &resp).ok());
      }
      {
        grpc::ClientContext ctx;
        v1::KvEventsRequest req;
        req.set_snapshot(rng() % 2 == 0);
        auto reader = w->stub().StreamKvEvents(&ctx, req);
        v1::KvEventBatch batch;
        reader->Read(&batch);  // at least the snapshot or the first events, or nothing
        ctx.TryCancel();
        while (reader->Read(&batch)) {
        }
        reader->Finish();
      }
      std::this_thread::sleep_for(milliseconds(5 + rng() % 20));
    }
  });

  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(1000 + c);
      for (int r = 0; r < kRequestsPerClient; ++r) {
        const int len = 1 + static_cast<int>(rng() % 150);
        v1::GenerateRequest req = rng() % 2 ? GreedyRequest(MakePrompt(rng(), len), 1 + rng() % 120)
                                            : SampledRequest(MakePrompt(rng(), len), 1 + rng() % 120, rng());
        req.mutable_sampling()->set_ignore_eos(rng() % 2 == 0);
        if (rng() % 3 == 0) req.mutable_sampling()->set_logprobs(rng() % 4);
        const int mode = static_cast<int>(rng() % 4);
        if (mode == 3) req.mutable_sampling()->set_temperature(-1.0f);  // invalid
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         (mode == 2 ? milliseconds(5 + rng() % 40) : milliseconds(60000)));
        auto reader = w->stub().Generate(&ctx, req);
        v1::GenerateResponse msg;
        int messages = 0;
        const int cancel_after = 1 + static_cast<int>(rng() % 3);
        bool saw_finish = false;
        while (reader->Read(&msg)) {
          ++messages;
          if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) saw_finish = true;
          if (mode == 1 && messages == cancel_after) ctx.TryCancel();
        }
        grpc::Status st = reader->Finish();
        if (st.ok() && saw_finish) {
          ++completed;
        } else if (st.error_code() == grpc::StatusCode::CANCELLED) {
          ++cancelled;
        } else if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
          ++expired;
        } else if (st.error_code() == grpc::StatusCode::INVALID_ARGUMENT && mode == 3) {
          ++rejected;
        } else {
          ++unexpected;
          ADD_FAILURE() << "mode " << mode << ": " << st.error_code() << " " << st.error_message();
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  stop_background = true;
  churn.join();

  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_EQ(completed + cancelled + expired + rejected, kClients * kRequestsPerClient);
  RecordProperty("outcomes", absl::StrCat(completed.load(), " completed, ", cancelled.load(), " cancelled, ",
                                          expired.load(), " expired, ", rejected.load(), " rejected"));
  EXPECT_GT(completed.load(), 0);
  EXPECT_GT(rejected.load(), 0);
  v1::LoadReport load = ExpectIdle(w->stub(), "after the chaos");
  EXPECT_EQ(load.free_blocks() + load.cached_blocks(), load.total_blocks());
  EXPECT_EQ(load.used_blocks(), 0);

  // Still serving, and still correct: a request matches a fresh worker's output.
  WorkerProcess* fresh = StartWorker();
  ASSERT_NE(fresh, nullptr);
  v1::GenerateRequest probe = GreedyRequest(MakePrompt(4242, 70), 24);
  probe.mutable_sampling()->set_logprobs(2);
  ExpectSameOutput(Generate(w->stub(), probe), Generate(fresh->stub(), probe), "after the chaos");
}

// ---------------------------------------------------------------------------
// 16. A worker that shuts down ends its open streams with UNAVAILABLE (so a
// router retries elsewhere), after the tokens it had already produced.

// A long greedy stream (EOS ignored) whose first message has arrived when
// the worker gets SIGTERM; Rest() reads it to its end.
class StreamCutBySigterm {
 public:
  StreamCutBySigterm(WorkerProcess* w, int max_tokens) {
    v1::GenerateRequest req = GreedyRequest(MakePrompt(16, 30), max_tokens);
    req.mutable_sampling()->set_ignore_eos(true);
    ctx_.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
    reader_ = w->stub().Generate(&ctx_, req);
    v1::GenerateResponse msg;
    started_ = reader_->Read(&msg);
    tokens_ = msg.tokens_size();
    signalled_ = started_ && kill(w->pid(), SIGTERM) == 0;
  }
  bool ok() const { return started_ && signalled_; }
  // The stream's status, its tokens and the finish reason of its last message.
  grpc::Status Rest(int* tokens, v1::FinishReason* finish) {
    v1::GenerateResponse msg;
    *finish = v1::FINISH_REASON_UNSPECIFIED;
    while (reader_->Read(&msg)) {
      tokens_ += msg.tokens_size();
      if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) *finish = msg.finish_reason();
    }
    *tokens = tokens_;
    return reader_->Finish();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
  bool started_ = false;
  bool signalled_ = false;
  int tokens_ = 0;
};

// The worker exits by itself within 10 s, with status 0.
void ExpectCleanExit(WorkerProcess* w) {
  absl::StatusOr<int> exited = w->Wait(seconds(10));
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 0) << *exited;
}

// SIGTERM drains: the KV event streams say so at once (one batch with
// `draining`: a status-only stream gets just that, an event stream gets it
// beside its events, and a stream opened later gets it first), Health turns
// NOT_SERVING and new Generate calls get UNAVAILABLE (a router retries them
// elsewhere), while the stream in flight runs to its end; then the worker
// exits by itself, cleanly.
TEST_F(WorkerGrpcTest, SigtermDrainsInFlightStreamsAndRefusesNewOnes) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  v1::KvEventsRequest status_only, with_events;
  status_only.set_status_only(true);
  with_events.set_snapshot(true);
  KvEventReader status(w->stub(), status_only);
  KvEventReader events(w->stub(), with_events);
  ASSERT_TRUE(events.WaitForSeq(0));  // its snapshot
  auto drain_batches = [](KvEventReader& r) {
    int n = 0;
    for (const v1::KvEventBatch& b : r.batches()) n += b.draining() ? 1 : 0;
    return n;
  };
  EXPECT_EQ(drain_batches(status) + drain_batches(events), 0) << "a drain announced before SIGTERM";
  StreamCutBySigterm stream(w, 1500);
  ASSERT_TRUE(stream.ok());
  for (KvEventReader* r : {&status, &events}) {
    EXPECT_TRUE(tandem::testing::WaitUntil([&] { return drain_batches(*r) > 0; }, seconds(5)))
        << "no batch said the worker drains";
  }
  KvEventReader later(w->stub(), status_only);
  EXPECT_TRUE(tandem::testing::WaitUntil([&] { return drain_batches(later) > 0; }, seconds(5)))
      << "a stream opened during the drain";
  for (KvEventReader* r : {&status, &later}) {
    const std::vector<v1::KvEventBatch> got = r->batches();
    ASSERT_EQ(got.size(), 1u) << "a status-only stream carries the drain alone";
    EXPECT_FALSE(got[0].has_snapshot());
    EXPECT_EQ(got[0].events_size(), 0);
    EXPECT_EQ(got[0].instance_id(), events.batches()[0].instance_id());
  }
  EXPECT_EQ(drain_batches(events), 1) << "announced once";

  // The drain is visible to callers at once (within a health check or two).
  EXPECT_EQ(WaitForHealth(w->stub(), v1::HealthResponse::NOT_SERVING, seconds(5)), v1::HealthResponse::NOT_SERVING);
  {
    grpc::ClientContext nctx;
    nctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
    auto refused = w->stub().Generate(&nctx, GreedyRequest(MakePrompt(8, 31), 4));
    v1::GenerateResponse ignored;
    EXPECT_FALSE(refused->Read(&ignored));
    grpc::Status st = refused->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("draining"));
  }

  int tokens = 0;
  v1::FinishReason finish;
  grpc::Status st = stream.Rest(&tokens, &finish);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(tokens, 1500);
  EXPECT_EQ(finish, v1::FINISH_REASON_LENGTH);
  ExpectCleanExit(w);
}

// A rolling restart's view from the worker: callers keep sending short
// requests (on one shared channel, as a router does) while the worker gets
// SIGTERM and exits. Each call either completes with its finish reason, or
// is refused UNAVAILABLE (retryable), or, when it reached the server as the
// server shut down, ends CANCELLED before any message (gRPC cancels the calls
// it has not handed to the worker yet; a router retries those too). No call
// the worker had started is cut.
TEST_F(WorkerGrpcTest, SigtermUnderSteadyCallsCompletesOrRefusesEachCall) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  constexpr int kClients = 6;
  std::atomic<int> completed{0}, refused{0}, drained{0}, unstarted{0};
  std::atomic<bool> signalled{false}, exited{false};
  std::mutex mu;
  std::vector<std::string> unexpected;
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(77 + c);
      for (int r = 0;; ++r) {
        v1::GenerateRequest req = GreedyRequest(MakePrompt(rng(), 4 + static_cast<int>(rng() % 40)), 1 + rng() % 24);
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
        auto reader = w->stub().Generate(&ctx, req);
        v1::GenerateResponse msg;
        bool saw_finish = false;
        int messages = 0;
        for (; reader->Read(&msg); ++messages) saw_finish |= msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
        const grpc::Status st = reader->Finish();
        if (st.ok() && saw_finish) {
          ++completed;
        } else if (st.error_code() == grpc::StatusCode::UNAVAILABLE) {
          ++refused;
          if (st.error_message().find("draining") != std::string::npos) ++drained;
        } else if (st.error_code() == grpc::StatusCode::CANCELLED && messages == 0 && signalled) {
          ++unstarted;
        } else {
          std::lock_guard<std::mutex> lock(mu);
          unexpected.push_back(absl::StrCat("call ", r, " of client ", c, ": ", st.error_code(), " ",
                                            st.error_message(), saw_finish ? "" : " (no finish reason)"));
        }
        if (exited) return;
      }
    });
  }
  EXPECT_TRUE(tandem::testing::WaitUntil([&] { return completed.load() >= 4 * kClients; }, kRpcTimeout));
  signalled = true;
  EXPECT_EQ(kill(w->pid(), SIGTERM), 0);
  ExpectCleanExit(w);
  exited = true;
  for (std::thread& t : clients) t.join();
  EXPECT_THAT(unexpected, ::testing::IsEmpty());
  RecordProperty("outcomes", absl::StrCat(completed.load(), " completed, ", refused.load(), " refused, ",
                                          unstarted.load(), " cancelled unstarted"));
  EXPECT_GT(drained.load(), 0) << "no call came while the worker drained";
}

// The role is one of three names; anything else is refused naming the flag,
// and what a worker reports is the name it was given.
TEST_F(WorkerGrpcTest, RoleIsPrefillDecodeOrBoth) {
  absl::StatusOr<std::string> bin = tandem::testing::TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  std::string out;
  EXPECT_NE(tandem::testing::RunCommand(*bin + " worker --insecure --port 0 --role encode", &out), 0);
  EXPECT_THAT(out, HasSubstr("--role must be prefill, decode or both, got 'encode'"));
  absl::StatusOr<std::unique_ptr<WorkerProcess>> decode = WorkerProcess::Start({"--role", "decode"});
  ASSERT_TRUE(decode.ok()) << decode.status();
  EXPECT_EQ(GetModelInfo((*decode)->stub()).role(), "decode");
}

// `tandem export-model` refuses an unknown preset before writing anything,
// naming the flag and listing the presets; its help lists them too.
TEST(ExportModelCommandTest, UnknownPresetListsThePresets) {
  absl::StatusOr<std::string> bin = tandem::testing::TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  const std::string dir = absl::StrCat(::testing::TempDir(), "/tandem-export-", getpid());
  std::string out;
  EXPECT_NE(tandem::testing::RunCommand(*bin + " export-model --preset nosuch " + dir, &out), 0);
  EXPECT_THAT(out, HasSubstr("--preset: unknown built-in model \"nosuch\" (built-in models: tiny, small, "
                             "llama-3.2-1b, llama-3.1-8b)"));
  EXPECT_FALSE(std::filesystem::exists(dir));
  EXPECT_EQ(tandem::testing::RunCommand(*bin + " export-model --help", &out), 0);
  EXPECT_THAT(out, AllOf(HasSubstr("llama-3.2-1b"), HasSubstr("llama-3.1-8b")));
}

// In a container image (TANDEM_HOST=0.0.0.0) the worker listens on every
// interface without a --host flag; a --host flag still wins over it.
TEST_F(WorkerGrpcTest, TandemHostSetsTheDefaultListenAddress) {
  struct EnvGuard {
    EnvGuard() { setenv("TANDEM_HOST", "0.0.0.0", 1); }
    ~EnvGuard() { unsetenv("TANDEM_HOST"); }
  } env;
  absl::StatusOr<std::unique_ptr<WorkerProcess>> any = WorkerProcess::Start({});
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_TRUE((*any)->address().starts_with("0.0.0.0:")) << (*any)->address();
  EXPECT_EQ(GetModelInfo((*any)->stub()).model(), "tiny");

  absl::StatusOr<std::unique_ptr<WorkerProcess>> flagged = WorkerProcess::Start({"--host", "127.0.0.1"});
  ASSERT_TRUE(flagged.ok()) << flagged.status();
  EXPECT_TRUE((*flagged)->address().starts_with("127.0.0.1:")) << (*flagged)->address();
}

// --metrics-port: plain HTTP beside the gRPC port with the worker's own
// Prometheus metrics and the probes Kubernetes uses (mutual TLS on the gRPC
// port shuts its gRPC probes out): /healthz while alive, /readyz while it
// takes requests (503 once draining).
TEST_F(WorkerGrpcTest, MetricsPortServesMetricsAndProbesThatFollowTheDrain) {
  const int port = FreeTcpPort();
  ASSERT_GT(port, 0);
  WorkerProcess* w = StartWorker({"--metrics-port", std::to_string(port)});
  ASSERT_NE(w, nullptr);
  const std::string base = absl::StrCat("127.0.0.1:", port);
  EXPECT_EQ(HttpGet(base, "/healthz").status, 200);
  EXPECT_EQ(HttpGet(base, "/readyz").status, 200);
  EXPECT_EQ(HttpGet(base, "/nope").status, 404);
  const v1::LoadReport idle = GetLoad(w->stub());
  EXPECT_EQ(ScrapeMetric(base, "tandem_worker_kv_blocks{state=\"total\"}"), idle.total_blocks());
  EXPECT_EQ(ScrapeMetric(base, "tandem_worker_serving"), 1);

  // Two generations of the same prompt: both finish, the second hits the prefix cache.
  for (int i = 0; i < 2; ++i) {
    Output out = Generate(w->stub(), GreedyRequest(MakePrompt(7, 64), 8));
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  }
  // The load report (which the metrics read) counts a request only after
  // its stream has ended (DisaggTest.TheLoadReportNeverPrecedesAnAnsweredRequest):
  // wait for it to catch up.
  bool caught_up = false;
  WaitForLoad(
      w->stub(), [](const v1::LoadReport& l) { return IsIdle(l) && l.finished_requests() == 2; }, &caught_up);
  ASSERT_TRUE(caught_up);
  EXPECT_EQ(ScrapeMetric(base, "tandem_worker_events_total{event=\"finished\"}"), 2);
  EXPECT_GE(ScrapeMetric(base, "tandem_worker_prefix_tokens_total{kind=\"hit\"}").value_or(0), 48);
  EXPECT_EQ(ScrapeMetric(base, "tandem_worker_sequences{state=\"running\"}"), 0);

  // Draining: not ready, still alive, while a stream runs.
  StreamCutBySigterm stream(w, 1500);
  ASSERT_TRUE(stream.ok());
  // While the stream surely runs (a loaded machine's scrapes below may come
  // after a fast model finished its 1500 tokens); the report is published
  // after each step, so the first token may come before it counts the
  // stream: read again until it does, for at most a second.
  std::optional<double> running;
  for (int i = 0; i < 100; ++i) {
    running = ScrapeMetric(base, "tandem_worker_sequences{state=\"running\"}");
    if (running == 1) break;
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(running, 1);
  HttpResponse ready;
  for (int i = 0; i < 100; ++i) {
    ready = HttpGet(base, "/readyz");
    if (ready.status == 503) break;
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(ready.status, 503);
  EXPECT_THAT(ready.body, HasSubstr("draining"));
  EXPECT_EQ(HttpGet(base, "/healthz").status, 200);
  EXPECT_EQ(ScrapeMetric(base, "tandem_worker_serving"), 0);
  int tokens = 0;
  v1::FinishReason finish;
  EXPECT_TRUE(stream.Rest(&tokens, &finish).ok());
  ExpectCleanExit(w);
}

// grpc.health.v1.Health/Check through the generic stub (the health proto is
// not among Debian's headers), for the server as a whole; the answer is
// field 1, the status (1 SERVING, 2 NOT_SERVING).
// Returns -1 when the call fails.
int GrpcHealthStatus(const std::string& address) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
  // HealthCheckRequest{service: ""}, the field written out (gRPC's health
  // service refuses an empty buffer).
  const char encoded[] = {0x0a, 0x00};
  grpc::Slice slice(encoded, sizeof(encoded));
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  const bool answered = cq.Next(&tag, &ok) && ok;
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!answered) return -1;
  if (!status.ok()) {
    ADD_FAILURE() << "grpc.health.v1 Check: " << status.error_code() << " " << status.error_message();
  }
  if (!status.ok()) return -1;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  // Field 1, varint: tag 0x08, then the value (absent: 0, UNKNOWN).
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : (bytes.empty() ? 0 : -1);
}

// The standard gRPC health service answers SERVING, and NOT_SERVING once the
// worker drains (where TLS is off, Kubernetes' gRPC probes read it).
TEST_F(WorkerGrpcTest, StandardGrpcHealthFollowsTheDrain) {
  WorkerProcess* w = StartWorker();
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(GrpcHealthStatus(w->address()), 1);
  StreamCutBySigterm stream(w, 1500);
  ASSERT_TRUE(stream.ok());
  int status = 0;
  for (int i = 0; i < 100 && (status = GrpcHealthStatus(w->address())) == 1; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(status, 2);
  int tokens = 0;
  v1::FinishReason finish;
  EXPECT_TRUE(stream.Rest(&tokens, &finish).ok());
  ExpectCleanExit(w);
}

// A drain is bounded: past --drain-timeout the streams still running end
// with UNAVAILABLE (a router fails them over) and the worker exits cleanly.
TEST_F(WorkerGrpcTest, StreamsStillRunningAtTheDrainTimeoutEndWithUnavailable) {
  WorkerProcess* w = StartWorker({"--drain-timeout", "0.2"});
  ASSERT_NE(w, nullptr);
  StreamCutBySigterm stream(w, 2000);
  ASSERT_TRUE(stream.ok());
  int tokens = 0;
  v1::FinishReason finish;
  grpc::Status st = stream.Rest(&tokens, &finish);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_EQ(finish, v1::FINISH_REASON_UNSPECIFIED);
  EXPECT_GT(tokens, 0);
  EXPECT_LT(tokens, 2000);
  ExpectCleanExit(w);
}

// ---------------------------------------------------------------------------
// 17. A snapshot larger than one batch arrives in bounded chunks that a
// client with gRPC's default 4 MiB message limit reads.

TEST_F(WorkerGrpcTest, LargeSnapshotArrivesInChunks) {
  if (WorkersOnGpu()) GTEST_SKIP() << "needs --block-size 1; the GPU runner takes 16, 32 or 64";
  // Block size 1: every computed token is a cached block.
  WorkerProcess* w = StartWorker({"--block-size", "1", "--kv-cache-memory", "64MiB"});
  ASSERT_NE(w, nullptr);
  constexpr int kPrompts = 40;
  constexpr int kLen = 1800;  // 40 * 1800 = 72000 blocks > 65536 per batch
  for (int i = 0; i < kPrompts; ++i) {
    Output out = Generate(w->stub(), GreedyRequest(MakePrompt(5000 + i, kLen), 1));
    ASSERT_EQ(out.status.error_code(), grpc::StatusCode::OK) << out.status.error_message();
  }
  // Idle first: the load report is published after each engine step.
  v1::LoadReport load = ExpectIdle(w->stub(), "after the prompts");
  ASSERT_GT(load.cached_blocks(), 65536);

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  v1::KvEventsRequest req;
  req.set_snapshot(true);
  auto reader = w->stub().StreamKvEvents(&ctx, req);
  v1::KvEventBatch batch;
  std::set<uint64_t> blocks;
  int batches = 0;
  bool complete = false;
  while (!complete && reader->Read(&batch)) {
    ASSERT_TRUE(batch.has_snapshot());
    EXPECT_EQ(batch.snapshot().seq(), load.kv_event_seq());
    for (const v1::CachedBlock& b : batch.snapshot().blocks()) blocks.insert(b.block_hash());
    complete = batch.snapshot().complete();
    ++batches;
  }
  ctx.TryCancel();
  reader->Finish();
  EXPECT_TRUE(complete);
  EXPECT_GE(batches, 2);
  EXPECT_EQ(static_cast<int64_t>(blocks.size()), load.cached_blocks());
}

// ---------------------------------------------------------------------------
// 18. A KV budget larger than the machine's memory is refused at start (the
// pool is mapped lazily and would otherwise be OOM-killed under load).

// A GPU worker given no KV size takes what the model leaves of 0.9 of the
// GPU (vLLM's default), not the host's 256 MiB (GPU machine only).
TEST_F(WorkerGrpcTest, GpuWorkerWithoutAKvSizeTakesMostOfTheGpu) {
  if (!WorkersOnGpu()) GTEST_SKIP() << "TANDEM_TEST_WORKER_DEVICE names no GPU";
  WorkerProcess* w = StartWorker({"--device", std::getenv("TANDEM_TEST_WORKER_DEVICE")});
  ASSERT_NE(w, nullptr);
  const v1::ModelInfo info = GetModelInfo(w->stub());
  EXPECT_GT(info.total_blocks(), 64 * ((int64_t{256} << 20) / AggregatedBytesPerBlock()));
  ExpectWellFormed(Generate(w->stub(), GreedyRequest(MakePrompt(3, 20), 4)), "a request");
}

TEST_F(WorkerGrpcTest, KvBudgetBeyondMemoryIsRefusedAtStart) {
  absl::StatusOr<std::string> bin = tandem::testing::TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  absl::StatusOr<tandem::testing::ChildProcess> child = tandem::testing::ChildProcess::Spawn(
      {*bin, "worker", "--insecure", "--port", "0", "--kv-cache-memory", "1000000GiB"}, "/dev/null");
  ASSERT_TRUE(child.ok()) << child.status();
  absl::StatusOr<int> status = child->Wait(std::chrono::seconds(30));
  ASSERT_TRUE(status.ok()) << "the worker started with a budget it cannot have";
  EXPECT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 1);
}

// ---------------------------------------------------------------------------
// 19. `tandem export-model` writes a checkpoint that `tandem worker --model
// DIR` serves with the built-in model's exact outputs (f32 export: the same
// weights, bit for bit).

TEST_F(WorkerGrpcTest, ExportedCheckpointServesTheBuiltinOutputs) {
  absl::StatusOr<std::string> bin = tandem::testing::TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  char tmpl[] = "/tmp/tandem-export-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = std::string(tmpl) + "/tiny";
  absl::StatusOr<tandem::testing::ChildProcess> exporter =
      tandem::testing::ChildProcess::Spawn({*bin, "export-model", "--preset", "tiny", dir});
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  absl::StatusOr<int> status = exporter->Wait(std::chrono::seconds(60));
  ASSERT_TRUE(status.ok());
  ASSERT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "export-model failed";

  WorkerProcess* builtin = StartWorker();
  ASSERT_NE(builtin, nullptr);
  absl::StatusOr<std::unique_ptr<WorkerProcess>> exported = WorkerProcess::Start({"--model", dir});
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(GetModelInfo((*exported)->stub()).model(), "tiny");
  for (int i = 0; i < 3; ++i) {
    v1::GenerateRequest req =
        i == 0 ? GreedyRequest(MakePrompt(900 + i, 50), 30) : SampledRequest(MakePrompt(900 + i, 50), 30, 77 + i);
    Output want = Generate(builtin->stub(), req);
    Output got = Generate((*exported)->stub(), req);
    ExpectWellFormed(got, "exported");
    EXPECT_EQ(got.tokens, want.tokens) << "request " << i;
    EXPECT_EQ(got.logprobs, want.logprobs) << "request " << i << ": not bit-identical";
  }
  (*exported)->Stop();
  std::filesystem::remove_all(tmpl);
}

}  // namespace
}  // namespace tandem
