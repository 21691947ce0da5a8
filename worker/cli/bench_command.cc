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
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/cli/commands.h"
#include "worker/cli/python_helper.h"
#include "worker/engine/engine.h"
#include "worker/model/model_loader.h"
#include "worker/model/weights.h"
#include "worker/runner/cuda/device_probe.h"

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
  // --device cuda:
  std::vector<int> prefill_lens = {512, 2048, 8192};
  std::vector<std::string> decode_cases = {"1x128", "8x128", "64x128", "256x128", "1x2048", "64x2048"};
  double gpu_memory_utilization = 0.9;
  std::string transformers_python = "python3";
  std::string transformers_script;  // default: scripts/bench_engine_transformers.py near cwd or the binary
  bool no_transformers = false;
  bool batch_invariant = false;
  bool enforce_eager = false;
  // --device cuda, the decode steps' sampling (default greedy), and where.
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  bool host_sampling = false;
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

SamplingParams Greedy() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

// Per-sequence token arrival times of `prompts` run together (`sampling`,
// greedy by default; `max_tokens` each, EOS ignored).
absl::StatusOr<std::vector<std::vector<Clock::time_point>>> RunTimed(Engine& engine,
                                                                     const std::vector<std::vector<int32_t>>& prompts,
                                                                     int max_tokens,
                                                                     const SamplingParams& sampling = Greedy()) {
  std::vector<std::shared_ptr<TimingSink>> sinks;
  for (const auto& p : prompts) {
    auto sink = std::make_shared<TimingSink>();
    GenerateSpec spec{.request_id = "bench", .prompt = p, .params = sampling};
    spec.params.max_tokens = max_tokens;
    spec.params.ignore_eos = true;
    RETURN_IF_ERROR(engine.Submit(std::move(spec), sink).status());
    sinks.push_back(sink);
  }
  std::vector<std::vector<Clock::time_point>> out;
  for (auto& s : sinks) {
    s->Wait();
    if (s->info().reason == FinishReason::kError) return absl::InternalError(s->info().error);
    out.push_back(s->times());
  }
  return out;
}

