// The cuda runner against the CPU runner (f32, the reference) and against
// itself (one-pass prefill = chunked prefill = token by token; a batch
// changes no sequence's greedy output), and the engine serving from a
// device pool. Skips (with the reason) where no Hopper GPU or no cuBLASLt
// is found: CI has neither.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_hash.h"
#include "kernels/paged_attention.h"
#include "worker/engine/engine.h"
#include "worker/model/builtin_models.h"
#include "worker/model/model_loader.h"
#include "worker/model/safetensors.h"
#include "worker/runner/cuda/gpu_test_support.h"
#include "worker/runner/cuda/lt_gemm.h"
#include "worker/runner/cuda/model_kernels.h"
#include "worker/runner/model_runner.h"

namespace tandem::worker {
namespace {

// As a worker with the NCCL transport runs (worker_command.cc): every kernel
// loaded when CUDA starts, since under lazy loading the first launch of a
// kernel waits for the whole device (StepsNeverWaitForOtherStreamsWork
// failed so on an H200: a cuBLASLt product of a new shape, the prefill
// kernel's long-context variant). Set before main, so before CUDA starts.
// (Unless the environment chose a mode: both pass on an H200 since the
// runner preloads the products' kernels.)
const bool kEagerModuleLoading = [] {
  return std::getenv("CUDA_MODULE_LOADING") == nullptr && setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0;
}();

using ::testing::HasSubstr;

// Seeded weights rounded to bfloat16 and stored so (as a bf16 checkpoint
// is): the cpu runner reads them widened to f32, exactly, and the cuda runner
// uploads them as they are, so both run the same model and what differs is
// only the arithmetic.
class Bf16Source : public TensorSource {
 public:
  // Tied embeddings are drawn at lm_head's scale (the seeded presets draw
  // embeddings at std 1, which as an output matrix gives logits ~8x a real
  // model's, and errors in proportion).
  Bf16Source(const ModelConfig& config, uint64_t seed)
      : seeded_(config, seed, "seeded test model (bf16)"),
        embed_scale_(config.tie_word_embeddings ? 3.0 / std::sqrt(double(config.hidden_size)) : 1.0) {}
  absl::StatusOr<Tensor> Get(const std::string& name) const override {
    absl::StatusOr<Tensor> t = seeded_.Get(name);
    if (t.ok()) {
      const float scale = name == "model.embed_tokens.weight" ? static_cast<float>(embed_scale_) : 1.0f;
      for (float& v : t->data) v = BFloat16ToFloat(FloatToBFloat16(v * scale));
    }
    return t;
  }
  absl::StatusOr<StoredTensor> GetStored(const std::string& name) const override {
    absl::StatusOr<Tensor> t = Get(name);
    if (!t.ok()) return t.status();
    auto bits = std::make_shared<std::vector<uint16_t>>();
    for (float v : t->data) bits->push_back(FloatToBFloat16(v));
    StoredTensor out{
        .shape = t->shape,
        .dtype = WeightDtype::kBF16,
        .bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bits->data()), bits->size() * 2)};
    out.owner = std::move(bits);
    return out;
  }
  absl::StatusOr<std::vector<int64_t>> StoredShape(const std::string& name) const override {
    return seeded_.StoredShape(name);
  }
  bool Has(const std::string& name) const override { return seeded_.Has(name); }
  std::string Describe() const override { return seeded_.Describe(); }

 private:
  SeededTensorSource seeded_;
  double embed_scale_;
};

// A runner named `name` over `config` with seeded bf16 weights, or the reason
// the GPU side cannot run here.
absl::StatusOr<std::unique_ptr<ModelRunner>> MakeRunner(const std::string& name, const ModelConfig& config,
                                                        uint64_t seed, bool batch_invariant = false,
                                                        bool cuda_graphs = true, bool bf16_logits = false) {
  RunnerOptions o;
  o.batch_invariant = batch_invariant;
  o.cuda_graphs = cuda_graphs;
  o.bf16_logits = bf16_logits;
  return ModelRunnerRegistry::Builtin().Create(name, config, std::make_shared<Bf16Source>(config, seed), o);
}

