#include "worker/model/builtin_models.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/export.h"
#include "worker/model/model_loader.h"

namespace tandem::worker {
namespace {

using ::testing::AllOf;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Lt;

// The published config.json files (meta-llama/Llama-3.1-8B-Instruct and
// meta-llama/Llama-3.2-1B-Instruct), keys that do not change the shape left out.
constexpr char kLlama31_8b[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
  "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 128256
})";
constexpr char kLlama32_1b[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
  "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 128256
})";

TEST(BuiltinModelsTest, PresetNames) {
  EXPECT_THAT(BuiltinModelNames(), ElementsAre("tiny", "small", "llama-3.2-1b", "llama-3.1-8b"));
  for (const std::string& name : BuiltinModelNames()) {
    absl::StatusOr<ModelConfig> c = BuiltinModelConfig(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_TRUE(ValidateModelConfig(*c).ok()) << name;
  }
  absl::StatusOr<ModelConfig> none = BuiltinModelConfig("llama-3.1-70b");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(),
              AllOf(HasSubstr("\"llama-3.1-70b\""), HasSubstr("tiny, small, llama-3.2-1b, llama-3.1-8b")));
}

// The large presets are the published models' shapes exactly; only the token
// ids of bos and eos are the byte-level vocabulary's (the builtin chat
// template's tokens), and the weights are f32 as generated.
TEST(BuiltinModelsTest, LargePresetsHaveThePublishedShapes) {
  for (const auto& [name, published_json] :
       {std::pair{"llama-3.1-8b", kLlama31_8b}, std::pair{"llama-3.2-1b", kLlama32_1b}}) {
    absl::StatusOr<ModelConfig> published = ParseModelConfig(published_json, name);
    ASSERT_TRUE(published.ok()) << published.status();
    published->bos_token_id = kBuiltinBeginOfTextId;
    published->eos_token_ids = {kBuiltinEndOfTextId, kBuiltinEotId};
    published->torch_dtype = "float32";
    absl::StatusOr<ModelConfig> preset = BuiltinModelConfig(name);
    ASSERT_TRUE(preset.ok()) << name;
    EXPECT_TRUE(*preset == *published) << name << ":\n" << ModelConfigToJson(*preset);
  }
  // 32 x (q 4096^2 + k, v 1024 x 4096 + o 4096^2 + gate, up, down 14336 x 4096
  // + 2 norms of 4096) + embeddings and lm_head 128256 x 4096 + the final norm.
  EXPECT_EQ(ParameterCount(*BuiltinModelConfig("llama-3.1-8b")), int64_t{8'030'261'248});
  // 16 x (q, o 2048^2 + k, v 512 x 2048 + 3 x 8192 x 2048 + 2 x 2048) +
  // tied embeddings 128256 x 2048 + 2048.
  EXPECT_EQ(ParameterCount(*BuiltinModelConfig("llama-3.2-1b")), int64_t{1'235'814'400});
}

// Loading a large preset checks shapes without generating a weight (the
// runner generates each as it reads it), and names the padded tokenizer.
TEST(BuiltinModelsTest, LargePresetsLoadLazily) {
  absl::StatusOr<LoadedModel> m = LoadModel("builtin:llama-3.1-8b");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->config.vocab_size, 128256);
  EXPECT_EQ(m->tokenizer_sha256, Sha256Hex(BuiltinTokenizerJson(128256)));
  EXPECT_NE(m->tokenizer_sha256, LoadModel("builtin:small")->tokenizer_sha256);
  absl::StatusOr<std::vector<int64_t>> embed = m->tensors->StoredShape("model.embed_tokens.weight");
  ASSERT_TRUE(embed.ok());
  EXPECT_THAT(*embed, ElementsAre(128256, 4096));
  // A small tensor of it, generated: near-identity norm weights.
  absl::StatusOr<Tensor> norm = m->tensors->Get("model.layers.31.input_layernorm.weight");
  ASSERT_TRUE(norm.ok());
  EXPECT_EQ(norm->data.size(), 4096u);
  EXPECT_THAT(norm->data, Each(AllOf(::testing::Gt(0.7f), Lt(1.3f))));

  absl::StatusOr<LoadedModel> tied = LoadModel("builtin:llama-3.2-1b");
  ASSERT_TRUE(tied.ok()) << tied.status();
  EXPECT_FALSE(tied->tensors->Has("lm_head.weight"));
  EXPECT_EQ(tied->tokenizer_sha256, m->tokenizer_sha256);  // one tokenizer for one vocabulary size
}

// Values are a function of the index alone: any number of threads, chunk
// boundaries (2^18) included, gives the same bits, odd lengths too.
TEST(BuiltinModelsTest, GenerationDoesNotDependOnThreads) {
  const size_t n = (size_t{1} << 19) + 3;
  std::vector<float> one(n);
  builtin_models_internal::FillNormal(0x1234, 0.5, 2.0, one, 1);
  for (int threads : {2, 3, 8}) {
    std::vector<float> many(n, -1.0f);
    builtin_models_internal::FillNormal(0x1234, 0.5, 2.0, many, threads);
    for (size_t k = 0; k < n; ++k) {
      ASSERT_EQ(std::bit_cast<uint32_t>(one[k]), std::bit_cast<uint32_t>(many[k])) << threads << " threads, " << k;
    }
  }
  // A prefix is the same values: a value does not depend on the length.
  std::vector<float> prefix(1001);
  builtin_models_internal::FillNormal(0x1234, 0.5, 2.0, prefix);
  for (size_t k = 0; k < prefix.size(); ++k) ASSERT_EQ(prefix[k], one[k]) << k;
}

double Rms(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += double{x} * x;
  return std::sqrt(sum / v.size());
}

// Tied embeddings are the output matrix too: the presets draw them at
// lm_head's scale (logits of std ~3, not ~sqrt(hidden)).
TEST(BuiltinModelsTest, PresetsScaleTiedEmbeddings) {
  ModelConfig config = *BuiltinModelConfig("tiny");  // hidden 64
  config.tie_word_embeddings = true;
  const SeededTensorSource scaled(config, 5, "scaled", /*scale_tied_embeddings=*/true);
  EXPECT_NEAR(Rms(scaled.Get("model.embed_tokens.weight")->data), 3.0 / 8, 0.01);
  const SeededTensorSource plain(config, 5, "plain");
  EXPECT_NEAR(Rms(plain.Get("model.embed_tokens.weight")->data), 1.0, 0.03);
  config.tie_word_embeddings = false;  // untied: lm_head has that scale, embeddings stay at 1
  const SeededTensorSource untied(config, 5, "untied", /*scale_tied_embeddings=*/true);
  EXPECT_EQ(untied.Get("model.embed_tokens.weight")->data, plain.Get("model.embed_tokens.weight")->data);
}

TEST(BuiltinModelsTest, FillerTokens) {
  EXPECT_EQ(BuiltinTokenText(383), "<|reserved_special_token_122|>");
  EXPECT_EQ(BuiltinTokenText(384), "<|filler_384|>");
  EXPECT_EQ(BuiltinTokenText(128255), "<|filler_128255|>");
  // No text encodes to a filler; the CLI's decoder shows none.
  const std::vector<int> ids = EncodeBuiltinText("<|filler_384|>");
  EXPECT_EQ(ids.size(), 14u);
  EXPECT_THAT(ids, Each(Lt(256)));
  const std::vector<int> with_filler = {72, 384, 105};
  EXPECT_EQ(DecodeBuiltinTokens(with_filler), "Hi");
}

}  // namespace
}  // namespace tandem::worker