absl::StatusOr<RunResult> RunBatch(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
  const Clock::time_point start = Clock::now();
  ASSIGN_OR_RETURN(auto times, RunTimed(engine, prompts, max_tokens));
  RunResult r;
  Clock::time_point end = start;
  for (const auto& t : times) {
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

// A decode step's duration: the median gap between consecutive tokens of
// any sequence, over the window where every sequence was decoding (after the
// last first token, before the first last token), so prefill steps count
// nowhere.
double DecodeStepSeconds(const std::vector<std::vector<Clock::time_point>>& times) {
  Clock::time_point t0 = Clock::time_point::min(), t1 = Clock::time_point::max();
  for (const auto& t : times) {
    if (t.empty()) continue;
    t0 = std::max(t0, t.front());
    t1 = std::min(t1, t.back());
  }
  std::vector<double> gaps;
  for (const auto& t : times) {
    for (size_t i = 1; i < t.size(); ++i) {
      if (t[i - 1] >= t0 && t[i] <= t1) gaps.push_back(Seconds(t[i - 1], t[i]));
    }
  }
  if (gaps.empty()) {  // no common window (one step): every gap
    for (const auto& t : times) {
      for (size_t i = 1; i < t.size(); ++i) gaps.push_back(Seconds(t[i - 1], t[i]));
    }
  }
  return gaps.empty() ? std::nan("") : Median(gaps);
}

// The transformers helper's JSON (scripts/bench_engine_transformers.py), or
// {"available": false, "why": ...}.
nlohmann::json TransformersBaselines(const BenchOptions& opt) {
  using nlohmann::json;
  if (opt.no_transformers) return {{"available", false}, {"why", "--no-transformers"}};
  if (!std::filesystem::is_directory(opt.model)) {
    return {{"available", false}, {"why", "--model is not a checkpoint directory transformers can load"}};
  }
  const std::string script = FindHelperScript(opt.transformers_script, "bench_engine_transformers.py");
  if (!std::filesystem::exists(script)) {
    return {{"available", false},
            {"why", absl::StrCat("the transformers helper ", script, " was not found (--transformers-script)")}};
  }
  const std::string cmd =
      absl::StrCat(opt.transformers_python, " ", ShellQuote(script), " --model ", ShellQuote(opt.model),
                   " --prefill-lens ", absl::StrJoin(opt.prefill_lens, ","), " --decode ",
                   ShellQuote(absl::StrJoin(opt.decode_cases, ",")), " --repeats ", opt.repeats);
  std::fprintf(stderr, "bench engine: transformers baselines: %s\n", cmd.c_str());
  return RunJsonHelper(cmd);
}

absl::StatusOr<std::pair<int, int>> ParseDecodeCase(const std::string& c) {
  std::pair<int, int> bc;
  const size_t x = c.find('x');
  if (x == std::string::npos || !absl::SimpleAtoi(c.substr(0, x), &bc.first) ||
      !absl::SimpleAtoi(c.substr(x + 1), &bc.second) || bc.first < 1 || bc.second < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--decode: '", c, "' is not BATCHxCONTEXT (e.g. 64x2048)"));
  }
  return bc;
}

// The GPU engine against the device's own limits and transformers, on
// --model (a checkpoint directory for the transformers column).
absl::Status RunGpuBench(const BenchOptions& opt, const EngineConfig& base) {
  using nlohmann::json;
  std::vector<std::pair<int, int>> cases;
  for (const std::string& c : opt.decode_cases) {
    ASSIGN_OR_RETURN(auto bc, ParseDecodeCase(c));
    cases.push_back(bc);
  }
  ASSIGN_OR_RETURN(DeviceRates rates, MeasureDeviceRates(base.runner_options.device));
  const json hf = TransformersBaselines(opt);  // before our engine takes the memory
  ASSIGN_OR_RETURN(LoadedModel loaded, LoadModel(opt.model));
  const ModelConfig config = loaded.config;
  SamplingParams sampling = Greedy();
  sampling.temperature = opt.temperature;
  sampling.top_p = opt.top_p;
  sampling.top_k = opt.top_k;
  if (absl::Status st = ValidateSamplingParams(sampling, config.vocab_size); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--temperature/--top-p/--top-k: ", st.message()));
  }
  EngineConfig ec = base;
  ec.gpu_memory_utilization = opt.gpu_memory_utilization;
  int max_batch = 1;
  for (auto [b, c] : cases) max_batch = std::max(max_batch, b);
  int max_prefill = 0;
  for (int n : opt.prefill_lens) max_prefill = std::max(max_prefill, n);
  ec.max_batched_tokens = std::max(8192, max_prefill);
  ec.max_running = std::max(ec.max_running, max_batch);
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(ec, std::move(loaded)));
  engine->Start();
  std::mt19937 rng(2024);
  RETURN_IF_ERROR(RunBatch(*engine, {RandomPrompt(rng, 64, config.vocab_size)}, 4).status());  // warm-up
  const int64_t capacity = engine->total_blocks() * ec.block_size;
  const double weight_bytes = 2.0 * double(ParameterCount(config));
  const double kv_bytes_per_token = 2.0 * 2.0 * config.num_layers * config.num_kv_heads * double(config.head_dim);

  // With --json the table goes to stderr and stdout holds only the JSON.
  FILE* table = opt.json ? stderr : stdout;
  json out = {{"model", opt.model},
              {"device", rates.name},
              {"batch_invariant", opt.batch_invariant},
              {"cuda_graphs", !opt.enforce_eager},
              {"decode_sampling",
               {{"temperature", opt.temperature},
                {"top_p", opt.top_p},
                {"top_k", opt.top_k},
                {"on", opt.host_sampling ? "host" : "gpu"}}},
              {"bf16_matmul_tflops", rates.bf16_flops / 1e12},
              {"copy_gb_per_s", rates.copy_bytes_per_s / 1e9},
              {"kv_cache_tokens", capacity},
              {"transformers", hf},
              {"prefill", json::array()},
              {"decode", json::array()}};
  std::fprintf(table, "tandem bench engine: %s on %s (%s)%s%s\n", opt.model.c_str(), opt.device.c_str(),
               rates.name.c_str(), opt.batch_invariant ? ", batch-invariant" : "",
               opt.enforce_eager ? ", eager (no CUDA graphs)" : "");
  if (opt.temperature > 0.0f) {
    std::fprintf(table, "  decode sampling: temperature %g, top_p %g, top_k %d, on the %s\n", opt.temperature,
                 opt.top_p, opt.top_k, opt.host_sampling ? "host" : "GPU");
  }
  std::fprintf(table, "  device: bf16 matmul %.0f TFLOP/s, copy %.0f GB/s (read + written); KV cache %lld tokens\n",
               rates.bf16_flops / 1e12, rates.copy_bytes_per_s / 1e9, static_cast<long long>(capacity));
  if (!hf.value("available", false)) {
    std::fprintf(table, "  transformers: n/a (%s)\n", hf.value("why", std::string("?")).c_str());
  }
  std::fprintf(table, "  %-8s %10s %12s %9s %9s %12s %9s\n", "prefill", "ms", "tok/s", "TFLOP/s", "x peak", "hf ms",
               "x hf");
  for (int n : opt.prefill_lens) {
    if (n + 1 > engine->max_model_len()) {
      std::fprintf(table, "  %-8d n/a: longer than the model's context\n", n);
      continue;
    }
    std::vector<double> t;
    for (int r = 0; r < opt.repeats; ++r) {
      ASSIGN_OR_RETURN(RunResult res, RunBatch(*engine, {RandomPrompt(rng, n, config.vocab_size)}, 1));
      t.push_back(res.first_token[0]);
    }
    const double s = Median(t);
    const double flops = engine->runner().Flops(n, int64_t{n} * (n + 1) / 2, 1) / s;
    const json hf_ms = hf.value("prefill_ms", json::object()).value(std::to_string(n), json());
    json row = {{"tokens", n},
                {"ms", s * 1e3},
                {"tokens_per_s", n / s},
                {"tflops", flops / 1e12},
                {"ratio_to_peak", flops / rates.bf16_flops},
                {"transformers_ms", hf_ms}};
    std::fprintf(table, "  %-8d %10.2f %12.0f %9.1f %9.2f", n, s * 1e3, n / s, flops / 1e12, flops / rates.bf16_flops);
    if (hf_ms.is_number()) {
      row["speedup_vs_transformers"] = hf_ms.get<double>() / (s * 1e3);
      std::fprintf(table, " %12.2f %9.2f\n", hf_ms.get<double>(), hf_ms.get<double>() / (s * 1e3));
    } else {
      std::fprintf(table, " %12s %9s\n", "n/a", "");
    }
    out["prefill"].push_back(row);
  }
  std::fprintf(table, "  %-10s %10s %12s %12s %9s %12s %9s\n", "decode", "step ms", "tok/s", "bound ms", "x bound",
               "hf ms", "x hf");
  const int steps = std::max(8, opt.decode_tokens);
  for (auto [batch, context] : cases) {
    const std::string name = absl::StrCat(batch, "x", context);
    if (int64_t{batch} * (context + steps + ec.block_size) > capacity) {
      std::fprintf(table, "  %-10s n/a: needs %lld KV tokens, the cache holds %lld\n", name.c_str(),
                   static_cast<long long>(int64_t{batch} * (context + steps)), static_cast<long long>(capacity));
      continue;
    }
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < batch; ++i) prompts.push_back(RandomPrompt(rng, context, config.vocab_size));
    ASSIGN_OR_RETURN(auto times, RunTimed(*engine, prompts, steps + 1, sampling));
    const double step = DecodeStepSeconds(times);
    const double bound = (weight_bytes + batch * (context + steps / 2.0) * kv_bytes_per_token) / rates.copy_bytes_per_s;
    const json hf_ms = hf.value("decode_step_ms", json::object()).value(name, json());
    json row = {{"batch", batch},
                {"context", context},
                {"step_ms", step * 1e3},
                {"tokens_per_s", batch / step},
                {"memory_bound_ms", bound * 1e3},
                {"ratio_to_bound", step / bound},
                {"transformers_step_ms", hf_ms}};
    std::fprintf(table, "  %-10s %10.3f %12.0f %12.3f %9.2f", name.c_str(), step * 1e3, batch / step, bound * 1e3,
                 step / bound);
    if (hf_ms.is_number()) {
      row["speedup_vs_transformers"] = hf_ms.get<double>() / (step * 1e3);
      std::fprintf(table, " %12.2f %9.2f\n", hf_ms.get<double>(), hf_ms.get<double>() / (step * 1e3));
    } else {
      std::fprintf(table, " %12s %9s\n", "n/a", "");
    }
    out["decode"].push_back(row);
  }
  engine->Stop();
  if (opt.json) std::printf("%s\n", out.dump(2).c_str());
  return absl::OkStatus();
}