ModelConfig SmallConfig() {
  absl::StatusOr<ModelConfig> c = BuiltinModelConfig("small");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// The variants the GPU engine must serve: Llama 3 (llama3 RoPE, GQA), tied
// embeddings, Qwen2 (QKV biases), Llama with every bias.
std::map<std::string, ModelConfig> Variants() {
  std::map<std::string, ModelConfig> v;
  ModelConfig llama = SmallConfig();
  v["llama3"] = llama;
  ModelConfig tied = llama;
  tied.tie_word_embeddings = !llama.tie_word_embeddings;
  v["tied-toggled"] = tied;
  ModelConfig qwen = llama;
  qwen.architecture = "Qwen2ForCausalLM";
  qwen.qkv_bias = true;
  qwen.rope = RopeConfig{};
  qwen.rope.theta = 1000000.0;
  v["qwen2"] = qwen;
  ModelConfig biased = llama;
  biased.qkv_bias = biased.o_bias = biased.mlp_bias = true;
  v["llama-biases"] = biased;
  return v;
}

// One pool for `runner`, of `blocks` blocks of 16 tokens.
std::unique_ptr<KvStorage> Pool(ModelRunner& runner, int64_t blocks) {
  kernels::KvLayout layout = runner.KvBlockLayout(16);
  layout.num_blocks = blocks;
  absl::StatusOr<std::unique_ptr<KvStorage>> kv = KvStorage::Create(layout, runner.KvAllocator());
  EXPECT_TRUE(kv.ok()) << kv.status();
  return kv.ok() ? *std::move(kv) : nullptr;
}

// Runs `tokens` of one sequence through `runner` in chunks of `chunk`
// (blocks 0, 1, ... in order) and returns every position's sample with 20
// top logprobs, greedy.
std::vector<SampledToken> TeacherForced(ModelRunner& runner, KvStorage& kv, const std::vector<int>& tokens, int chunk) {
  SamplingParams params;
  params.temperature = 0.0f;
  params.logprobs = 20;
  std::vector<SampledToken> all;
  const int n = static_cast<int>(tokens.size());
  const int blocks = (n + 15) / 16;
  for (int start = 0; start < n; start += chunk) {
    const int end = std::min(n, start + chunk);
    BatchInput in;
    in.Clear();
    for (int t = start; t < end; ++t) {
      in.tokens.push_back(tokens[t]);
      in.positions.push_back(t);
      in.slot_mapping.push_back(t);  // block t / 16, slot t % 16
      in.logits_rows.push_back(t - start);
    }
    in.query_start = {0, end - start};
    in.context_lens = {end};
    in.prefilling = {1};
    in.max_blocks_per_seq = blocks;
    for (int b = 0; b < blocks; ++b) in.block_tables.push_back(b);
    in.prefill_tokens = end - start;
    std::vector<RowSampling> rows;
    for (int t = start; t < end; ++t) {
      rows.push_back({.params = &params, .prompt = std::span<const int>(tokens.data(), t + 1), .position = t + 1});
    }
    std::vector<SampledToken> out;
    absl::Status s = runner.Step(in, rows, kv, &out);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return {};
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

struct Agreement {
  double top1 = 0;          // fraction of positions whose top token agrees
  double max_diff = 0;      // largest |logprob difference| over tokens both top-20s hold
  double min_overlap = 20;  // fewest tokens the two top-20s share at a position
  double max_tie_gap = 0;   // where the top tokens differ: by how much the first preferred its own
};

Agreement Compare(const std::vector<SampledToken>& a, const std::vector<SampledToken>& b) {
  Agreement r;
  if (a.size() != b.size() || a.empty()) return Agreement{.top1 = -1};
  int same = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    same += a[i].token_id == b[i].token_id;
    std::map<int, float> lb;
    for (const TokenLogprob& t : b[i].top_logprobs) lb[t.token_id] = t.logprob;
    if (a[i].token_id != b[i].token_id) {
      float other = -1e30f;  // a's logprob of b's choice
      for (const TokenLogprob& t : a[i].top_logprobs) {
        if (t.token_id == b[i].token_id) other = t.logprob;
      }
      r.max_tie_gap = std::max(r.max_tie_gap, double(a[i].logprob - other));
    }
    int overlap = 0;
    for (const TokenLogprob& t : a[i].top_logprobs) {
      auto it = lb.find(t.token_id);
      if (it == lb.end()) continue;
      ++overlap;
      r.max_diff = std::max(r.max_diff, double(std::fabs(t.logprob - it->second)));
    }
    r.min_overlap = std::min(r.min_overlap, double(overlap));
  }
  r.top1 = double(same) / a.size();
  return r;
}

std::vector<int> RandomTokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<int> t(n);
  for (int& x : t) x = d(rng);
  return t;
}

// Sequence s owns blocks s * blocks_per_seq on (slots from s * blocks_per_seq
// * 16: blocks of 16 tokens).
int64_t SlotOf(int s, int blocks_per_seq, int position) { return int64_t{s} * blocks_per_seq * 16 + position; }

// A step prefilling sequence s's whole prompt `tokens` in one chunk, its
// last row sampled (`rows`: its sampling).
BatchInput PromptStep(const std::vector<int>& tokens, int s, int blocks_per_seq, const SamplingParams* params,
                      std::vector<RowSampling>* rows) {
  const int n = static_cast<int>(tokens.size());
  BatchInput in;
  in.Clear();
  for (int t = 0; t < n; ++t) {
    in.tokens.push_back(tokens[t]);
    in.positions.push_back(t);
    in.slot_mapping.push_back(SlotOf(s, blocks_per_seq, t));
  }
  in.logits_rows = {n - 1};
  in.query_start = {0, n};
  in.context_lens = {n};
  in.prefilling = {1};
  in.prefill_tokens = n;
  in.max_blocks_per_seq = blocks_per_seq;
  for (int b = 0; b < blocks_per_seq; ++b) in.block_tables.push_back(s * blocks_per_seq + b);
  *rows = {{.params = params, .prompt = tokens, .position = n}};
  return in;
}

// A decode step of sequences 0 to n - 1, each feeding its newest token
// (tokens[s].back(), at position tokens[s].size() - 1), block tables
// `width` wide.
BatchInput DecodeStep(const std::vector<std::vector<int>>& tokens, int n, int blocks_per_seq, int width,
                      const SamplingParams* params, std::vector<RowSampling>* rows) {
  BatchInput in;
  in.Clear();
  in.max_blocks_per_seq = width;
  in.query_start.push_back(0);
  rows->clear();
  for (int s = 0; s < n; ++s) {
    const int t = static_cast<int>(tokens[s].size()) - 1;
    in.tokens.push_back(tokens[s][t]);
    in.positions.push_back(t);
    in.slot_mapping.push_back(SlotOf(s, blocks_per_seq, t));
    in.logits_rows.push_back(s);
    in.query_start.push_back(s + 1);
    in.context_lens.push_back(t + 1);
    for (int b = 0; b < width; ++b) in.block_tables.push_back(s * blocks_per_seq + b);
    rows->push_back({.params = params, .prompt = tokens[s], .position = t + 1});
  }
  in.decode_seqs = n;
  return in;
}

TEST(CudaRunnerTest, RefusesToStartWithoutAGpuAndSaysWhy) {
  const char* why = nullptr;
  if (kernels::cuda::Available(&why)) GTEST_SKIP() << "a GPU is present";
  absl::StatusOr<std::unique_ptr<ModelRunner>> r = MakeRunner("cuda", SmallConfig(), 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--device cuda"));
}

TEST(CudaRunnerTest, TeacherForcedLogprobsMatchTheCpuRunner) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  for (const auto& [variant, config] : Variants()) {
    SCOPED_TRACE(variant);
    absl::StatusOr<std::unique_ptr<ModelRunner>> cpu = MakeRunner("cpu", config, 7);
    absl::StatusOr<std::unique_ptr<ModelRunner>> gpu = MakeRunner("cuda", config, 7);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    const std::vector<int> tokens = RandomTokens(300, config.vocab_size, 11);
    std::unique_ptr<KvStorage> cpu_kv = Pool(**cpu, 32), gpu_kv = Pool(**gpu, 32);
    ASSERT_EQ(gpu_kv->location(), MemoryLocation::kDevice);
    ASSERT_EQ(gpu_kv->dtype(), kernels::DType::kBF16);
    const Agreement a = Compare(TeacherForced(**cpu, *cpu_kv, tokens, 300), TeacherForced(**gpu, *gpu_kv, tokens, 300));
    std::printf(
        "%s: top-1 agreement %.4f, max |logprob diff| %.4f, min top-20 overlap %.0f, widest gap where the "
        "top tokens differ %.4f\n",
        variant.c_str(), a.top1, a.max_diff, a.min_overlap, a.max_tie_gap);
    // bf16 activations against f32 (same bf16 weights); measured on an H200
    // (2026-11-27): top-1 0.98-1.0, max diff 0.08-0.10, overlap >= 18, and
    // the top tokens differ only at near-ties. A wrong RoPE, mask or bias
    // moves logprobs by whole units.
    EXPECT_GE(a.top1, 0.975);
    EXPECT_LE(a.max_diff, 0.15);
    EXPECT_GE(a.min_overlap, 17);
    EXPECT_LE(a.max_tie_gap, 0.15);
  }
}

// Prompt rows stay on the prefill kernel; with --batch-invariant every
// product's rows are also independent of the others, so chunking a prompt
// changes no bit. Without it the products' algorithms follow the row count:
// chunking then moves logprobs within the engine's precision (the bound of
// TeacherForcedLogprobsMatchTheCpuRunner).
TEST(CudaRunnerTest, OnePassChunkedAndTokenByTokenAgree) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  const ModelConfig config = SmallConfig();
  for (bool invariant : {true, false}) {
    SCOPED_TRACE(invariant ? "batch-invariant" : "default");
    absl::StatusOr<std::unique_ptr<ModelRunner>> gpu = MakeRunner("cuda", config, 3, invariant);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    const std::vector<int> tokens = RandomTokens(260, config.vocab_size, 5);
    std::unique_ptr<KvStorage> kv = Pool(**gpu, 32);
    const std::vector<SampledToken> one = TeacherForced(**gpu, *kv, tokens, 260);
    // (Chunks of 5: prefill steps on the tensor-core products with their
    // epilogues fused, LaunchGemvMmaFused.)
    for (int chunk : {37, 64, 5, 1}) {
      SCOPED_TRACE(chunk);
      const Agreement a = Compare(one, TeacherForced(**gpu, *kv, tokens, chunk));
      std::printf("%s, chunks of %d: top-1 agreement %.4f, max |logprob diff| %.6f\n",
                  invariant ? "batch-invariant" : "default", chunk, a.top1, a.max_diff);
      if (invariant) {
        EXPECT_EQ(a.top1, 1.0);
        EXPECT_EQ(a.max_diff, 0.0);
      } else {
        EXPECT_GE(a.top1, 0.975);
        EXPECT_LE(a.max_diff, 0.15);
        EXPECT_LE(a.max_tie_gap, 0.15);
      }
    }
  }
}

