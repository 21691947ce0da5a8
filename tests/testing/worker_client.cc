#include "tests/testing/worker_client.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <latch>
#include <string_view>
#include <thread>

#include "absl/strings/str_cat.h"

namespace tandem::testing {

using std::chrono::milliseconds;
using std::chrono::seconds;

bool WorkersOnGpu() {
  const char* device = std::getenv("TANDEM_TEST_WORKER_DEVICE");
  return device != nullptr && std::string_view(device).rfind("cuda", 0) == 0;
}

float BatchingLogprobTolerance() {
  const char* args = std::getenv("TANDEM_TEST_WORKER_ARGS");
  const bool invariant = args != nullptr && std::string_view(args).find("--batch-invariant") != std::string_view::npos;
  return WorkersOnGpu() && !invariant ? 0.05f : kLogprobTolerance;
}

int64_t AggregatedBytesPerBlock() { return WorkersOnGpu() ? kBytesPerBlock / 2 : kBytesPerBlock; }

std::string CacheBytesFlag(int blocks) { return absl::StrCat(blocks * AggregatedBytesPerBlock()); }

// Deterministic pseudo-random byte tokens: different seeds give different
// prompts (no shared first block).
std::vector<int32_t> MakePrompt(uint32_t seed, int len) {
  std::vector<int32_t> out;
  uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (int i = 0; i < len; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out.push_back(static_cast<int32_t>(x % 256));
  }
  return out;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Greedy, with the sampled token's logprob and 3 alternatives.
v1::GenerateRequest GreedyRequest(const std::vector<int32_t>& prompt, int max_tokens) {
  v1::GenerateRequest req;
  req.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_temperature(0.0f);
  s->set_max_tokens(max_tokens);
  s->set_logprobs(3);
  return req;
}

// Seeded nucleus sampling, with logprobs.
v1::GenerateRequest SampledRequest(const std::vector<int32_t>& prompt, int max_tokens, uint64_t seed) {
  v1::GenerateRequest req = GreedyRequest(prompt, max_tokens);
  req.mutable_sampling()->set_temperature(0.8f);
  req.mutable_sampling()->set_top_p(0.9f);
  req.mutable_sampling()->set_seed(seed);
  return req;
}

void Accumulate(const v1::GenerateResponse& msg, Output* out) {
  ++out->messages;
  if (out->finish_messages > 0) out->finish_before_end = true;
  if (msg.has_reservation()) out->reservation = msg.reservation();
  if (msg.includes_first_token()) out->includes_first_token = true;
  for (const v1::TokenOutput& t : msg.tokens()) {
    out->tokens.push_back(t.token_id());
    out->logprobs.push_back(t.logprob());
    std::vector<std::pair<int32_t, float>> alts;
    for (const v1::TopLogprob& a : t.top_logprobs()) alts.emplace_back(a.token_id(), a.logprob());
    out->top.push_back(std::move(alts));
  }
  if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
    ++out->finish_messages;
    out->finish = msg.finish_reason();
    out->stop_token_id = msg.stop_token_id();
    out->usage = msg.usage();
    out->error_message = msg.error_message();
    out->kv_transfer_error = msg.kv_transfer_error();
  }
}

Output Generate(v1::Worker::Stub& stub, const v1::GenerateRequest& req, std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&ctx, req);
  Output out;
  out.started = std::chrono::steady_clock::now();
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) Accumulate(msg, &out);
  out.status = reader->Finish();
  out.ended = std::chrono::steady_clock::now();
  return out;
}

// A finished stream: OK status, exactly one finishing message, the last one.
void ExpectWellFormed(const Output& out, const std::string& what) {
  EXPECT_TRUE(out.status.ok()) << what << ": " << out.status.error_code() << " " << out.status.error_message();
  EXPECT_EQ(out.finish_messages, 1) << what;
  EXPECT_FALSE(out.finish_before_end) << what;
  EXPECT_EQ(out.usage.completion_tokens(), static_cast<int>(out.tokens.size())) << what;
  for (int32_t t : out.tokens) {
    EXPECT_GE(t, 0) << what;
    EXPECT_LT(t, kVocabSize) << what;
  }
}

