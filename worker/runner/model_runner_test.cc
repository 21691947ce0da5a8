#include "worker/runner/model_runner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "worker/engine/engine.h"
#include "worker/model/model_loader.h"

namespace tandem::worker {
namespace {

using ::testing::HasSubstr;

LoadedModel Tiny() {
  absl::StatusOr<LoadedModel> m = LoadModel("builtin:tiny");
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

TEST(ModelRunnerRegistryTest, BuiltinRunnersByName) {
  const ModelRunnerRegistry& r = ModelRunnerRegistry::Builtin();
  EXPECT_EQ(r.names(), (std::vector<std::string>{"cpu", "cuda", "sim"}));
  for (const char* name : {"cpu", "sim"}) {
    LoadedModel m = Tiny();
    absl::StatusOr<std::unique_ptr<ModelRunner>> runner = r.Create(name, m.config, m.tensors, {});
    ASSERT_TRUE(runner.ok()) << runner.status();
    EXPECT_EQ((*runner)->name(), name);
    EXPECT_EQ((*runner)->simulated(), std::string(name) == "sim");
    // Both keep f32 blocks on the host, laid out from the config alone.
    const kernels::KvLayout l = (*runner)->KvBlockLayout(16);
    const kernels::KvLayout want = HostKvLayout(m.config, 16);
    EXPECT_EQ(l.num_layers, want.num_layers);
    EXPECT_EQ(l.num_kv_heads, want.num_kv_heads);
    EXPECT_EQ(l.head_dim, want.head_dim);
    EXPECT_EQ(l.block_size, 16);
  }
  LoadedModel m = Tiny();
  absl::StatusOr<std::unique_ptr<ModelRunner>> bad = r.Create("tpu", m.config, m.tensors, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("unknown model runner 'tpu' (known: cpu, cuda, sim)"));
}

TEST(ModelRunnerRegistryTest, TheEngineRefusesAnUnknownRunnerByName) {
  EngineConfig c;
  c.runner = "cuda:7";
  EXPECT_THAT(std::string(c.Validate().message()), HasSubstr("unknown model runner 'cuda:7'"));
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(c, Tiny());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SimRunnerTest, TakesItsTimeAndDrawsTokensFromSeedAndPosition) {
  LoadedModel m = Tiny();
  RunnerOptions o;
  o.sim = SimTiming{.step_ms = 20, .prefill_us_per_token = 0, .decode_us_per_seq = 0, .context_ns_per_token = 0};
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner =
      ModelRunnerRegistry::Builtin().Create("sim", m.config, m.tensors, o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  BatchInput in;
  in.Clear();
  in.context_lens = {8, 8};
  in.logits_rows = {0, 1};
  in.decode_seqs = 2;
  SamplingParams params;
  const std::vector<RowSampling> rows = {{.params = &params, .seed = 1, .position = 8},
                                         {.params = &params, .seed = 2, .position = 8}};
  std::vector<SampledToken> first, again;
  kernels::KvLayout layout = (*runner)->KvBlockLayout(16);
  layout.num_blocks = 2;
  absl::StatusOr<std::unique_ptr<KvStorage>> kv = KvStorage::Create(layout);
  ASSERT_TRUE(kv.ok()) << kv.status();
  in.started = std::chrono::steady_clock::now();
  ASSERT_TRUE((*runner)->Step(in, rows, **kv, &first).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - in.started, std::chrono::milliseconds(20));
  in.started = std::chrono::steady_clock::now();
  ASSERT_TRUE((*runner)->Step(in, rows, **kv, &again).ok());
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].token_id, again[0].token_id);  // seed and position decide
  EXPECT_EQ(first[1].token_id, again[1].token_id);
  for (const SampledToken& t : first) {
    EXPECT_EQ(std::count(m.config.eos_token_ids.begin(), m.config.eos_token_ids.end(), t.token_id), 0);
  }
  // A bad timing is refused when the runner is made.
  LoadedModel m2 = Tiny();
  o.sim.step_ms = -1;
  EXPECT_FALSE(ModelRunnerRegistry::Builtin().Create("sim", m2.config, m2.tensors, o).ok());
}

TEST(CpuRunnerTest, RefusesAPoolItCannotUse) {
  LoadedModel m = Tiny();
  const ModelConfig config = m.config;
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner =
      ModelRunnerRegistry::Builtin().Create("cpu", config, m.tensors, {});
  ASSERT_TRUE(runner.ok()) << runner.status();
  BatchInput in;
  in.Clear();
  // A bfloat16 pool on the host, and a float32 pool that says it is on a device.
  kernels::KvLayout bf16 = (*runner)->KvBlockLayout(16);
  bf16.num_blocks = 1;
  bf16.dtype = kernels::DType::kBF16;
  absl::StatusOr<std::unique_ptr<KvStorage>> host_bf16 = KvStorage::Create(bf16);
  ASSERT_TRUE(host_bf16.ok());
  std::vector<SampledToken> out;
  absl::Status s = (*runner)->Step(in, {}, **host_bf16, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("got bfloat16 in host memory"));

  kernels::KvLayout f32 = (*runner)->KvBlockLayout(16);
  f32.num_blocks = 1;
  std::vector<char> backing(static_cast<size_t>(f32.total_bytes()));
  absl::StatusOr<std::unique_ptr<KvStorage>> device = KvStorage::Create(f32, [&](int64_t) -> absl::StatusOr<KvMemory> {
    return KvMemory{.data = backing.data(), .location = MemoryLocation::kDevice};
  });
  ASSERT_TRUE(device.ok());
  EXPECT_EQ((*device)->location(), MemoryLocation::kDevice);
  EXPECT_EQ((*device)->host_f32(), nullptr);
  s = (*runner)->Step(in, {}, **device, &out);
  EXPECT_THAT(std::string(s.message()), HasSubstr("got float32 in device memory"));
}

}  // namespace
}  // namespace tandem::worker