// --logits-dtype bfloat16: every logit is the float32 runner's rounded to
// bfloat16 (the same weights and inputs; nothing else differs), at every
// prompt position; and steps sample from the rounded logits.
TEST(CudaRunnerTest, Bf16LogitsAreTheFloat32LogitsRounded) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  const ModelConfig config = SmallConfig();
  // Batch-invariant runners: their products' algorithms are fixed, so the
  // two float32 forward passes are the same bits.
  absl::StatusOr<std::unique_ptr<ModelRunner>> f32 = MakeRunner("cuda", config, 4, true);
  absl::StatusOr<std::unique_ptr<ModelRunner>> bf16 = MakeRunner("cuda", config, 4, true, true, true);
  ASSERT_TRUE(f32.ok() && bf16.ok());
  const std::vector<int> tokens = RandomTokens(40, config.vocab_size, 8);
  std::vector<RowSampling> rows;
  BatchInput in = PromptStep(tokens, 0, 4, nullptr, &rows);
  in.logits_rows.clear();
  for (int t = 0; t < static_cast<int>(tokens.size()); ++t) in.logits_rows.push_back(t);
  std::vector<float> logits[2];
  for (int r = 0; r < 2; ++r) {
    ModelRunner& runner = r == 0 ? **f32 : **bf16;
    std::unique_ptr<KvStorage> kv = Pool(runner, 4);
    const absl::Status st = runner.Logits(in, *kv, &logits[r]);
    ASSERT_TRUE(st.ok()) << st;
  }
  ASSERT_EQ(logits[0].size(), size_t(tokens.size()) * config.vocab_size);
  ASSERT_EQ(logits[1].size(), logits[0].size());
  size_t moved = 0;
  for (size_t i = 0; i < logits[0].size(); ++i) {
    const float rounded = __bfloat162float(__float2bfloat16(logits[0][i]));
    ASSERT_EQ(logits[1][i], rounded) << "logit " << i << " (float32 " << logits[0][i] << ")";
    moved += rounded != logits[0][i];
  }
  EXPECT_GT(moved, logits[0].size() / 2) << "the float32 logits were already bfloat16 values";
  // Steps of a rounded runner: its prompt step and decode steps of one
  // token (the one-row GEMV head). Each step's greedy token and logprob are
  // those of the rounded logits Logits gives for the same batch, and every
  // logit is a bfloat16 value. (Launched one by one, as Logits runs: a
  // decode graph plans attention's splits for its block-table width, and a
  // float32 bit apart may round to another bfloat16 value.)
  absl::StatusOr<std::unique_ptr<ModelRunner>> eager = MakeRunner("cuda", config, 4, false, false, true);
  ASSERT_TRUE(eager.ok()) << eager.status();
  ModelRunner& runner = **eager;
  std::unique_ptr<KvStorage> kv = Pool(runner, 4);
  SamplingParams params;
  params.temperature = 0.0f;
  params.logprobs = 5;
  std::vector<std::vector<int>> seq = {tokens};
  auto check = [&](const BatchInput& step, const std::vector<RowSampling>& step_rows) {
    std::vector<float> lg;
    const absl::Status got = runner.Logits(step, *kv, &lg);
    ASSERT_TRUE(got.ok()) << got;
    ASSERT_EQ(lg.size(), size_t(config.vocab_size));
    for (size_t i = 0; i < lg.size(); ++i) ASSERT_EQ(lg[i], __bfloat162float(__float2bfloat16(lg[i]))) << i;
    std::vector<SampledToken> out;
    const absl::Status st = runner.Step(step, step_rows, *kv, &out);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(out.size(), 1u);
    // The first of the largest (ties go to the lower id, as the samplers break them).
    const int top = static_cast<int>(std::max_element(lg.begin(), lg.end()) - lg.begin());
    EXPECT_EQ(out[0].token_id, top) << "the greedy token of the rounded logits";
    double norm = 0;
    for (float v : lg) norm += std::exp(double(v) - lg[top]);
    EXPECT_NEAR(out[0].logprob, -std::log(norm), 1e-4) << "its logprob, from the rounded logits";
    seq[0].push_back(out[0].token_id);
  };
  std::vector<RowSampling> step_rows;
  {
    SCOPED_TRACE("the prompt step");
    check(PromptStep(tokens, 0, 4, &params, &step_rows), step_rows);
  }
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(testing::Message() << "decode step " << i);
    check(DecodeStep(seq, 1, 4, 4, &params, &step_rows), step_rows);
  }
}