// Same tokens, finish and (within BatchingLogprobTolerance()) logprobs.
void ExpectSameOutput(const Output& got, const Output& want, const std::string& what) {
  ExpectWellFormed(got, what);
  ExpectWellFormed(want, what + " (reference)");
  EXPECT_EQ(got.tokens, want.tokens) << what;
  EXPECT_EQ(got.finish, want.finish) << what;
  EXPECT_EQ(got.stop_token_id, want.stop_token_id) << what;
  const float tolerance = BatchingLogprobTolerance();
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  ASSERT_EQ(got.top.size(), want.top.size()) << what;
  for (size_t i = 0; i < got.logprobs.size(); ++i) {
    EXPECT_NEAR(got.logprobs[i], want.logprobs[i], tolerance) << what << " token " << i;
    const auto& g = got.top[i];
    const auto& w = want.top[i];
    ASSERT_EQ(g.size(), w.size()) << what << " token " << i;
    for (size_t k = 0; k < g.size(); ++k) {
      EXPECT_NEAR(g[k].second, w[k].second, tolerance) << what << " token " << i << " alt " << k;
      if (g[k].first == w[k].first) continue;
      // Between runs whose roundings differ (the loose tolerance), two
      // alternatives within it of each other may change places; the last
      // may be one the reference did not list. Exact runs keep the order.
      const bool near_tie = (k > 0 && w[k - 1].second - w[k].second <= tolerance) ||
                            (k + 1 < w.size() && w[k].second - w[k + 1].second <= tolerance) || k + 1 == w.size();
      EXPECT_TRUE(tolerance > kLogprobTolerance && near_tie) << what << " token " << i << " alt " << k << ": id "
                                                             << g[k].first << " where the reference has " << w[k].first;
    }
  }
}

namespace {

// run(i) for i in [0, n), each on its own thread, released together.
template <typename T>
std::vector<T> RunConcurrently(size_t n, const std::function<T(size_t)>& run) {
  std::vector<T> got(n);
  std::latch start(static_cast<std::ptrdiff_t>(n));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      got[i] = run(i);
    });
  }
  for (std::thread& t : threads) t.join();
  return got;
}

}  // namespace

std::vector<Output> GenerateConcurrently(v1::Worker::Stub& stub, const std::vector<v1::GenerateRequest>& requests) {
  return RunConcurrently<Output>(requests.size(), [&](size_t i) { return Generate(stub, requests[i]); });
}

v1::HealthResponse::ServingStatus WaitForHealth(v1::Worker::Stub& stub, v1::HealthResponse::ServingStatus status,
                                                std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  v1::HealthResponse::ServingStatus last = v1::HealthResponse::SERVING_STATUS_UNSPECIFIED;
  do {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
    v1::HealthResponse health;
    last = stub.Health(&ctx, v1::HealthRequest(), &health).ok() ? health.status()
                                                                : v1::HealthResponse::SERVING_STATUS_UNSPECIFIED;
    if (last == status) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } while (std::chrono::steady_clock::now() < deadline);
  return last;
}

v1::LoadReport GetLoad(v1::Worker::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
  v1::LoadReport report;
  grpc::Status st = stub.GetLoad(&ctx, v1::LoadRequest(), &report);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return report;
}

v1::ModelInfo GetModelInfo(v1::Worker::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
  v1::ModelInfo info;
  grpc::Status st = stub.GetModelInfo(&ctx, v1::ModelInfoRequest(), &info);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return info;
}

// Polls GetLoad until `done` holds or `timeout` passes; returns the last
// report, and whether `done` held, in *ok.
v1::LoadReport WaitForLoad(v1::Worker::Stub& stub, const std::function<bool(const v1::LoadReport&)>& done, bool* ok,
                           milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    v1::LoadReport load = GetLoad(stub);
    *ok = done(load);
    if (*ok || std::chrono::steady_clock::now() >= deadline) return load;
    std::this_thread::sleep_for(milliseconds(2));
  }
}

