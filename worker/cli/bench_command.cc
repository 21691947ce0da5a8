// `tandem bench engine`: CPU throughput of the engine on a built-in model,
// measured in-process through Engine::Submit (the path the gRPC service uses):
//   - prefill of one prompt alone, and of 8 prompts batched,
//   - decode alone, and with 8 sequences batched,
// and the model FLOP rate of the prefill as a ratio to what OpenBLAS sgemm
// alone reaches on the model's own GEMM shapes, measured in the same run
// (machines are noisy; only same-run ratios are comparable).
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/cli/commands.h"
#include "worker/engine/engine.h"
#include "worker/model/model_loader.h"

namespace tandem::worker {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchOptions {
  std::string model = "builtin:small";
  int prompt_len = 1024;
  int batch = 8;
  int decode_tokens = 64;
  int repeats = 3;
  int threads = 0;
  std::string device = "cpu";
  bool json = false;
};

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Collects one request's token times.
class TimingSink final : public OutputSink {
 public:
  void OnToken(const SampledToken&) override {
    std::lock_guard<std::mutex> lock(mu_);
    times_.push_back(Clock::now());
  }
  void OnFinish(const FinishInfo& info) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    info_ = info;
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
  }
  std::vector<Clock::time_point> times() {
    std::lock_guard<std::mutex> lock(mu_);
    return times_;
  }
  FinishInfo info() {
    std::lock_guard<std::mutex> lock(mu_);
    return info_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  FinishInfo info_;
  std::vector<Clock::time_point> times_;
};

struct RunResult {
  double seconds = 0;                  // submit to last finish
  std::vector<double> first_token;     // per request, from submit
  std::vector<double> decode_seconds;  // per request, first to last token
  int64_t tokens = 0;                  // generated tokens
};

absl::StatusOr<RunResult> RunBatch(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
  std::vector<std::shared_ptr<TimingSink>> sinks;
  Clock::time_point start = Clock::now();
  for (const auto& p : prompts) {
    auto sink = std::make_shared<TimingSink>();
    GenerateSpec spec{.request_id = "bench", .prompt = p, .params = {}};
    spec.params.temperature = 0.0f;
    spec.params.max_tokens = max_tokens;
    spec.params.ignore_eos = true;
    RETURN_IF_ERROR(engine.Submit(std::move(spec), sink).status());
    sinks.push_back(sink);
  }
  RunResult r;
  Clock::time_point end = start;
  for (auto& s : sinks) {
    s->Wait();
    auto t = s->times();
    if (s->info().reason == FinishReason::kError) return absl::InternalError(s->info().error);
    if (t.empty()) return absl::InternalError("no token generated");
    r.first_token.push_back(Seconds(start, t.front()));
    r.decode_seconds.push_back(Seconds(t.front(), t.back()));
    r.tokens += static_cast<int64_t>(t.size());
    end = std::max(end, t.back());
  }
  r.seconds = Seconds(start, end);
  return r;
}

// GFLOP/s of OpenBLAS sgemm alone on the linear layers' shapes for m tokens.
double SgemmRate(const ModelConfig& c, int m, int repeats) {
  struct Shape {
    int n, k;
  };
  const Shape shapes[] = {{c.q_size() + 2 * c.kv_size(), c.hidden_size},
                          {c.hidden_size, c.q_size()},
                          {2 * c.intermediate_size, c.hidden_size},
                          {c.hidden_size, c.intermediate_size}};
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<double> rates;
  for (int r = 0; r < repeats; ++r) {
    double flops = 0, secs = 0;
    for (const Shape& s : shapes) {
      std::vector<float> a(size_t(m) * s.k), b(size_t(s.n) * s.k), y(size_t(m) * s.n);
      for (float& x : a) x = d(rng);
      for (float& x : b) x = d(rng);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, s.n, s.k, 1, a.data(), s.k, b.data(), s.k, 0, y.data(),
                  s.n);  // warm-up
      Clock::time_point t0 = Clock::now();
      for (int l = 0; l < c.num_layers; ++l) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, s.n, s.k, 1, a.data(), s.k, b.data(), s.k, 0, y.data(),
                    s.n);
      }
      secs += Seconds(t0, Clock::now());
      flops += 2.0 * m * s.n * s.k * c.num_layers;
    }
    rates.push_back(flops / secs / 1e9);
  }
  return Median(rates);
}

std::vector<int32_t> RandomPrompt(std::mt19937& rng, int len, int vocab) {
  std::uniform_int_distribution<int> d(0, std::min(vocab, 256) - 1);
  std::vector<int32_t> p(len);
  for (int32_t& t : p) t = d(rng);
  return p;
}