// True when `call` returns within `limit` while work on another stream
// waits: a host function that returns only once `call` did or the limit
// passed, standing in for an NCCL receive posted on the GPU until its peer
// sends (anything that waits for the whole device waits for it).
bool ReturnsBesideABlockedStream(const std::function<void()>& call, std::chrono::seconds limit) {
  cudaStream_t other = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  EXPECT_EQ(cudaLaunchHostFunc(
                other, [](void* f) { static_cast<std::shared_future<void>*>(f)->wait(); }, &released),
            cudaSuccess);
  std::future<void> done = std::async(std::launch::async, call);
  const bool returned = done.wait_for(limit) == std::future_status::ready;
  release.set_value();
  done.get();
  EXPECT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  cudaStreamDestroy(other);
  return returned;
}

// Steps never wait for work of other streams on the device. The NCCL KV
// transport keeps a receive posted on the GPU while a hand-off is open, and
// it completes only when the peer sends: a step that waits for the whole
// device (cudaFree did, as buffers grew) hangs with it; found on two H200s
// (a decode worker's local prefill after its push was refused waited until
// the next push came). Here the posted receive is a host function on a
// stream of the test's that returns only when the test lets it. Two
// checks: steps of shapes the runner ran before (the steady state), and
// steps of new, longer prompts (new product shapes, new attention splits;
// the buffers were sized by ReserveSteps, as the engine does).
TEST(CudaRunnerTest, StepsNeverWaitForOtherStreamsWork) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  const ModelConfig config = SmallConfig();
  for (bool invariant : {false, true}) {
    SCOPED_TRACE(invariant ? "batch-invariant" : "default");
    absl::StatusOr<std::unique_ptr<ModelRunner>> gpu = MakeRunner("cuda", config, 3, invariant);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    std::unique_ptr<KvStorage> kv = Pool(**gpu, 64);
    ASSERT_NE(kv, nullptr);
    ASSERT_TRUE((*gpu)->ReserveSteps(1024, 1024, 64).ok());  // as the engine does
    ASSERT_TRUE((*gpu)->WarmUp(*kv, 1024, 64).ok());
    auto run = [&](std::vector<int> lengths) {
      size_t sampled = 0;
      for (int n : lengths) sampled += TeacherForced(**gpu, *kv, RandomTokens(n, config.vocab_size, n), n).size();
      return sampled;
    };
    // True when `lengths` ran to the end while another stream's work waited.
    auto beside_a_blocked_stream = [&](std::vector<int> lengths) {
      size_t sampled = 0;
      const bool finished = ReturnsBesideABlockedStream([&] { sampled = run(lengths); }, std::chrono::seconds(20));
      size_t want = 0;
      for (int n : lengths) want += static_cast<size_t>(n);
      EXPECT_EQ(sampled, want);
      return finished;
    };
    EXPECT_EQ(run({8, 100}), size_t{108});
    EXPECT_TRUE(beside_a_blocked_stream({8, 100})) << "a step of shapes run before waited for another stream";
    EXPECT_TRUE(beside_a_blocked_stream({400, 900})) << "a step of new shapes waited for another stream";
  }
}

// The calls a step makes the first time it meets a shape, one by one beside
// a blocked stream (as above): which of them wait for other streams' work.
// cudaFree must (the control: it shows that the stand-in holds what an NCCL
// receive holds); none of the others may. (cudaFreeHost waits too, on an
// H200: pinned buffers keep their earlier allocations, cuda_buffers.h.) A
// cuBLASLt product whose algorithm was never launched waits too, eager
// module loading or not (H200): the runner launches every algorithm its
// products can take before serving (LtGemm::Preload), so a product of a new
// row count must not wait; whether one of an unplanned shape does is
// printed.
TEST(CudaRunnerTest, FirstUseCallsNeverWaitForOtherStreamsWork) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto returns = [](const std::function<void()>& call) {
    return ReturnsBesideABlockedStream(call, std::chrono::seconds(3));
  };
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  constexpr int kK = 4096, kN = 4096, kM = 777;
  void *x = nullptr, *w = nullptr, *y = nullptr, *ws = nullptr;
  ASSERT_EQ(cudaMalloc(&x, size_t{kM} * kK * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&w, size_t{kN} * kK * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&y, size_t{kM} * kN * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&ws, 32 << 20), cudaSuccess);
  absl::StatusOr<std::unique_ptr<LtGemm>> gemm = LtGemm::Create(ws, 32 << 20);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  std::vector<char> pageable(1 << 20);
  void* pinned = nullptr;
  void* pooled = nullptr;
  void* plain = nullptr;
  ASSERT_EQ(cudaMalloc(&plain, 1 << 20), cudaSuccess);
  absl::StatusOr<int> algorithms = (*gemm)->Preload(x, kM, kK, w, kN, y, LtGemm::Out::kF32, s);
  ASSERT_TRUE(algorithms.ok()) << algorithms.status();
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  std::printf("%d cuBLASLt algorithms for 1 to %d rows of a %dx%d product\n", *algorithms, kM, kN, kK);
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"cudaMemcpyAsync from pageable memory",
       [&] {
         cudaMemcpyAsync(x, pageable.data(), pageable.size(), cudaMemcpyHostToDevice, s);
         cudaStreamSynchronize(s);
       }},
      {"cudaEventCreate and record",
       [&] {
         cudaEvent_t e = nullptr;
         cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
         cudaEventRecord(e, s);
         cudaEventSynchronize(e);
         cudaEventDestroy(e);
       }},
      {"cudaMallocAsync growing the pool",
       [&] {
         cudaMallocAsync(&pooled, size_t{256} << 20, s);
         cudaStreamSynchronize(s);
       }},
      {"cudaFreeAsync",
       [&] {
         cudaFreeAsync(pooled, s);
         cudaStreamSynchronize(s);
       }},
      {"a cuBLASLt product of a row count not run before (its algorithms preloaded)",
       [&] {
         EXPECT_TRUE((*gemm)->Gemm(x, kM - 1, kK, w, kN, 0.0f, y, LtGemm::Out::kF32, s).ok());
         cudaStreamSynchronize(s);
       }},
      {"a CUDA graph: capture, instantiate, launch",
       [&] {
         cudaGraph_t g = nullptr;
         cudaGraphExec_t exec = nullptr;
         cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
         cudaMemsetAsync(y, 0, 4096, s);
         cudaStreamEndCapture(s, &g);
         cudaGraphInstantiate(&exec, g, 0);
         cudaGraphLaunch(exec, s);
         cudaStreamSynchronize(s);
         cudaGraphExecDestroy(exec);
         cudaGraphDestroy(g);
       }},
      {"cudaStreamCreate",
       [&] {
         cudaStream_t t = nullptr;
         cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking);
         cudaStreamDestroy(t);
       }},
      {"cudaMallocHost", [&] { cudaMallocHost(&pinned, 1 << 20); }},
  };
  const char* mode = std::getenv("CUDA_MODULE_LOADING");
  std::printf("module loading: %s (set here: %s)\n", mode != nullptr ? mode : "the default (lazy)",
              kEagerModuleLoading ? "yes" : "no");
  for (const auto& [name, call] : calls) EXPECT_TRUE(returns(call)) << name << " waited for another stream's work";
  EXPECT_FALSE(returns([&] { cudaFree(plain); })) << "cudaFree did not wait: the blocked stream stands in for nothing";
  const bool unplanned = returns([&] {
    EXPECT_TRUE((*gemm)->Gemm(x, kM, kK / 2, w, kN, 0.0f, y, LtGemm::Out::kBF16, s).ok());
    cudaStreamSynchronize(s);
  });
  std::printf("a cuBLASLt product of a shape never planned %s for another stream's work\n",
              unplanned ? "did not wait" : "waited");
  cudaGetLastError();
  cudaStreamDestroy(s);
  for (void* p : {x, w, y}) cudaFree(p);
  cudaFreeHost(pinned);
  gemm->reset();
  cudaFree(ws);
}