bool IsIdle(const v1::LoadReport& l) {
  return l.running_sequences() == 0 && l.waiting_sequences() == 0 && l.used_blocks() == 0 &&
         l.reserved_requests() == 0 && l.prefilled_requests() == 0 && l.quarantined_blocks() == 0;
}

// Waits until no sequence runs or waits and no block is referenced.
v1::LoadReport ExpectIdle(v1::Worker::Stub& stub, const std::string& what, milliseconds timeout) {
  bool ok = false;
  v1::LoadReport load = WaitForLoad(stub, IsIdle, &ok, timeout);
  EXPECT_TRUE(ok) << what << ": the worker did not become idle: " << load.ShortDebugString();
  return load;
}

// ---------------------------------------------------------------------------
// Disaggregated serving

ReceiveStream::ReceiveStream(v1::Worker::Stub& decode, v1::GenerateRequest req, uint32_t timeout_ms) {
  req.mutable_kv_transfer()->set_mode(v1::KvTransferParams::RECEIVE);
  req.mutable_kv_transfer()->set_timeout_ms(timeout_ms);
  ctx_.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  reader_ = decode.Generate(&ctx_, req);
  v1::GenerateResponse msg;
  if (reader_->Read(&msg)) Accumulate(msg, &out_);
}

Output ReceiveStream::Finish() {
  v1::GenerateResponse msg;
  while (reader_->Read(&msg)) Accumulate(msg, &out_);
  out_.status = reader_->Finish();
  out_.ended = std::chrono::steady_clock::now();
  return out_;
}

v1::GenerateRequest SendRequest(v1::GenerateRequest req, const std::string& decode_address,
                                const v1::KvReservation& r) {
  v1::KvTransferParams* kv = req.mutable_kv_transfer();
  kv->set_mode(v1::KvTransferParams::SEND);
  kv->set_decode_address(decode_address);
  kv->set_reservation_id(r.reservation_id());
  kv->set_decode_cached_tokens(r.cached_tokens());
  kv->set_decode_instance_id(r.instance_id());
  kv->set_reservation_token(r.reservation_token());
  *kv->mutable_reservation() = r;
  return req;
}

Output Combine(const Output& prefill, const Output& decode) {
  Output c = decode;
  if (!decode.includes_first_token && !prefill.tokens.empty()) {
    c.tokens.insert(c.tokens.begin(), prefill.tokens[0]);
    c.logprobs.insert(c.logprobs.begin(), prefill.logprobs[0]);
    c.top.insert(c.top.begin(), prefill.top[0]);
  }
  return c;
}

std::vector<Split> RunDisaggregatedConcurrently(v1::Worker::Stub& prefill, v1::Worker::Stub& decode,
                                                const std::string& decode_address,
                                                const std::vector<v1::GenerateRequest>& requests) {
  return RunConcurrently<Split>(
      requests.size(), [&](size_t i) { return RunDisaggregated(prefill, decode, decode_address, requests[i]); });
}

bool WaitForPullInFlight(v1::Worker::Stub& decode) {
  bool ok = false;
  WaitForLoad(
      decode, [](const v1::LoadReport& l) { return l.kv_pulls_in_flight() == 1; }, &ok);
  return ok;
}

Split RunDisaggregated(v1::Worker::Stub& prefill, v1::Worker::Stub& decode, const std::string& decode_address,
                       const v1::GenerateRequest& req, uint32_t timeout_ms) {
  Split s;
  ReceiveStream receive(decode, req, timeout_ms);
  if (!receive.reserved()) {
    s.decode = receive.Finish();
    ADD_FAILURE() << "no reservation: " << s.decode.status.error_message();
    return s;
  }
  s.prefill = Generate(prefill, SendRequest(req, decode_address, receive.reservation()));
  s.decode = receive.Finish();
  s.combined = Combine(s.prefill, s.decode);
  return s;
}

}  // namespace tandem::testing