absl::Status RunBench(const BenchOptions& opt) {
  ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(opt.model));
  const ModelConfig config = loaded.config;
  EngineConfig ec;
  ec.threads = opt.threads;
  ec.enable_prefix_caching = false;  // every prefill computes its whole prompt
  ec.max_batched_tokens = std::max(2048, opt.prompt_len);
  ec.kv_cache_bytes = 1ll << 30;
  RETURN_IF_ERROR(SelectDevice(opt.device, &ec.runner, &ec.runner_options));
  const bool on_cpu = ec.runner == "cpu";
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(ec, std::move(loaded)));
  engine->Start();
  const ModelRunner& flops_model = engine->runner();
  std::mt19937 rng(2024);

  // Warm-up (page in weights and scratch).
  RETURN_IF_ERROR(RunBatch(*engine, {RandomPrompt(rng, opt.prompt_len, config.vocab_size)}, 2).status());

  // The CPU's matrix rate on the same shapes (the GPU's baseline is not this).
  const double sgemm = on_cpu ? SgemmRate(config, opt.prompt_len, opt.repeats) : std::nan("");
  const int64_t keys = int64_t{opt.prompt_len} * (opt.prompt_len + 1) / 2;
  const double prefill_flops = flops_model.Flops(opt.prompt_len, keys, 1);

  std::vector<double> prefill_times;
  for (int r = 0; r < opt.repeats; ++r) {
    ASSIGN_OR_RETURN(RunResult res, RunBatch(*engine, {RandomPrompt(rng, opt.prompt_len, config.vocab_size)}, 1));
    prefill_times.push_back(res.first_token[0]);
  }
  const double prefill_s = Median(prefill_times);

  std::vector<std::vector<int32_t>> batch;
  for (int i = 0; i < opt.batch; ++i) batch.push_back(RandomPrompt(rng, opt.prompt_len, config.vocab_size));
  ASSIGN_OR_RETURN(RunResult batched_prefill, RunBatch(*engine, batch, 1));

  const int decode_prompt = 128;
  ASSIGN_OR_RETURN(RunResult alone,
                   RunBatch(*engine, {RandomPrompt(rng, decode_prompt, config.vocab_size)}, opt.decode_tokens + 1));
  std::vector<std::vector<int32_t>> dbatch;
  for (int i = 0; i < opt.batch; ++i) dbatch.push_back(RandomPrompt(rng, decode_prompt, config.vocab_size));
  ASSIGN_OR_RETURN(RunResult batched, RunBatch(*engine, dbatch, opt.decode_tokens + 1));
  engine->Stop();

  const double prefill_tps = opt.prompt_len / prefill_s;
  const double prefill_gflops = prefill_flops / prefill_s / 1e9;
  const double batched_prefill_tps = double(opt.batch) * opt.prompt_len / batched_prefill.seconds;
  const double decode_tps = opt.decode_tokens / alone.decode_seconds[0];
  double batched_decode_window = 0;
  for (double s : batched.decode_seconds) batched_decode_window = std::max(batched_decode_window, s);
  const double batched_decode_tps = double(opt.batch) * opt.decode_tokens / batched_decode_window;

  if (opt.json) {
    nlohmann::json j = {{"model", opt.model},
                        {"device", opt.device},
                        {"prompt_len", opt.prompt_len},
                        {"batch", opt.batch},
                        {"sgemm_gflops", on_cpu ? nlohmann::json(sgemm) : nlohmann::json()},
                        {"prefill_seconds", prefill_s},
                        {"prefill_tokens_per_s", prefill_tps},
                        {"prefill_gflops", prefill_gflops},
                        {"prefill_ratio_to_sgemm", on_cpu ? nlohmann::json(prefill_gflops / sgemm) : nlohmann::json()},
                        {"batched_prefill_tokens_per_s", batched_prefill_tps},
                        {"decode_tokens_per_s", decode_tps},
                        {"batched_decode_tokens_per_s", batched_decode_tps},
                        {"batched_decode_speedup", batched_decode_tps / decode_tps}};
    std::printf("%s\n", j.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("tandem bench engine: %s on %s, %d threads\n", opt.model.c_str(), opt.device.c_str(),
              openblas_get_num_threads());
  if (on_cpu) {
    std::printf("  OpenBLAS sgemm on the model's GEMM shapes (m=%d): %8.1f GFLOP/s\n", opt.prompt_len, sgemm);
  }
  std::printf("  prefill %5d tokens alone            : %8.3f s  %9.1f tok/s  %8.1f GFLOP/s", opt.prompt_len, prefill_s,
              prefill_tps, prefill_gflops);
  if (on_cpu) std::printf("  %.2fx sgemm", prefill_gflops / sgemm);
  std::printf("\n");
  std::printf("  prefill %d x %d tokens batched      : %8.3f s  %9.1f tok/s\n", opt.batch, opt.prompt_len,
              batched_prefill.seconds, batched_prefill_tps);
  std::printf("  decode alone                        :             %9.1f tok/s\n", decode_tps);
  std::printf("  decode %d sequences batched          :             %9.1f tok/s  (%.2fx alone)\n", opt.batch,
              batched_decode_tps, batched_decode_tps / decode_tps);
  return absl::OkStatus();
}

}  // namespace

void AddBenchCommand(CLI::App& bench) {
  auto opt = std::make_shared<BenchOptions>();
  CLI::App* cmd = bench.add_subcommand("engine", "Prefill/decode throughput of the engine (--device cpu or cuda)");
  cmd->add_option("--model", opt->model, "builtin:small, builtin:tiny or a checkpoint directory")
      ->capture_default_str();
  cmd->add_option("--prompt-len", opt->prompt_len, "Prefill prompt length")->capture_default_str();
  cmd->add_option("--batch", opt->batch, "Sequences in the batched runs")->capture_default_str();
  cmd->add_option("--decode-tokens", opt->decode_tokens, "Tokens decoded per sequence")->capture_default_str();
  cmd->add_option("--repeats", opt->repeats, "Repeats of the single-prompt prefill (median)")->capture_default_str();
  cmd->add_option("--threads", opt->threads, "BLAS threads (0: all cores)")->capture_default_str();
  cmd->add_option("--device", opt->device, "cpu, cuda or cuda:N (see tandem worker --help)")->capture_default_str();
  cmd->add_flag("--json", opt->json, "Print the results as JSON");
  cmd->callback([opt] { ExitWithStatus("bench engine", RunBench(*opt)); });
}

}  // namespace tandem::worker