// Decode steps replayed from CUDA graphs (batch padded to a bucket, block
// tables to a width) against the same steps launched kernel by kernel, on
// the same KV: bit-identical in the batch-invariant mode, within bf16 noise
// otherwise (the products' algorithms may differ between the padded and
// the exact row counts). Batches of 1 to 20 sequences, contexts crossing
// three table widths, each shape replayed again with longer contexts. The
// graphs were all captured before serving (WarmUp, as the engine does):
// batches 1-32 by widths 8-32, none captured later.
TEST(CudaRunnerTest, DecodeGraphsMatchStepsLaunchedOneByOne) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  const ModelConfig config = SmallConfig();
  for (bool invariant : {true, false}) {
    SCOPED_TRACE(invariant ? "batch-invariant" : "default");
    absl::StatusOr<std::unique_ptr<ModelRunner>> graphs = MakeRunner("cuda", config, 9, invariant, true);
    absl::StatusOr<std::unique_ptr<ModelRunner>> eager = MakeRunner("cuda", config, 9, invariant, false);
    ASSERT_TRUE(graphs.ok() && eager.ok());
    constexpr int kSeqs = 20, kBlocksPerSeq = 24;
    std::unique_ptr<KvStorage> kv_graphs = Pool(**graphs, kSeqs * kBlocksPerSeq);
    std::unique_ptr<KvStorage> kv_eager = Pool(**eager, kSeqs * kBlocksPerSeq);
    for (ModelRunner* r : {graphs->get(), eager->get()}) ASSERT_TRUE(r->ReserveSteps(4096, kSeqs, kBlocksPerSeq).ok());
    ASSERT_TRUE((*graphs)->WarmUp(*kv_graphs, kSeqs, kBlocksPerSeq).ok());
    ASSERT_TRUE((*eager)->WarmUp(*kv_eager, kSeqs, kBlocksPerSeq).ok());
    constexpr int kWarmGraphs = 6 * 3;  // batches 1, 2, 4, 8, 16, 32; widths 8, 16, 32
    EXPECT_EQ((*graphs)->decode_graphs(), kWarmGraphs);
    EXPECT_EQ((*eager)->decode_graphs(), 0);
    SamplingParams params;
    params.temperature = 0.0f;
    params.logprobs = 5;
    std::vector<int> len(kSeqs);
    std::vector<std::vector<int>> tokens(kSeqs);
    // Prompts of 100 + 9 s tokens, one eager prefill step each (same on both).
    for (int s = 0; s < kSeqs; ++s) {
      len[s] = 100 + 9 * s;
      tokens[s] = RandomTokens(len[s], config.vocab_size, 100 + s);
      std::vector<RowSampling> rows;
      const BatchInput in = PromptStep(tokens[s], s, kBlocksPerSeq, &params, &rows);
      std::vector<SampledToken> a, b;
      ASSERT_TRUE((*graphs)->Step(in, rows, *kv_graphs, &a).ok());
      ASSERT_TRUE((*eager)->Step(in, rows, *kv_eager, &b).ok());
    }
    std::vector<SampledToken> all_a, all_b;
    for (int round = 0; round < 2; ++round) {
      for (int n : {1, 3, 6, 17, 20}) {
        SCOPED_TRACE(absl::StrCat("round ", round, ", batch ", n));
        int width = 0;
        for (int s = 0; s < n; ++s) {
          width = std::max(width, (len[s] + 1 + 15) / 16);
          tokens[s].push_back(RandomTokens(1, config.vocab_size, 1000 * round + 10 * n + s)[0]);
          ++len[s];
        }
        std::vector<RowSampling> rows;
        const BatchInput in = DecodeStep(tokens, n, kBlocksPerSeq, width, &params, &rows);
        std::vector<SampledToken> a, b;
        absl::Status sa = (*graphs)->Step(in, rows, *kv_graphs, &a);
        absl::Status sb = (*eager)->Step(in, rows, *kv_eager, &b);
        ASSERT_TRUE(sa.ok()) << sa;
        ASSERT_TRUE(sb.ok()) << sb;
        ASSERT_EQ(a.size(), size_t(n));
        all_a.insert(all_a.end(), a.begin(), a.end());
        all_b.insert(all_b.end(), b.begin(), b.end());
      }
    }
    EXPECT_EQ((*graphs)->decode_graphs(), kWarmGraphs) << "a decode step captured a graph while serving";
    const Agreement agree = Compare(all_a, all_b);
    std::printf("%s: graphs vs one by one, top-1 %.4f, max |logprob diff| %.6f\n",
                invariant ? "batch-invariant" : "default", agree.top1, agree.max_diff);
    if (invariant) {
      EXPECT_EQ(agree.top1, 1.0);
      EXPECT_EQ(agree.max_diff, 0.0);
    } else {
      EXPECT_GE(agree.top1, 0.95);
      EXPECT_LE(agree.max_diff, 0.1);
    }
  }
}