absl::Status RunBench(const BenchOptions& opt) {
  if (opt.device != "cpu") {
    EngineConfig ec;
    ec.enable_prefix_caching = false;  // every prefill computes its whole prompt
    RETURN_IF_ERROR(SelectDevice(opt.device, &ec.runner, &ec.runner_options));
    ec.runner_options.batch_invariant = opt.batch_invariant;
    ec.runner_options.cuda_graphs = !opt.enforce_eager;
    ec.runner_options.gpu_sampling = !opt.host_sampling;
    return RunGpuBench(opt, ec);
  }
  // The GPU bench's switches would be ignored here: refused, by name.
  const std::pair<bool, const char*> gpu_only[] = {
      {opt.batch_invariant, "--batch-invariant"},
      {opt.enforce_eager, "--enforce-eager"},
      {opt.host_sampling, "--host-sampling"},
      {opt.temperature != 0.0f, "--temperature"},
      {opt.top_p != 1.0f, "--top-p"},
      {opt.top_k != 0, "--top-k"},
  };
  for (const auto& [set, flag] : gpu_only) {
    if (set) return absl::InvalidArgumentError(absl::StrCat(flag, " applies to --device cuda only"));
  }
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
  cmd->add_option("--prefill-lens", opt->prefill_lens, "--device cuda: prompt lengths of the prefill runs")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--decode", opt->decode_cases, "--device cuda: BATCHxCONTEXT decode cases")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--gpu-memory-utilization", opt->gpu_memory_utilization,
                  "--device cuda: the fraction of GPU memory the engine may use")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_option("--transformers-python", opt->transformers_python, "Python that runs the transformers baselines")
      ->capture_default_str();
  cmd->add_option("--transformers-script", opt->transformers_script,
                  "The baselines' script (default: scripts/bench_engine_transformers.py)");
  cmd->add_flag("--no-transformers", opt->no_transformers, "Skip the transformers baselines");
  cmd->add_flag("--batch-invariant", opt->batch_invariant, "--device cuda: the batch-invariant mode (tandem worker)");
  cmd->add_flag("--enforce-eager", opt->enforce_eager,
                "--device cuda: no CUDA graphs for decode steps (tandem worker)");
  cmd->add_option("--temperature", opt->temperature, "--device cuda: the decode steps' temperature (0: greedy)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 2.0));
  cmd->add_option("--top-p", opt->top_p, "--device cuda: the decode steps' top_p")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--top-k", opt->top_k, "--device cuda: the decode steps' top_k (0: off)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--host-sampling", opt->host_sampling,
                "--device cuda: sample every row on the host instead of the GPU (tandem worker)");
  cmd->callback([opt] { ExitWithStatus("bench engine", RunBench(*opt)); });
}

}  // namespace tandem::worker