// The runner's product paths that its environment picks (read when a
// runner is made): each setting, NAME=VALUE, set for the making and unset
// after.
using Env = std::vector<std::pair<const char*, const char*>>;

absl::StatusOr<std::unique_ptr<ModelRunner>> MakeRunnerWith(const Env& env, const ModelConfig& config, bool graphs) {
  for (const auto& [name, value] : env) EXPECT_EQ(setenv(name, value, 1), 0);
  absl::StatusOr<std::unique_ptr<ModelRunner>> r = MakeRunner("cuda", config, 9, false, graphs);
  for (const auto& [name, value] : env) EXPECT_EQ(unsetenv(name), 0);
  return r;
}

// A runner made with `env_a` and one made with `env_b` prefill the same
// prompts (20 + 7 s tokens), then take `steps` decode steps of sizes[i %
// sizes.size()] sequences, each token the first runner's pick: their
// samples' agreement.
Agreement DecodeAgreement(const Env& env_a, const Env& env_b, bool graphs, const std::vector<int>& sizes, int steps) {
  const ModelConfig config = SmallConfig();
  absl::StatusOr<std::unique_ptr<ModelRunner>> runners[2] = {MakeRunnerWith(env_a, config, graphs),
                                                             MakeRunnerWith(env_b, config, graphs)};
  EXPECT_TRUE(runners[0].ok() && runners[1].ok());
  if (!runners[0].ok() || !runners[1].ok()) return {};
  const int seqs = *std::max_element(sizes.begin(), sizes.end());
  constexpr int kBlocksPerSeq = 8;
  std::vector<std::unique_ptr<KvStorage>> pools;
  for (auto& r : runners) {
    EXPECT_TRUE((*r)->ReserveSteps(512, seqs, kBlocksPerSeq).ok());
    pools.push_back(Pool(**r, int64_t{seqs} * kBlocksPerSeq));
    EXPECT_TRUE((*r)->WarmUp(*pools.back(), seqs, kBlocksPerSeq).ok());
  }
  SamplingParams params;
  params.temperature = 0.0f;
  params.logprobs = 5;
  std::vector<std::vector<int>> tokens(seqs);
  std::vector<SampledToken> all[2];
  for (int s = 0; s < seqs; ++s) {
    tokens[s] = RandomTokens(20 + 7 * s, config.vocab_size, 50 + s);
    std::vector<RowSampling> rows;
    const BatchInput in = PromptStep(tokens[s], s, kBlocksPerSeq, &params, &rows);
    for (int r = 0; r < 2; ++r) {
      std::vector<SampledToken> out;
      const absl::Status st = (*runners[r])->Step(in, rows, *pools[r], &out);
      EXPECT_TRUE(st.ok()) << st;
      if (!st.ok() || out.size() != 1) return {};
      if (r == 0) tokens[s].push_back(out[0].token_id);
    }
  }
  for (int step = 0; step < steps; ++step) {
    const int n = sizes[step % sizes.size()];
    std::vector<RowSampling> rows;
    const BatchInput in = DecodeStep(tokens, n, kBlocksPerSeq, kBlocksPerSeq, &params, &rows);
    std::vector<SampledToken> out[2];
    for (int r = 0; r < 2; ++r) {
      const absl::Status st = (*runners[r])->Step(in, rows, *pools[r], &out[r]);
      EXPECT_TRUE(st.ok()) << st;
      EXPECT_EQ(out[r].size(), size_t(n));
      if (!st.ok() || out[r].size() != size_t(n)) return {};
      all[r].insert(all[r].end(), out[r].begin(), out[r].end());
    }
    for (int s = 0; s < n; ++s) tokens[s].push_back(out[0][s].token_id);
  }
  return Compare(all[0], all[1]);
}

// Decode steps of two to four sequences through the fused products
// (TANDEM_FUSED_ROWS=4) agree with the unfused path (TANDEM_FUSED_ROWS=1:
// the products of a few rows and the separate norm, RoPE and SiLU
// kernels), from graphs (three sequences: a bucket of four with a padded
// row) and launched one by one, with the norms in the products
// (TANDEM_FUSED_NORM_ROWS=9) or, as by default from two tokens, in kernels
// of their own.
TEST(CudaRunnerTest, FusedStepsOfSeveralTokensAgreeWithTheUnfusedPath) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  if (std::getenv("TANDEM_FUSED_ROWS") != nullptr || std::getenv("TANDEM_FUSED_GEMV") != nullptr ||
      std::getenv("TANDEM_FUSED_NORM_ROWS") != nullptr) {
    GTEST_SKIP() << "TANDEM_FUSED_ROWS, TANDEM_FUSED_NORM_ROWS or TANDEM_FUSED_GEMV is set: this test sets the first "
                    "two itself";
  }
  for (const auto& [graphs, norm_apart] : {std::pair{true, false}, std::pair{false, false}, std::pair{true, true}}) {
    SCOPED_TRACE(testing::Message() << (graphs ? "decode graphs" : "launched one by one")
                                    << (norm_apart ? ", norm kernels from two tokens" : ""));
    Env fused = {{"TANDEM_FUSED_ROWS", "4"}};
    if (!norm_apart) fused.emplace_back("TANDEM_FUSED_NORM_ROWS", "9");
    const Agreement agree = DecodeAgreement({{"TANDEM_FUSED_ROWS", "1"}}, fused, graphs, {2, 3, 4}, 18);
    std::printf("%s%s: fused several-token steps vs unfused, top-1 %.4f, max |logprob diff| %.6f\n",
                graphs ? "graphs" : "launched", norm_apart ? ", norm kernels" : "", agree.top1, agree.max_diff);
    EXPECT_GE(agree.top1, 0.95);
    EXPECT_LE(agree.max_diff, 0.1);
  }
}

// Decode steps of 3 to 16 sequences through the tensor-core products of a
// few rows (LaunchGemvMma, here up to kMaxGemvMmaRows rows) agree with the
// same steps through cuBLASLt (TANDEM_MMA_GEMV=0), from graphs (buckets of
// 4, 8 and 16 with padded rows) and launched one by one.
TEST(CudaRunnerTest, StepsOfAFewTokensOnTheTensorCoreProductsAgreeWithCublasLt) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  if (std::getenv("TANDEM_MMA_GEMV") != nullptr || std::getenv("TANDEM_GEMV") != nullptr) {
    GTEST_SKIP() << "TANDEM_MMA_GEMV or TANDEM_GEMV is set: this test sets the first itself";
  }
  for (const bool graphs : {true, false}) {
    SCOPED_TRACE(graphs ? "decode graphs" : "launched one by one");
    const Agreement agree =
        DecodeAgreement({{"TANDEM_MMA_GEMV", "0"}}, {{"TANDEM_MMA_GEMV", "16"}}, graphs, {3, 5, 8, 11, 16}, 15);
    std::printf("%s: tensor-core products of a few rows vs cuBLASLt, top-1 %.4f, max |logprob diff| %.6f\n",
                graphs ? "graphs" : "launched", agree.top1, agree.max_diff);
    EXPECT_GE(agree.top1, 0.95);
    EXPECT_LE(agree.max_diff, 0.1);
  }
}

// A step whose kernels find a slot or block id outside the pool is an
// InvalidArgument naming it (the error word read with the samples, one
// synchronization a step), and the next step starts clean.
TEST(CudaRunnerTest, AKernelErrorFailsItsStepAndNotTheNext) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner = MakeRunner("cuda", SmallConfig(), 5);
  ASSERT_TRUE(runner.ok()) << runner.status();
  std::unique_ptr<KvStorage> kv = Pool(**runner, 4);
  ASSERT_NE(kv, nullptr);
  SamplingParams params;
  params.temperature = 0.0f;
  const std::vector<int> prompt = {1, 2, 3, 4, 5, 6};
  auto step = [&](int64_t bad_slot, int bad_block) {
    BatchInput in;
    in.Clear();
    for (int t = 0; t < 6; ++t) {
      in.tokens.push_back(prompt[t]);
      in.positions.push_back(t);
      in.slot_mapping.push_back(t == 3 && bad_slot >= 0 ? bad_slot : t);
    }
    in.logits_rows = {5};
    in.query_start = {0, 6};
    in.context_lens = {6};
    in.prefilling = {1};
    in.max_blocks_per_seq = 1;
    in.block_tables = {bad_block};
    in.prefill_tokens = 6;
    std::vector<RowSampling> rows = {{.params = &params, .prompt = prompt, .position = 6}};
    std::vector<SampledToken> out;
    return (*runner)->Step(in, rows, *kv, &out);
  };
  absl::Status bad = step(/*bad_slot=*/4 * 16 + 3, 0);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_THAT(std::string(bad.message()), ::testing::HasSubstr("slot outside the pool"));
  EXPECT_TRUE(step(-1, 0).ok());
  bad = step(-1, /*bad_block=*/9);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_THAT(std::string(bad.message()), ::testing::HasSubstr("block id outside the pool"));
  EXPECT_TRUE(step(-1, 0).ok());
}

// The GPU's block checksums are HashBytes's values: every size class of
// XXH3 (the short paths on one lane, the long one over a warp; unaligned
// sizes on one lane), and through a device pool's KvStorage.
TEST(CudaRunnerTest, DeviceBlockChecksumsMatchTheHostHash) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  unsigned char secret[192];
  DefaultHashSecret(secret);
  void* d_secret = nullptr;
  ASSERT_EQ(cudaMalloc(&d_secret, sizeof(secret)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_secret, secret, sizeof(secret), cudaMemcpyHostToDevice), cudaSuccess);
  std::mt19937 rng(9);
  for (int64_t block_bytes : {1, 3, 8, 16, 100, 128, 200, 240, 241, 256, 1000, 1024, 1032, 4096, 65544, 2 << 20}) {
    SCOPED_TRACE(absl::StrCat("block bytes ", block_bytes));
    const int blocks = 5;
    std::vector<unsigned char> host(static_cast<size_t>(block_bytes * blocks));
    for (unsigned char& b : host) b = static_cast<unsigned char>(rng());
    void* d_pool = nullptr;
    void* d_io = nullptr;
    ASSERT_EQ(cudaMalloc(&d_pool, host.size()), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_io, 64 + 8 * 8), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_pool, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    const std::vector<int32_t> ids = {4, 0, 2, 2, 1, 3};
    ASSERT_EQ(cudaMemcpy(d_io, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    auto* d_out = reinterpret_cast<uint64_t*>(static_cast<char*>(d_io) + 64);
    ASSERT_EQ(cuda_ops::LaunchKvChecksums(d_pool, block_bytes, static_cast<const int32_t*>(d_io),
                                          static_cast<int>(ids.size()), static_cast<const unsigned char*>(d_secret),
                                          d_out, nullptr),
              0);
    std::vector<uint64_t> got(ids.size());
    ASSERT_EQ(cudaMemcpy(got.data(), d_out, got.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t j = 0; j < ids.size(); ++j) {
      EXPECT_EQ(got[j], HashBytes(host.data() + ids[j] * block_bytes, static_cast<size_t>(block_bytes))) << j;
    }
    cudaFree(d_pool);
    cudaFree(d_io);
  }
  cudaFree(d_secret);

  // Through a device pool: what a hand-off checksums.
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner = MakeRunner("cuda", SmallConfig(), 3);
  ASSERT_TRUE(runner.ok()) << runner.status();
  std::unique_ptr<KvStorage> kv = Pool(**runner, 6);
  ASSERT_NE(kv, nullptr);
  std::vector<unsigned char> bytes(static_cast<size_t>(kv->bytes()));
  for (unsigned char& b : bytes) b = static_cast<unsigned char>(rng());
  ASSERT_EQ(cudaMemcpy(kv->data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  const int32_t ids[] = {5, 1, 3};
  absl::StatusOr<std::vector<uint64_t>> sums = kv->BlockChecksums(ids);
  ASSERT_TRUE(sums.ok()) << sums.status();
  const int64_t per_block = kv->layout().block_bytes();
  for (size_t j = 0; j < 3; ++j) {
    EXPECT_EQ((*sums)[j], HashBytes(bytes.data() + ids[j] * per_block, static_cast<size_t>(per_block)));
  }
  const int32_t bad[] = {6};
  EXPECT_EQ(kv->BlockChecksums(bad).status().code(), absl::StatusCode::kOutOfRange);
}

TEST(CudaRunnerTest, RefusesBlockSizesItsKernelsDoNotTake) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  absl::StatusOr<std::unique_ptr<ModelRunner>> gpu = MakeRunner("cuda", SmallConfig(), 3);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  kernels::KvLayout l = (*gpu)->KvBlockLayout(24);
  l.num_blocks = 4;
  absl::Status s = (*gpu)->CheckKvLayout(l);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("16, 32 or 64"));
  // A host pool is refused by the step, naming what it got.
  kernels::KvLayout host = (*gpu)->KvBlockLayout(16);
  host.num_blocks = 2;
  absl::StatusOr<std::unique_ptr<KvStorage>> kv = KvStorage::Create(host);
  ASSERT_TRUE(kv.ok());
  BatchInput in;
  in.Clear();
  std::vector<SampledToken> out;
  s = (*gpu)->Step(in, {}, **kv, &out);
  EXPECT_THAT(std::string(s.message()), HasSubstr("got bfloat16 in host memory"));
}

TEST(CudaRunnerTest, GpuMemoryUtilizationSizesThePoolAndSaysWhenNothingIsLeft) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  absl::StatusOr<LoadedModel> model = LoadModel("builtin:small");
  ASSERT_TRUE(model.ok()) << model.status();
  EngineConfig c;
  c.runner = "cuda";
  c.gpu_memory_utilization = 0.25;
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(c, *model);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const int64_t pool = (*engine)->total_blocks() * KvStorage::BytesPerBlock((*engine)->kv_layout());
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  std::printf("pool %lld bytes; device in use %lld of %lld\n", static_cast<long long>(pool),
              static_cast<long long>(total - free_after), static_cast<long long>(total));
  EXPECT_GT(pool, int64_t(total) / 8);                                        // most of the quarter
  EXPECT_LE(int64_t(free_before) - int64_t(free_after), int64_t(total) / 4);  // and within it
  // A second worker's share beside it (the utilization is each one's own).
  absl::StatusOr<std::unique_ptr<Engine>> second = Engine::Create(c, *model);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NEAR(double((*second)->total_blocks()), double((*engine)->total_blocks()),
              double((*engine)->total_blocks()) / 50);
  second->reset();
  engine->reset();
  c.gpu_memory_utilization = 0.0001;
  absl::StatusOr<std::unique_ptr<Engine>> none = Engine::Create(c, *model);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("nothing is left for the KV cache"));
}

// Collects one request's tokens.
class Collect : public OutputSink {
 public:
  void OnToken(const SampledToken& t) override {
    std::lock_guard<std::mutex> l(mu_);
    tokens_.push_back(t.token_id);
    margins_.push_back(t.top_logprobs.size() >= 2 ? t.top_logprobs[0].logprob - t.top_logprobs[1].logprob : 99.0f);
  }
  // The gap between the two most likely tokens at each output position.
  std::vector<float> margins() {
    std::lock_guard<std::mutex> l(mu_);
    return margins_;
  }
  void OnFinish(const FinishInfo& info) override {
    std::lock_guard<std::mutex> l(mu_);
    info_ = info;
    done_ = true;
    cv_.notify_all();
  }
  std::vector<int> Wait(FinishInfo* info) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return done_; });
    *info = info_;
    return tokens_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::vector<int> tokens_;
  std::vector<float> margins_;
  FinishInfo info_;
};

struct Output {
  std::vector<int> tokens;
  std::vector<float> margins;
};

// Greedy outputs of `prompts`, all submitted at once.
std::vector<Output> Generate(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
                             int logprobs = 2) {
  std::vector<std::shared_ptr<Collect>> sinks;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateSpec spec{.request_id = "r" + std::to_string(i), .prompt = prompts[i]};
    spec.params.temperature = 0.0f;
    spec.params.max_tokens = max_tokens;
    spec.params.ignore_eos = true;
    spec.params.logprobs = logprobs;
    auto sink = std::make_shared<Collect>();
    absl::StatusOr<uint64_t> id = engine.Submit(std::move(spec), sink);
    EXPECT_TRUE(id.ok()) << id.status();
    sinks.push_back(sink);
  }
  std::vector<Output> out;
  for (auto& s : sinks) {
    FinishInfo info;
    Output o;
    o.tokens = s->Wait(&info);
    o.margins = s->margins();
    out.push_back(std::move(o));
    EXPECT_NE(info.reason, FinishReason::kError) << info.error;
  }
  return out;
}

// builtin:small's prompts take the prefill kernel; builtin:tiny's head size
// (16) the split-KV kernel with fixed splits.
class CudaBatchInvarianceTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaBatchInvarianceTest, TheEngineServesFromADevicePoolAndBatchingChangesNoGreedyOutput) {
  if (SkipWithoutGpu()) GTEST_SKIP();
  absl::StatusOr<LoadedModel> model = LoadModel(GetParam());
  ASSERT_TRUE(model.ok()) << model.status();
  EngineConfig c;
  c.runner = "cuda";
  c.runner_options.batch_invariant = true;
  c.block_size = 16;
  c.kv_cache_bytes = int64_t{256} << 20;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(c, *model);
  ASSERT_TRUE(engine.ok()) << engine.status();
  (*engine)->Start();
  std::mt19937 rng(9);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 64; ++i) {
    const int len = 8 + static_cast<int>(rng() % 200);
    std::vector<int> p = RandomTokens(len, model->config.vocab_size, 100 + i);
    prompts.emplace_back(p.begin(), p.end());
  }
  const std::vector<Output> batched = Generate(**engine, prompts, 24);
  // Without logprobs the greedy token comes from the GPU's argmax instead of
  // the host sampler: the same tokens.
  const std::vector<Output> on_gpu = Generate(**engine, prompts, 24, /*logprobs=*/-1);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(on_gpu[i].tokens, batched[i].tokens) << i;
  int differ = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<Output> alone = Generate(**engine, {prompts[i]}, 24);
    ASSERT_EQ(alone[0].tokens.size(), 24u);
    if (alone[0].tokens == batched[i].tokens) continue;
    ++differ;
    size_t at = 0;
    while (alone[0].tokens[at] == batched[i].tokens[at]) ++at;
    std::printf("sequence %zu (prompt %zu tokens) changed at output %zu, where its top-2 margin was %.5f alone\n", i,
                prompts[i].size(), at, alone[0].margins[at]);
  }
  (*engine)->Stop();
  EXPECT_EQ(differ, 0) << differ << " of 64 sequences changed their greedy output when batched";
}
INSTANTIATE_TEST_SUITE_P(Models, CudaBatchInvarianceTest, ::testing::Values("builtin:small", "builtin:tiny"));

}  // namespace
}  // namespace tandem::worker
